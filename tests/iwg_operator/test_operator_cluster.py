"""The operator against the real control plane: scheduling, scale, rollout, status, GC, Pod Security."""

from __future__ import annotations

import asyncio
import logging
import time
from collections import defaultdict
from typing import Any

import pytest
from iwg_operator import labels, metrics
from iwg_operator.api import v1alpha1 as api
from iwg_operator.api import wiring
from iwg_operator.controller import MIN_BACKOFF_SECONDS, Controller, group_from_body
from iwg_operator.credentials import from_kubeconfig
from iwg_operator.kube import Connection, KubeApi
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from tests.cluster.waiting import eventually, steady
from tests.iwg_operator.conftest import Groups

pytestmark = pytest.mark.cluster

GPU_PRODUCT = "NVIDIA-H100-80GB-HBM3"


def ready_replicas(groups: Groups, name: str, expected: int) -> bool:
    status = groups.get(name).get("status") or {}
    return status.get("readyReplicas") == expected and status.get("phase") == "Running"


def env_of(pod: Any) -> dict[str, str]:
    return {e.name: e.value for e in pod.spec.containers[0].env if e.value is not None}


def test_group_becomes_colocated_gpu_pods_with_wiring_and_is_garbage_collected(
    scheduler: Any, controller_manager: Any, gpu_nodes: list[str], groups: Groups, operator: Any, k8s: Any
) -> None:
    groups.create(
        "tp",
        replicas=2,
        worldSize=2,
        worker={"gpus": 2},
        scheduling={"colocateRanks": True, "gpuProduct": GPU_PRODUCT},
    )

    def bound() -> list[Any] | None:
        pods = groups.pods("tp")
        return pods if len(pods) == 4 and all(p.spec.node_name for p in pods) else None

    pods = eventually(bound, what="4 bound pods")
    nodes_by_replica: dict[str, set[str]] = defaultdict(set)
    for pod in pods:
        assert pod.spec.node_name in gpu_nodes
        assert pod.spec.containers[0].resources.limits["nvidia.com/gpu"] == "2"
        nodes_by_replica[pod.metadata.labels[labels.REPLICA]].add(pod.spec.node_name)
        env = env_of(pod)
        replica = pod.metadata.labels[labels.REPLICA]
        assert env[wiring.MASTER_ADDR] == f"tp-r{replica}-w0.tp-workers.{groups.namespace}.svc.cluster.local"
        assert env[wiring.RANK] == pod.metadata.labels[labels.RANK]
    assert {k: len(v) for k, v in nodes_by_replica.items()} == {"0": 1, "1": 1}, nodes_by_replica

    eventually(lambda: ready_replicas(groups, "tp", 2), what="Running with 2 ready replicas")
    status = groups.get("tp")["status"]
    assert status["selector"] == "app.kubernetes.io/component=worker,inference.iwg.dev/group=tp"
    assert [r["index"] for r in status["replicaStatuses"]] == [0, 1]
    ready = next(c for c in status["conditions"] if c["type"] == "Ready")
    assert (
        ready["status"] == "True"
        and ready["observedGeneration"] == groups.get("tp")["metadata"]["generation"]
    )
    eventually(lambda: any(e.reason == "CreatedPods" for e in groups.events("tp")), what="CreatedPods Event")

    core = client.CoreV1Api(k8s)
    ns = groups.namespace
    owned = {
        "service/tp-driver": lambda: core.read_namespaced_service("tp-driver", ns),
        "service/tp-workers": lambda: core.read_namespaced_service("tp-workers", ns),
        "secret/tp-curve": lambda: core.read_namespaced_secret("tp-curve", ns),
        "configmap/tp-config": lambda: core.read_namespaced_config_map("tp-config", ns),
        "deployment/tp-driver": lambda: client.AppsV1Api(k8s).read_namespaced_deployment("tp-driver", ns),
        "networkpolicy/tp-workers": lambda: client.NetworkingV1Api(k8s).read_namespaced_network_policy(
            "tp-workers", ns
        ),
        "networkpolicy/tp-driver": lambda: client.NetworkingV1Api(k8s).read_namespaced_network_policy(
            "tp-driver", ns
        ),
        "pdb/tp-workers": lambda: client.PolicyV1Api(k8s).read_namespaced_pod_disruption_budget(
            "tp-workers", ns
        ),
    }
    for what, read in owned.items():
        assert read().metadata.owner_references[0].name == "tp", what

    groups.delete("tp")

    def gone(read: Any) -> bool:
        try:
            read()
        except ApiException as error:
            return error.status == 404
        return False

    # The garbage collector learns about a new CRD at its next discovery resync (every 30 s).
    eventually(lambda: not groups.pods("tp"), timeout=90, what="pods garbage-collected")
    for what, read in owned.items():
        eventually(lambda read=read: gone(read), timeout=90, what=f"{what} garbage-collected")


