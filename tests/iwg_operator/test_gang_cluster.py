"""Gang placement against the real apiserver, scheduler and controller manager with GenericWorkload on
(`gang_control_plane`), and against the default control plane, which does not serve the API.

Each test on the gang control plane gets its own simulated GPU nodes, labelled with its namespace, and its
groups select them: tests never compete for each other's room.
"""

from __future__ import annotations

import http.server
import json
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from iwg_operator import labels, metrics
from iwg_operator.api import wiring
from iwg_operator.controller import ENV_GANG_API_RECHECK, EXPECTATION_SECONDS
from kopf.testing import KopfRunner
from kubernetes import client
from kubernetes.client import ApiClient

from tests.cluster.control_plane import GANG_FEATURE_GATES, GANG_RUNTIME_CONFIG, ControlPlane
from tests.cluster.fixtures import fresh_namespace
from tests.cluster.waiting import eventually
from tests.iwg_operator.conftest import Groups, install_crd, running_operator
from tests.iwg_operator.test_operator_restart import OperatorProcess

pytestmark = pytest.mark.cluster

POOL_LABEL = "tests.iwg.dev/pool"
SCHEDULING = ("scheduling.k8s.io", "v1beta1")
# Longest a gang may be seen partly bound while the scheduler's binding calls for its pods land (a loaded
# 2-core machine, where the scheduler, the API server or this test may stall for 2-3 s); a partial placement
# that holds GPUs lasts until something else changes.
BINDING_SECONDS = 5.0


class GangGroups(Groups):
    """Groups plus their Workloads and PodGroups."""

    def scheduling_objects(self, plural: str, name: str) -> list[dict[str, Any]]:
        selector = f"{labels.GROUP}={name}"
        found = self.custom.list_namespaced_custom_object(
            *SCHEDULING, self.namespace, plural, label_selector=selector
        )
        return list(found["items"])

    def pod_groups(self, name: str) -> list[dict[str, Any]]:
        return self.scheduling_objects("podgroups", name)

    def workloads(self, name: str) -> list[dict[str, Any]]:
        return self.scheduling_objects("workloads", name)

    def bound(self, name: str) -> int:
        return sum(1 for p in self.live_pods(name) if p.spec.node_name)


class NodePool:
    """GPU nodes of one test, labelled with its namespace (groups select them with a nodeSelector)."""

    def __init__(self, control_plane: ControlPlane, namespace: str) -> None:
        self.control_plane = control_plane
        self.namespace = namespace
        self.names: list[str] = []

    @property
    def selector(self) -> dict[str, Any]:
        return {"nodeSelector": {POOL_LABEL: self.namespace}}

    def grow(self, count: int) -> list[str]:
        self.names = self.control_plane.start_gpu_nodes(
            count=count, prefix=f"{self.namespace}-n", labels={POOL_LABEL: self.namespace}
        )
        return self.names


@pytest.fixture(scope="module")
def gang_crd(gang_control_plane: ControlPlane) -> dict[str, Any]:
    return install_crd(gang_control_plane)


@pytest.fixture
def gang_groups(gang_k8s: ApiClient, gang_namespace: str) -> GangGroups:
    return GangGroups(gang_k8s, gang_namespace)


@pytest.fixture
def pool(gang_control_plane: ControlPlane, gang_namespace: str) -> Iterator[NodePool]:
    nodes = NodePool(gang_control_plane, gang_namespace)
    try:
        yield nodes
    finally:
        gang_control_plane.delete_nodes(nodes.names)


@pytest.fixture
def gang_operator(
    gang_crd: dict[str, Any],
    gang_control_plane: ControlPlane,
    gang_namespace: str,
    monkeypatch: pytest.MonkeyPatch,
) -> Iterator[KopfRunner]:
    with running_operator(gang_control_plane, gang_namespace, monkeypatch) as runner:
        yield runner


def watch_bound(
    groups: GangGroups, names: list[str], world_size: int, until: Callable[[], bool], timeout: float
) -> float:
    """Poll until `until()`; returns the longest time any group spent with some but not all of a replica's
    pods bound. The scheduler binds a gang's pods in one go after they all passed Permit, but each binding is
    its own API call: a poll may catch a gang a few milliseconds into binding; a replica held half-placed
    would show for seconds."""
    partial_since: dict[str, float] = {}
    longest = 0.0
    deadline = time.monotonic() + timeout
    while True:
        now = time.monotonic()
        for name in names:
            if 0 < groups.bound(name) < world_size:
                partial_since.setdefault(name, now)
                longest = max(longest, now - partial_since[name])
            else:
                partial_since.pop(name, None)
        if until():
            return longest
        assert now < deadline, f"not reached in {timeout:.0f}s"
        time.sleep(0.05)


