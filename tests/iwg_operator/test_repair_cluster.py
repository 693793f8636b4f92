"""Self-healing on the real control plane: children deleted or edited by hand come back, and pods that keep
ending Failed are replaced within spec.health's restart budget and backoff (issue 30 items 3 and 4)."""

from __future__ import annotations

import dataclasses
import sys
import threading
import time
from collections import Counter
from typing import Any

import pytest
from iwg_operator import builders, drift, metrics
from iwg_operator.controller import group_from_body
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from tests.cluster.waiting import eventually, steady
from tests.iwg_operator.conftest import Groups

pytestmark = pytest.mark.cluster

# How soon a repair must be done: the operator watches its children, so a repair is one pass of the group's
# loop (plus the watch's delivery), far less than this (which leaves room for a loaded machine, where any
# process may stall for seconds).
REPAIR_WITHIN_S = 30.0
WRITE_VERBS = ("create", "apply", "patch", "delete")


def api_writes() -> Counter[tuple[str, str]]:
    """The operator's API writes the server took so far, by (verb, resource): the operator runs in this process
    (KopfRunner)."""
    counts: Counter[tuple[str, str]] = Counter()
    for family in metrics.API_REQUESTS.collect():
        for sample in family.samples:
            done = sample.labels["code"].startswith("2")
            if sample.name.endswith("_total") and sample.labels["verb"] in WRITE_VERBS and done:
                counts[(sample.labels["verb"], sample.labels["resource"])] += int(sample.value)
    return counts


class Children:
    """The ten objects a group of world size 1 owns besides its pods, read through the real API server."""

    def __init__(self, k8s: Any, namespace: str, group: str) -> None:
        self.ns, self.group = namespace, group
        self.core = client.CoreV1Api(k8s)
        self.apps = client.AppsV1Api(k8s)
        self.net = client.NetworkingV1Api(k8s)
        self.policy = client.PolicyV1Api(k8s)
        g, ns = group, namespace
        self.readers = {
            ("deployments", f"{g}-driver"): lambda: self.apps.read_namespaced_deployment(f"{g}-driver", ns),
            ("services", f"{g}-driver"): lambda: self.core.read_namespaced_service(f"{g}-driver", ns),
            ("services", f"{g}-drivers"): lambda: self.core.read_namespaced_service(f"{g}-drivers", ns),
            ("services", f"{g}-workers"): lambda: self.core.read_namespaced_service(f"{g}-workers", ns),
            ("secrets", f"{g}-curve"): lambda: self.core.read_namespaced_secret(f"{g}-curve", ns),
            ("configmaps", f"{g}-config"): lambda: self.core.read_namespaced_config_map(f"{g}-config", ns),
            ("networkpolicies", f"{g}-workers"): lambda: self.net.read_namespaced_network_policy(
                f"{g}-workers", ns
            ),
            ("networkpolicies", f"{g}-driver"): lambda: self.net.read_namespaced_network_policy(
                f"{g}-driver", ns
            ),
            ("poddisruptionbudgets", f"{g}-workers"): lambda: (
                self.policy.read_namespaced_pod_disruption_budget(f"{g}-workers", ns)
            ),
            ("poddisruptionbudgets", f"{g}-driver"): lambda: (
                self.policy.read_namespaced_pod_disruption_budget(f"{g}-driver", ns)
            ),
        }

    def read(self) -> dict[tuple[str, str], Any]:
        """Every child that exists now."""
        found = {}
        for key, read in self.readers.items():
            try:
                found[key] = read()
            except ApiException as error:
                if error.status != 404:
                    raise
        return found

    def raw(self, kind: str, name: str) -> dict[str, Any]:
        """A child as the API server serves it (JSON, as the operator's watch sees it)."""
        api_client = self.core.api_client
        item = self.readers[(kind, name)]()
        body: dict[str, Any] = api_client.sanitize_for_serialization(item)
        return body