def test_more_gpus_than_exist_reports_unschedulable(
    scheduler: Any, gpu_nodes: list[str], groups: Groups, operator: Any
) -> None:
    groups.create("huge", replicas=1, worldSize=2, worker={"gpus": 8}, scheduling={"colocateRanks": True})
    condition = eventually(
        lambda: (c := groups.condition("huge", "Unschedulable")) and c["status"] == "True" and c,
        what="Unschedulable condition",
    )
    assert "nvidia.com/gpu" in condition["message"] or "affinity" in condition["message"]
    assert groups.get("huge")["status"]["phase"] == "Pending"
    eventually(
        lambda: any(e.reason == "Unschedulable" and e.type == "Warning" for e in groups.events("huge")),
        what="Unschedulable Warning Event",
    )
    groups.delete("huge")


def test_kubectl_scale_and_columns(
    scheduler: Any, gpu_nodes: list[str], control_plane: Any, groups: Groups, operator: Any
) -> None:
    ns = groups.namespace
    groups.create("sc", replicas=1, worker={"gpus": 1})
    eventually(lambda: ready_replicas(groups, "sc", 1), what="1 ready replica")
    first = {p.metadata.name: p.metadata.uid for p in groups.pods("sc")}

    control_plane.kubectl("scale", "-n", ns, "iwg/sc", "--replicas=3")
    eventually(lambda: ready_replicas(groups, "sc", 3), what="3 ready replicas")
    assert sorted(p.metadata.name for p in groups.live_pods("sc")) == ["sc-r0-w0", "sc-r1-w0", "sc-r2-w0"]

    table = control_plane.kubectl("get", "iwg", "-n", ns).stdout.splitlines()
    assert table[0].split() == ["NAME", "REPLICAS", "READY", "WORLD", "PHASE", "ENGINE", "AGE"]
    assert table[1].split()[:5] == ["sc", "3", "3", "1", "Running"]
    scale = control_plane.kubectl("get", "--raw", f"/apis/inference.iwg.dev/v1alpha1/namespaces/{ns}/"
                                  "inferenceworkergroups/sc/scale").stdout  # fmt: skip
    assert '"replicas":3' in scale and "inference.iwg.dev/group=sc" in scale

    control_plane.kubectl("scale", "-n", ns, "iwg/sc", "--replicas=1")
    eventually(lambda: [p.metadata.name for p in groups.live_pods("sc")] == ["sc-r0-w0"], what="scaled to 1")
    assert groups.live_pods("sc")[0].metadata.uid == first["sc-r0-w0"], "the lowest replica is kept"
    eventually(lambda: ready_replicas(groups, "sc", 1), what="status shows 1 replica")
    groups.delete("sc")