def gpu_spec(pool: NodePool, **spec: Any) -> dict[str, Any]:
    """A group of eight-GPU pods on the test's own nodes."""
    return {"worker": {"gpus": 8}, "scheduling": {**pool.selector, **spec.pop("scheduling", {})}, **spec}


def test_room_for_3_of_4_binds_3_without_a_gang_and_none_with_it_until_a_node_is_added(
    gang_groups: GangGroups, pool: NodePool, gang_control_plane: ControlPlane, gang_operator: KopfRunner
) -> None:
    pool.grow(3)  # 3 x 8 GPUs: room for 3 of the replica's 4 eight-GPU pods
    gang_groups.create("loose", **gpu_spec(pool, replicas=1, worldSize=4, scheduling={"gang": False}))
    eventually(lambda: gang_groups.bound("loose") == 3, what="3 of 4 pods bound without a gang")
    time.sleep(2)
    pods = gang_groups.live_pods("loose")
    assert gang_groups.bound("loose") == 3 and len(pods) == 4, "the partial placement holds 24 GPUs"
    assert not any(p.spec.scheduling_group for p in pods)
    assert not gang_groups.pod_groups("loose")
    gang_groups.patch("loose", {"replicas": 0})
    eventually(lambda: not gang_groups.pods("loose"), what="the partial replica's pods gone")

    gang_groups.create("tight", **gpu_spec(pool, replicas=1, worldSize=4))
    waiting = eventually(
        lambda: (
            (r := (gang_groups.get("tight").get("status") or {}).get("replicaStatuses"))
            and r[0].get("gang") == "Waiting"
            and "minCount" in (r[0].get("gangMessage") or "")
            and r[0]
        ),
        timeout=60,
        what="replica 0 waiting for room, with the scheduler's message",
    )
    assert waiting["pods"] == 4
    condition = gang_groups.condition("tight", "GangScheduling")
    assert condition is not None and condition["status"] == "True" and condition["reason"] == "Waiting"
    assert condition["message"].startswith("replica 0: ") and "minCount (4)" in condition["message"]
    described = gang_control_plane.kubectl("describe", "iwg", "tight", "-n", gang_groups.namespace).stdout
    assert "GangScheduling" in described and "minCount (4)" in described
    listed = gang_control_plane.kubectl(
        "get", "podgroups,workloads", "-n", gang_groups.namespace, "-l", f"{labels.GROUP}=tight", "-o", "name"
    ).stdout.split()
    assert sorted(listed) == ["podgroup.scheduling.k8s.io/tight-r0", "workload.scheduling.k8s.io/tight"]
    (pod_group,) = gang_groups.pod_groups("tight")
    assert pod_group["metadata"]["name"] == "tight-r0"
    assert pod_group["spec"]["schedulingPolicy"] == {"gang": {"minCount": 4}}
    assert pod_group["metadata"]["ownerReferences"][0]["name"] == "tight"
    (workload,) = gang_groups.workloads("tight")
    assert workload["spec"]["podGroupTemplates"][0]["schedulingPolicy"] == {"gang": {"minCount": 4}}
    assert {p.spec.scheduling_group.pod_group_name for p in gang_groups.pods("tight")} == {"tight-r0"}
    seen: set[int] = set()
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:  # room for 3: none binds
        seen.add(gang_groups.bound("tight"))
        time.sleep(0.05)
    assert seen == {0}, seen

    pool.grow(4)
    added = time.monotonic()
    partial = watch_bound(gang_groups, ["tight"], 4, lambda: gang_groups.bound("tight") == 4, timeout=60)
    sys.__stderr__.write(f"all 4 bound {time.monotonic() - added:.1f} s after the 4th node was added\n")
    assert partial < BINDING_SECONDS, f"the replica was half-placed for {partial:.1f} s"
    eventually(
        lambda: (
            (gang_groups.get("tight").get("status") or {}).get("replicaStatuses", [{}])[0].get("gang")
            == "Placed"
        ),
        what="status says the gang is placed",
    )
    placed = gang_groups.condition("tight", "GangScheduling")
    assert placed is not None and placed["reason"] == "Placed"