def test_children_deleted_or_edited_by_hand_come_back_and_nothing_else_is_rewritten(
    scheduler: Any, gpu_nodes: list[str], groups: Groups, operator: Any, k8s: Any
) -> None:
    name, ns = "heal", groups.namespace
    groups.create(name, replicas=1, worker={"gpus": 1})
    children = Children(k8s, ns, name)
    eventually(
        lambda: (
            (groups.get(name).get("status") or {}).get("phase") == "Running" and len(children.read()) == 10
        ),
        what="the group Running with its ten children",
    )
    # What the operator wrote is what its builders produce, field by field: comparing them costs no write.
    # The pods and the driver's template carry the hash of the Secret's public keys.
    keys = builders.keys_digest(dict(children.core.read_namespaced_secret(f"{name}-curve", ns).data))
    group = dataclasses.replace(group_from_body(groups.get(name)), keys=keys)
    settings = builders.BuildSettings()
    desired = {
        ("deployments", f"{name}-driver"): builders.driver_deployment(group),
        ("services", f"{name}-driver"): builders.driver_service(group),
        ("services", f"{name}-drivers"): builders.drivers_service(group),
        ("services", f"{name}-workers"): builders.headless_service(group),
        ("configmaps", f"{name}-config"): builders.config_map(group, settings),
        ("networkpolicies", f"{name}-workers"): builders.network_policy(group, settings),
        ("networkpolicies", f"{name}-driver"): builders.driver_network_policy(group, settings),
        ("poddisruptionbudgets", f"{name}-workers"): builders.pod_disruption_budget(group),
        ("poddisruptionbudgets", f"{name}-driver"): builders.driver_disruption_budget(group),
    }
    for (kind, child), manifest in desired.items():
        assert drift.in_sync(manifest, children.raw(kind, child)), f"{kind}/{child} differs as written"
    time.sleep(2)  # the driver's Deployment and the PDBs get their status from their controllers
    before = children.read()
    secret_data = before[("secrets", f"{name}-curve")].data
    pod_before = {p.metadata.name: p.metadata.uid for p in groups.live_pods(name)}
    writes_before = api_writes()

    # By hand: the driver Deployment, both NetworkPolicies and the CURVE Secret deleted, together with a worker
    # pod (its replacement must not come before its Secret and policy); the driver Service edited (selector and
    # port).
    children.apps.delete_namespaced_deployment(f"{name}-driver", ns)
    children.net.delete_namespaced_network_policy(f"{name}-workers", ns)
    children.net.delete_namespaced_network_policy(f"{name}-driver", ns)
    children.core.delete_namespaced_secret(f"{name}-curve", ns)
    children.core.delete_namespaced_pod(f"{name}-r0-w0", ns, grace_period_seconds=0)
    children.core.patch_namespaced_service(
        f"{name}-driver",
        ns,
        [
            {"op": "replace", "path": "/spec/selector", "value": {"app": "somebody-else"}},
            {"op": "replace", "path": "/spec/ports/0/port", "value": 9999},
        ],
    )
    started = time.monotonic()

    def repaired() -> dict[tuple[str, str], Any] | None:
        now = children.read()
        if len(now) != 10:
            return None
        service = now[("services", f"{name}-driver")].spec
        if service.ports[0].port != 8000 or service.selector.get("app") == "somebody-else":
            return None
        return now

    after = eventually(repaired, timeout=REPAIR_WITHIN_S, what="the deleted and edited children repaired")
    took = time.monotonic() - started
    print(f"children repaired {took:.2f}s after the deletions and the edit", file=sys.__stderr__)

    recreated = {
        ("deployments", f"{name}-driver"),
        ("networkpolicies", f"{name}-workers"),
        ("networkpolicies", f"{name}-driver"),
        ("secrets", f"{name}-curve"),
    }
    for key in recreated:
        assert after[key].metadata.uid != before[key].metadata.uid, f"{key} was not recreated"
        assert drift.owned_by(children.raw(*key), group.uid), key
    assert after[("secrets", f"{name}-curve")].data == secret_data, "the Secret came back with other keys"
    service = after[("services", f"{name}-driver")].spec
    assert service.selector == {
        "app.kubernetes.io/component": "driver",
        "inference.iwg.dev/group": name,
    }, service.selector

    # Nothing else rewritten: the other children keep their generation, or where they have none (Services,
    # ConfigMap) their resourceVersion (the PDBs' status moves with the pods).
    def version(item: Any) -> str:
        return str(item.metadata.generation or item.metadata.resource_version)

    for key in set(before) - recreated - {("services", f"{name}-driver")}:
        assert version(after[key]) == version(before[key]), key
    # The worker pod came back, not before the Secret and the policies that fence it.
    pod = eventually(
        lambda: next((p for p in groups.live_pods(name) if p.metadata.uid not in pod_before.values()), None),
        what="the deleted worker pod recreated",
    )
    for key in recreated - {("deployments", f"{name}-driver")}:
        assert pod.metadata.creation_timestamp >= after[key].metadata.creation_timestamp, key

    def whole_again() -> bool:
        # The status the repairs end in: the new worker pod ready (on a loaded machine kwok marks it Ready
        # later than 2 s after, and that status write is not a loop), and the recreated Deployment's driver pod
        # the only one, reported in DriverAvailable (the old ReplicaSet's pod is collected and the new one made
        # by the controller manager, at its own pace: each changes the condition's message once).
        status = groups.get(name).get("status") or {}
        if status.get("readyReplicas") != 1 or status.get("phase") != "Running":
            return False
        drivers = children.core.list_namespaced_pod(
            ns, label_selector=f"app.kubernetes.io/component=driver,inference.iwg.dev/group={name}"
        ).items
        if len(drivers) != 1 or drivers[0].metadata.deletion_timestamp is not None:
            return False
        driver = {c["type"]: c for c in status.get("conditions") or []}.get("DriverAvailable") or {}
        return driver.get("status") == "True" or drivers[0].metadata.name in str(driver.get("message"))

    eventually(whole_again, what="the group's status whole again")
    # Whatever the repairs still had under way has landed: no write for 5 s.
    settled = steady(api_writes, for_s=5, timeout=60, what="the operator's writes after the repairs")
    written = settled - writes_before
    children_written = {
        k: v for k, v in written.items() if k[1] not in ("pods", "inferenceworkergroups", "events")
    }
    # The edited Service: one write (an apply, or where the apply is refused because the edited port is
    # another manager's item beside the operator's, a merge patch that puts the fields back).
    services = sum(v for (verb, kind), v in children_written.items() if kind == "services")
    assert services == 1, written
    assert {k: v for k, v in children_written.items() if k[1] != "services"} == {
        ("create", "deployments"): 1,
        ("create", "networkpolicies"): 2,
        ("create", "secrets"): 1,
    }, written
    # Settled again: no writes at all.
    time.sleep(5)
    assert api_writes() == settled, "a repaired group keeps writing"
    groups.delete(name)