def test_image_change_rolls_replica_by_replica_and_world_size_change_replaces(
    scheduler: Any, gpu_nodes: list[str], groups: Groups, operator: Any
) -> None:
    groups.create("roll", replicas=3, worker={"gpus": 0, "image": "worker:1"}, scheduling={
        "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]})  # fmt: skip
    eventually(lambda: ready_replicas(groups, "roll", 3), what="3 ready replicas")
    before = {p.metadata.name: p.metadata.uid for p in groups.pods("roll")}

    groups.patch("roll", {"worker": {"image": "worker:2"}})
    lowest_ready = 3
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        pods = groups.live_pods("roll")
        status = groups.get("roll").get("status") or {}
        lowest_ready = min(lowest_ready, sum(1 for p in pods if _ready(p)))
        if all(p.spec.containers[0].image == "worker:2" for p in pods) and ready_replicas(groups, "roll", 3):
            break
        time.sleep(0.05)
    else:
        raise AssertionError(f"rollout did not finish: {status}")
    assert lowest_ready >= 2, "maxUnavailable=1: never fewer than 2 of 3 replicas ready"
    after = {p.metadata.name: p.metadata.uid for p in groups.live_pods("roll")}
    assert after.keys() == before.keys() and all(after[n] != before[n] for n in after)
    assert sum(1 for e in groups.events("roll") if e.reason == "ReplacingReplicas") >= 1

    groups.patch("roll", {"worldSize": 2, "replicas": 2})
    eventually(
        lambda: (
            sorted(p.metadata.name for p in groups.live_pods("roll"))
            == ["roll-r0-w0", "roll-r0-w1", "roll-r1-w0", "roll-r1-w1"]
            and ready_replicas(groups, "roll", 2)
        ),
        what="world size 2",
    )
    pods = groups.live_pods("roll")
    assert all(p.metadata.uid not in after.values() for p in pods), "world size change replaces every pod"
    assert {env_of(p)[wiring.WORLD_SIZE] for p in pods} == {"2"}
    groups.delete("roll")


def _ready(pod: Any) -> bool:
    return any(c.type == "Ready" and c.status == "True" for c in pod.status.conditions or [])


def test_quiet_group_causes_no_writes(
    scheduler: Any, gpu_nodes: list[str], groups: Groups, operator: Any
) -> None:
    groups.create("quiet", replicas=2, worker={"gpus": 1})
    eventually(lambda: ready_replicas(groups, "quiet", 2), what="settled")

    def writes() -> float:
        total = 0.0
        for family in metrics.API_REQUESTS.collect():
            for sample in family.samples:
                if sample.name.endswith("_total") and sample.labels["verb"] in (
                    "create",
                    "apply",
                    "patch",
                    "delete",
                ):
                    total += sample.value
        return total

    before = steady(writes, for_s=5, timeout=60, what="the operator's writes after settling")  # the last land
    time.sleep(10)
    assert writes() == before, "a settled group must not cause API writes"
    metadata = groups.get("quiet")["metadata"]
    assert not metadata.get("annotations") and not metadata.get("finalizers"), "Kopf keeps no state on groups"
    groups.delete("quiet")


def test_pods_are_admitted_under_restricted_pod_security(
    scheduler: Any, controller_manager: Any, gpu_nodes: list[str], k8s: Any, groups: Groups, operator: Any
) -> None:
    core = client.CoreV1Api(k8s)
    core.patch_namespace(
        groups.namespace,
        {"metadata": {"labels": {"pod-security.kubernetes.io/enforce": "restricted",
                                 "pod-security.kubernetes.io/enforce-version": "latest"}}},
    )  # fmt: skip
    groups.create("secure", replicas=2, worldSize=2, worker={"gpus": 1, "shmSize": "2Gi"})
    eventually(lambda: len(groups.pods("secure")) == 4, what="4 worker pods admitted")
    # The driver's pod comes from its Deployment (ReplicaSet controller): admitted under the same policy.
    eventually(
        lambda: (
            core.list_namespaced_pod(
                groups.namespace, label_selector="app.kubernetes.io/component=driver"
            ).items
        ),
        what="driver pod admitted",
    )
    failed = groups.condition("secure", "ReconcileFailed")
    assert failed is None or failed["status"] == "False"
    groups.delete("secure")


async def test_a_group_in_a_namespace_being_deleted_stops_without_retries_or_warnings(
    control_plane: Any, controller_manager: Any, k8s: Any, namespace: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A namespace's deletion removes its pods before its groups: the reconciler then sees pods missing, and
    the API server refuses every create there. It must stop at the first refusal, not retry or warn."""
    core = client.CoreV1Api(k8s)
    hold = client.V1ConfigMap(
        metadata=client.V1ObjectMeta(name="hold", finalizers=["tests.iwg.dev/hold"])
    )  # keeps the namespace Terminating until the test lets it go
    core.create_namespaced_config_map(namespace, hold)
    core.delete_namespace(namespace)

    def refused_as_closing() -> bool:
        try:
            made = core.create_namespaced_config_map(
                namespace, client.V1ConfigMap(metadata=client.V1ObjectMeta(generate_name="probe-"))
            )
        except ApiException as error:
            return error.status == 403 and "NamespaceTerminating" in (error.body or "")
        core.delete_namespaced_config_map(made.metadata.name, namespace)
        return False

    eventually(refused_as_closing, what="creates refused because the namespace is terminating")
    kube = KubeApi(Connection.from_credentials(from_kubeconfig([control_plane.kubeconfig])))
    controller = Controller(kube)
    controller.bind_pod_index(lambda key: [])
    body = {
        "apiVersion": api.API_VERSION,
        "kind": api.KIND,
        "metadata": {"name": "doomed", "namespace": namespace, "uid": "u-doomed", "generation": 1},
        "spec": {"model": {"task": "embed", "path": "/models/m"}, "replicas": 2},
    }
    try:
        with caplog.at_level(logging.INFO, logger="iwg_operator"):
            controller.accept(body, group_from_body(body))
            state = controller.groups[(namespace, "doomed")]
            for _ in range(100):
                await asyncio.sleep(0.05)
                if state.group is None:
                    break
            assert state.group is None, "the reconciler kept the group after the namespace refused it"
            refused = kube.requests.counts[("create", "secrets", 403)]
            assert refused == 1 and kube.requests.writes() == 1, kube.requests.counts
            # Pods keep changing while the namespace empties: no further attempt, no backoff retry.
            controller.pods_changed(state.key)
            await asyncio.sleep(MIN_BACKOFF_SECONDS * 2)
            assert kube.requests.writes() == 1, kube.requests.counts
        warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
        assert not warnings, [r.getMessage() for r in warnings]
        assert any("being deleted" in r.getMessage() for r in caplog.records)
    finally:
        await controller.close()
        core.patch_namespaced_config_map("hold", namespace, {"metadata": {"finalizers": None}})


def test_the_workers_budget_lets_evictions_take_one_replica_at_a_time(
    scheduler: Any, controller_manager: Any, gpu_nodes: list[str], groups: Groups, operator: Any, k8s: Any
) -> None:
    """The eviction API (kubectl drain, cluster autoscalers) against the workers' PodDisruptionBudget, with the
    real disruption controller: 2 replicas of worldSize 2, maxUnavailable 1. An evicted rank takes its replica
    down, so one pod may go, not worldSize: with (replicas - maxUnavailable) x worldSize pods (before) a rank of
    each replica was evicted, both replicas down. With maxUnavailable on the PDB (before that) the controller
    had to resolve the group's scale subresource and on this control plane never did: every eviction refused.

    Every node is cordoned while evicting, as kubectl drain cordons the node it drains: otherwise the
    operator's replacement of an evicted pod is bound and Ready on a simulated node within a tenth of a second,
    the disruption controller counts it healthy again, and the next eviction is admitted for that reason (what
    made three evictions in a row pass in 4 of 9 runs before). The rank of replica 1 left running is torn down
    with it (health.restartPolicy Replica) rather than kept Ready beside a lone new rank."""
    ns = groups.namespace
    groups.create("evict", replicas=2, worldSize=2, worker={"gpus": 0}, scheduling={
        "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]})  # fmt: skip
    eventually(lambda: ready_replicas(groups, "evict", 2), what="2 ready replicas")
    policy, core = client.PolicyV1Api(k8s), client.CoreV1Api(k8s)

    def budget() -> Any:
        return policy.read_namespaced_pod_disruption_budget("evict-workers", ns).status

    eventually(
        lambda: (b := budget()).expected_pods == 4 and b.current_healthy == 4 and b.disruptions_allowed == 1,
        what="the budget: 4 pods expected, 1 may go",
    )

    def evict(name: str) -> int:
        body = client.V1Eviction(metadata=client.V1ObjectMeta(name=name, namespace=ns))
        try:
            core.create_namespaced_pod_eviction(name, ns, body)
            return 201
        except ApiException as error:
            return int(error.status)

    def cordon(unschedulable: bool) -> None:
        for node in gpu_nodes:
            core.patch_node(node, {"spec": {"unschedulable": unschedulable}})

    uids = {p.metadata.name: p.metadata.uid for p in groups.live_pods("evict")}
    rank_lost = metrics.PODS_REPLACED.labels("rank_lost")._value.get()
    cordon(True)
    try:
        assert evict("evict-r1-w1") == 201, budget()
        # Replica 1 is down; a rank of replica 0 would take it down too (before: admitted, 2 allowed).
        assert evict("evict-r0-w0") == 429, budget()

        def recreated() -> list[Any] | None:
            pods = {p.metadata.name: p for p in groups.live_pods("evict")}
            again = [pods.get(f"evict-r1-w{rank}") for rank in (0, 1)]
            # health.restartPolicy Replica (the default): the rank left running is torn down too, and the
            # replica created again as a whole (before: rank 0 kept running, Ready, counted as healthy).
            if all(p is not None and p.metadata.uid != uids[p.metadata.name] for p in again):
                return again
            return None

        again = eventually(recreated, what="replica 1 torn down and created again as a whole")
        assert not any(p.spec.node_name for p in again), "no node takes them while every node is cordoned"
        assert any(e.reason == "TearingDownReplicas" for e in groups.events("evict"))
        assert metrics.PODS_REPLACED.labels("rank_lost")._value.get() - rank_lost == 1  # rank 0 of replica 1
        assert evict("evict-r0-w0") == 429, budget()
        assert budget().current_healthy == 2, budget()  # replica 0's two ranks, no rank of replica 1
    finally:
        cordon(False)
    # Its replacement placed and Ready, the budget lets the next replica go.
    eventually(lambda: budget().disruptions_allowed == 1, what="1 may go again")
    assert evict("evict-r0-w0") == 201, budget()
    groups.delete("evict")