def test_two_groups_competing_for_room_for_one_replica_place_exactly_one_whole(
    gang_groups: GangGroups, pool: NodePool, gang_operator: KopfRunner
) -> None:
    pool.grow(4)  # 32 GPUs: one replica of 4 eight-GPU pods
    gang_groups.create("a", **gpu_spec(pool, replicas=1, worldSize=4))
    gang_groups.create("b", **gpu_spec(pool, replicas=1, worldSize=4))
    partial = watch_bound(
        gang_groups,
        ["a", "b"],
        4,
        lambda: sorted([gang_groups.bound("a"), gang_groups.bound("b")]) == [0, 4],
        90,
    )
    assert partial < BINDING_SECONDS, f"a replica was half-placed for {partial:.1f} s"
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:  # and it stays that way: no deadlock, no partial second replica
        counts = sorted([gang_groups.bound("a"), gang_groups.bound("b")])
        assert counts == [0, 4], counts
        time.sleep(0.1)


@pytest.fixture
def priority_classes(gang_k8s: ApiClient, gang_namespace: str) -> Iterator[dict[str, str]]:
    """Two PriorityClasses of this test (cluster-scoped, so named after its namespace): low 100, high 1000."""
    scheduling = client.SchedulingV1Api(gang_k8s)
    names = {level: f"{gang_namespace}-{level}" for level in ("low", "high")}
    for level, value in (("low", 100), ("high", 1000)):
        scheduling.create_priority_class({"metadata": {"name": names[level]}, "value": value})
    try:
        yield names
    finally:
        for name in names.values():
            scheduling.delete_priority_class(name)


def test_a_high_priority_gang_preempts_a_running_low_priority_gang_whole(
    gang_groups: GangGroups, pool: NodePool, priority_classes: dict[str, str], gang_operator: KopfRunner
) -> None:
    """v1.37 takes a gang's priority from its PodGroup (and refuses a gang whose pods' priority differs from
    it: without the class on the PodGroup neither gang ever binds). Room for one replica of 4 eight-GPU
    pods: the low gang runs; the high gang, created after it, preempts all of it and binds whole."""
    pool.grow(4)
    gang_groups.create(
        "low",
        **gpu_spec(pool, replicas=1, worldSize=4, scheduling={"priorityClassName": priority_classes["low"]}),
    )
    eventually(lambda: gang_groups.bound("low") == 4, timeout=60, what="the low gang placed")
    gang_groups.create(
        "high",
        **gpu_spec(pool, replicas=1, worldSize=4, scheduling={"priorityClassName": priority_classes["high"]}),
    )
    created = time.monotonic()
    partial = watch_bound(gang_groups, ["high"], 4, lambda: gang_groups.bound("high") == 4, timeout=90)
    sys.__stderr__.write(f"high gang bound {time.monotonic() - created:.1f} s after it was created\n")
    assert partial < BINDING_SECONDS, f"the high replica was half-placed for {partial:.1f} s"
    (high_group,) = gang_groups.pod_groups("high")
    assert high_group["spec"]["priorityClassName"] == priority_classes["high"]
    assert high_group["spec"]["priority"] == 1000  # resolved by the apiserver's priority admission
    (workload,) = gang_groups.workloads("high")
    assert workload["spec"]["podGroupTemplates"][0]["priorityClassName"] == priority_classes["high"]
    # The low gang's pods were preempted; the operator recreates them and they wait, none bound.
    eventually(
        lambda: gang_groups.bound("low") == 0 and len(gang_groups.live_pods("low")) == 4,
        timeout=60,
        what="the low gang preempted and waiting whole",
    )
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:  # and the high gang keeps its room
        assert (gang_groups.bound("high"), gang_groups.bound("low")) == (4, 0)
        time.sleep(0.1)


def settled_and_consistent(
    groups: GangGroups, name: str, replicas: int, image: str | None = None, world_size: int = 2
) -> bool:
    """Every replica has its worldSize pods bound and exactly one live PodGroup its pods name; nothing else."""
    status = groups.get(name).get("status") or {}
    pods = groups.live_pods(name)
    pod_groups = groups.pod_groups(name)
    live_groups = {g["metadata"]["name"] for g in pod_groups if not g["metadata"].get("deletionTimestamp")}
    wanted = {f"{name}-r{r}" for r in range(replicas)}
    return (
        status.get("phase") == "Running"
        and status.get("readyReplicas") == replicas
        and len(pods) == world_size * replicas
        and all(p.spec.node_name for p in pods)
        and (image is None or all(p.spec.containers[0].image == image for p in pods))
        and {p.spec.scheduling_group.pod_group_name for p in pods} == wanted
        and {g["metadata"]["name"] for g in pod_groups} == live_groups == wanted
        and [w["spec"]["podGroupTemplates"][0]["schedulingPolicy"] for w in groups.workloads(name)]
        == [{"gang": {"minCount": world_size}}]
        and all(g["spec"]["schedulingPolicy"] == {"gang": {"minCount": world_size}} for g in pod_groups)
    )