def _reject_pods(core: Any, namespace: str, stop: threading.Event, seen: dict[str, set[str]]) -> None:
    """Every worker pod of the namespace, once bound, ends Failed as a kubelet that lacks its GPUs would make it
    (the simulated node runs it otherwise). `seen`: group -> the uids of its pods."""
    selector = "app.kubernetes.io/component=worker"
    while not stop.is_set():
        for pod in core.list_namespaced_pod(namespace, label_selector=selector).items:
            group = pod.metadata.labels["inference.iwg.dev/group"]
            seen.setdefault(group, set()).add(pod.metadata.uid)
            if pod.spec.node_name and pod.status.phase != "Failed" and not pod.metadata.deletion_timestamp:
                status = {
                    "phase": "Failed",
                    "reason": "UnexpectedAdmissionError",
                    "message": "Allocate failed due to requested number of devices unavailable for "
                    "nvidia.com/gpu. Requested: 1, Available: 0",
                    "conditions": [{"type": "Ready", "status": "False"}],
                }
                try:
                    core.patch_namespaced_pod_status(pod.metadata.name, namespace, {"status": status})
                except ApiException as error:
                    if error.status not in (404, 409):
                        raise
        stop.wait(0.05)


def test_pods_that_end_failed_are_replaced_within_the_restart_budget_and_backoff(
    scheduler: Any, gpu_nodes: list[str], groups: Groups, operator: Any, k8s: Any
) -> None:
    """The kubelet rejects every pod (no GPUs after all). `slow`: maxRestarts 1, backoffSeconds 60: within the
    test's window its one pod waits out the backoff. `fast`: backoffSeconds 1: one replacement, then the
    budget is spent (condition and Event). Before, each Failed pod was deleted and recreated at once: ~50
    creates and deletes in 10 s."""
    health = {"periodSeconds": 1, "timeoutSeconds": 1, "maxRestarts": 1, "restartPolicy": "Pod"}
    core = client.CoreV1Api(k8s)
    stop, seen = threading.Event(), {}
    rejecter = threading.Thread(target=_reject_pods, args=(core, groups.namespace, stop, seen), daemon=True)
    rejecter.start()
    replaced_before = api_writes()[("delete", "pods")]
    try:
        groups.create("slow", replicas=1, worker={"gpus": 1}, health={**health, "backoffSeconds": 60})
        groups.create("fast", replicas=1, worker={"gpus": 1}, health={**health, "backoffSeconds": 1})
        exhausted = eventually(
            lambda: (c := groups.condition("fast", "RestartBudgetExhausted")) and c["status"] == "True" and c,
            timeout=30,
            what="fast: RestartBudgetExhausted",
        )
        time.sleep(10)  # the window: nothing more may be created or deleted
    finally:
        stop.set()
        rejecter.join(timeout=10)
    assert "maxRestarts=1" in exhausted["message"], exhausted
    assert "UnexpectedAdmissionError" in exhausted["message"], exhausted
    print(
        f"pods created: slow {len(seen.get('slow', ()))}, fast {len(seen.get('fast', ()))}",
        file=sys.__stderr__,
    )
    assert len(seen["slow"]) == 1, f"slow: {len(seen['slow'])} pods within its 60 s backoff"
    assert len(seen["fast"]) == 2, f"fast: {len(seen['fast'])} pods for a budget of 1 replacement"
    assert api_writes()[("delete", "pods")] - replaced_before == 1
    reasons = Counter(e.reason for e in groups.events("fast"))
    assert reasons["WorkerUnhealthy"] == 1 and reasons["RestartBudgetExhausted"] == 1, reasons
    assert not any(e.reason == "WorkerUnhealthy" for e in groups.events("slow"))
    assert groups.get("fast")["status"]["restartCount"] == 1
    groups.delete("slow")
    groups.delete("fast")