def test_scale_rollout_replica_restart_and_deletion_keep_podgroups_consistent_through_a_sigkill(
    gang_groups: GangGroups,
    pool: NodePool,
    gang_control_plane: ControlPlane,
    gang_crd: dict[str, Any],
    tmp_path: Path,
) -> None:
    pool.grow(2)
    operator = OperatorProcess(gang_control_plane, gang_groups.namespace, tmp_path / "operator.log")
    spec = {"worker": {"gpus": 1, "image": "worker:1"}, "scheduling": pool.selector}
    try:
        operator.start()
        gang_groups.create("life", replicas=1, worldSize=2, **spec)
        eventually(lambda: settled_and_consistent(gang_groups, "life", 1), timeout=60, what="1 replica")
        gang_groups.patch("life", {"replicas": 3})
        eventually(lambda: settled_and_consistent(gang_groups, "life", 3), timeout=60, what="scaled to 3")
        before = {g["metadata"]["name"]: g["metadata"]["uid"] for g in gang_groups.pod_groups("life")}

        # Rollout, with the operator killed once it has begun: PodGroups are replaced with their replicas.
        gang_groups.patch("life", {"worker": {"image": "worker:2"}})
        eventually(
            lambda: (
                any(g["metadata"].get("deletionTimestamp") for g in gang_groups.pod_groups("life"))
                or {g["metadata"]["uid"] for g in gang_groups.pod_groups("life")} != set(before.values())
            ),
            timeout=30,
            interval=0.01,
            what="the rollout began",
        )
        operator.kill()
        operator.start()
        eventually(
            lambda: settled_and_consistent(gang_groups, "life", 3, "worker:2"), timeout=120, what="rolled out"
        )
        rolled = {g["metadata"]["name"]: g["metadata"]["uid"] for g in gang_groups.pod_groups("life")}
        assert all(rolled[n] != before[n] for n in before), "every replica's PodGroup was replaced"

        # A Replica restart as the health prober begins it (its PodGroup deleted first), the operator killed
        # before it deleted the pods: the restarted operator finishes it.
        operator.kill()
        pods_before = {p.metadata.name: p.metadata.uid for p in gang_groups.live_pods("life")}
        gang_groups.custom.delete_namespaced_custom_object(
            *SCHEDULING, gang_groups.namespace, "podgroups", "life-r1"
        )
        operator.start()

        def replica_1_replaced() -> bool:
            pods = {p.metadata.name: p.metadata.uid for p in gang_groups.live_pods("life")}
            fresh = {g["metadata"]["name"]: g["metadata"]["uid"] for g in gang_groups.pod_groups("life")}
            return (
                settled_and_consistent(gang_groups, "life", 3)
                and fresh.get("life-r1") not in (None, rolled["life-r1"])
                and all(pods[n] != pods_before[n] for n in ("life-r1-w0", "life-r1-w1"))
                and all(pods[n] == pods_before[n] for n in pods if not n.startswith("life-r1-"))
            )

        eventually(replica_1_replaced, timeout=120, what="replica 1 replaced with a new PodGroup")

        gang_groups.patch("life", {"replicas": 1})
        eventually(lambda: settled_and_consistent(gang_groups, "life", 1), timeout=60, what="scaled to 1")

        # A world-size change: the Workload (its templates are fixed) and the PodGroup come back with minCount 3.
        gang_groups.patch("life", {"worldSize": 3})
        eventually(
            lambda: settled_and_consistent(gang_groups, "life", 1, world_size=3),
            timeout=60,
            what="world size 3",
        )

        gang_groups.delete("life")
        # The garbage collector takes pods, PodGroups (their finalizer lifted once the pods are gone) and the
        # Workload; it learns about a new CRD at its next discovery resync (every 30 s).
        eventually(
            lambda: (
                not gang_groups.pods("life")
                and not gang_groups.pod_groups("life")
                and not gang_groups.workloads("life")
            ),
            timeout=120,
            what="nothing left behind",
        )
    finally:
        operator.stop()
    log = operator.log.read_text()
    assert "Traceback" not in log, log[-4000:]


def _discoveries() -> float:
    return sum(
        sample.value
        for family in metrics.API_REQUESTS.collect()
        for sample in family.samples
        if sample.name.endswith("_total") and sample.labels["verb"] == "discover"
    )


def test_a_cluster_without_the_api_says_so_once_and_the_group_serves(
    scheduler: Any, gpu_nodes: list[str], groups: Groups, operator: KopfRunner
) -> None:
    before = _discoveries()
    groups.create("plain", replicas=1, worldSize=2, worker={"gpus": 1})
    condition = eventually(
        lambda: (c := groups.condition("plain", "GangScheduling")) and c["status"] == "False" and c,
        what="GangScheduling=False",
    )
    assert condition["reason"] == "ApiNotServed" and "scheduling.k8s.io/v1beta1" in condition["message"]
    eventually(
        lambda: (
            (s := groups.get("plain").get("status") or {}).get("phase") == "Running"
            and s.get("readyReplicas") == 1
        ),
        what="the group runs without gangs",
    )
    assert all(not p.spec.scheduling_group for p in groups.pods("plain"))
    groups.patch("plain", {"replicas": 2})
    eventually(lambda: (groups.get("plain").get("status") or {}).get("readyReplicas") == 2, what="scaled")
    time.sleep(1)
    warnings = [e for e in groups.events("plain") if e.reason == "GangSchedulingUnavailable"]
    assert len(warnings) == 1 and warnings[0].type == "Warning" and (warnings[0].count or 1) == 1
    assert _discoveries() - before == 1, (
        "discovery is asked once per recheck interval (60 s), not on every pass"
    )


class FakeWorkerHealth:
    """A /healthz answer on one simulated pod's own address (kwok gives pods loopback addresses), so the
    operator's real health prober supervises that pod and then sees it fail."""

    def __init__(self, ip: str) -> None:
        self.healthy = True
        self.requests = 0
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                outer.requests += 1
                body = json.dumps({"alive": outer.healthy}).encode()
                self.send_response(200 if outer.healthy else 500)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer((ip, wiring.DEFAULT_HEALTH_PORT), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def test_a_replica_restart_by_the_health_prober_replaces_its_podgroup_with_its_pods(
    gang_groups: GangGroups, pool: NodePool, gang_operator: KopfRunner
) -> None:
    pool.grow(2)
    health = {"periodSeconds": 1, "timeoutSeconds": 1, "failureThreshold": 1, "backoffSeconds": 0,
              "maxBackoffSeconds": 0, "restartPolicy": "Replica"}  # fmt: skip
    gang_groups.create(
        "heal", replicas=2, worldSize=2, worker={"gpus": 1}, scheduling=pool.selector, health=health
    )
    eventually(lambda: settled_and_consistent(gang_groups, "heal", 2), timeout=60, what="2 replicas")
    pods = {p.metadata.name: p for p in gang_groups.live_pods("heal")}
    before = {g["metadata"]["name"]: g["metadata"]["uid"] for g in gang_groups.pod_groups("heal")}
    workers = [FakeWorkerHealth(pods[f"heal-r1-w{rank}"].status.pod_ip) for rank in range(2)]
    try:
        eventually(
            lambda: all(w.requests for w in workers), timeout=60, what="the prober supervises replica 1"
        )
        workers[1].healthy = False

        def replaced() -> bool:
            now = {p.metadata.name: p.metadata.uid for p in gang_groups.live_pods("heal")}
            groups_now = {g["metadata"]["name"]: g["metadata"]["uid"] for g in gang_groups.pod_groups("heal")}
            return (
                all(now.get(n) not in (None, pods[n].metadata.uid) for n in ("heal-r1-w0", "heal-r1-w1"))
                and groups_now.get("heal-r1") not in (None, before["heal-r1"])
                and settled_and_consistent(gang_groups, "heal", 2)
            )

        eventually(replaced, timeout=90, what="replica 1 replaced with a new PodGroup")
    finally:
        for worker in workers:
            worker.close()
    now = {p.metadata.name: p.metadata.uid for p in gang_groups.live_pods("heal")}
    assert all(now[n] == pods[n].metadata.uid for n in ("heal-r0-w0", "heal-r0-w1")), "replica 0 untouched"
    assert {g["metadata"]["name"]: g["metadata"]["uid"] for g in gang_groups.pod_groups("heal")}[
        "heal-r0"
    ] == (before["heal-r0"])
    assert any(e.reason == "WorkerUnhealthy" for e in gang_groups.events("heal"))


def test_gang_api_enabled_after_the_operator_started_is_found_and_used_without_a_restart(
    request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A control plane of its own, started without the gang API; the operator runs, the group says
    GangScheduling=False (ApiNotServed). The apiserver is restarted (same port, same etcd) with GenericWorkload
    and scheduling.k8s.io/v1beta1, the controller manager and scheduler with the gate: the operator's next
    discovery (every IWG_GANG_API_RECHECK_S, 2 s here) finds the API, Kopf watches PodGroups, the condition
    turns True, and a replica added from then on is placed as a gang; the replica placed before stays as it
    was (its running pods name no PodGroup). Fails where discovery is cached for the operator's life."""
    monkeypatch.setenv(ENV_GANG_API_RECHECK, "2")
    cp = ControlPlane(name="iwg-late-gang").start()
    api = cp.api_client()
    try:
        cp.start_controller_manager()  # ServiceAccounts, garbage collection; no scheduler before the API
        install_crd(cp)
        with fresh_namespace(request, cp, api) as namespace, running_operator(cp, namespace, monkeypatch):
            groups = GangGroups(api, namespace)
            pool = NodePool(cp, namespace)
            spec = {"worker": {"gpus": 8}, "scheduling": pool.selector}
            groups.create("late", replicas=1, worldSize=2, **spec)
            eventually(
                lambda: (
                    (c := groups.condition("late", "GangScheduling")) is not None
                    and c["status"] == "False"
                    and c["reason"] == "ApiNotServed"
                ),
                timeout=60,
                what="GangScheduling False while the API is not served",
            )
            eventually(lambda: len(groups.live_pods("late")) == 2, what="replica 0's pods, loose")
            assert not any(p.spec.scheduling_group for p in groups.live_pods("late"))

            cp.feature_gates, cp.runtime_config = GANG_FEATURE_GATES, GANG_RUNTIME_CONFIG
            cp.restart_apiserver()
            enabled = time.monotonic()
            cp.stop_component("kube-controller-manager")
            cp.start_controller_manager()
            cp.start_scheduler()
            pool.grow(4)
            eventually(
                lambda: (
                    (c := groups.condition("late", "GangScheduling")) is not None and c["status"] == "True"
                ),
                timeout=60,
                what="GangScheduling True once the API is served",
            )
            sys.__stderr__.write(
                f"GangScheduling True {time.monotonic() - enabled:.1f} s after the restart\n"
            )
            eventually(lambda: groups.bound("late") == 2, timeout=60, what="replica 0 bound, loose")

            groups.patch("late", {"replicas": 2})
            made = time.monotonic()
            eventually(
                lambda: (
                    [g["metadata"]["name"] for g in groups.pod_groups("late")] == ["late-r1"]
                    and groups.bound("late") == 4
                ),
                timeout=60,
                what="replica 1 placed as a gang (its PodGroup), replica 0 as it was",
            )
            by_replica = {
                p.metadata.name: p.spec.scheduling_group.pod_group_name if p.spec.scheduling_group else None
                for p in groups.live_pods("late")
            }
            assert sorted(map(str, by_replica.values())) == ["None", "None", "late-r1", "late-r1"], by_replica
            eventually(
                lambda: (
                    (c := groups.condition("late", "GangScheduling")) is not None and c["reason"] == "Placed"
                ),
                timeout=30,
                what="GangScheduling Placed: both replicas",
            )
            # What the operator knows of PodGroups must come from its watch (the PodGroup index), not only from
            # what it remembers creating (kept EXPECTATION_SECONDS): past that, a scale-down still finds late-r1.
            time.sleep(max(0.0, made + EXPECTATION_SECONDS + 2 - time.monotonic()))
            groups.patch("late", {"replicas": 1})
            eventually(
                lambda: not groups.pod_groups("late") and len(groups.live_pods("late")) == 2,
                timeout=60,
                what="replica 1 and its PodGroup gone on scale-down",
            )
            pool.control_plane.delete_nodes(pool.names)
    finally:
        api.close()  # type: ignore[no-untyped-call]
        cp.stop()
