"""Faults injected into real worker processes; the operator's health prober replaces them while clients keep
sending requests (the driver retries a batch whose replica died, so none fails)."""

from __future__ import annotations

import contextlib
import signal
import time
from typing import Any

import pytest
from kubernetes import client
from kubernetes.client import ApiClient

from tests.e2e.harness import (
    Load,
    await_replacement,
    eventually,
    group_manifest,
    live_ready_workers,
    openai_client,
    signal_worker,
    wait_serving,
    worker_pods,
)
from tests.iwg_operator.conftest import Groups
from tests.models import smollm2_manifest
from tests.nodeagent.fixture import NodeAgentProcess

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

PERIOD, THRESHOLD, TIMEOUT = 2, 2, 1
FAST_HEALTH = {
    "periodSeconds": PERIOD,
    "timeoutSeconds": TIMEOUT,
    "failureThreshold": THRESHOLD,
    "restartPolicy": "Pod",
    "backoffSeconds": 0,
}
# For groups whose test does not time the detection of a hung worker: a probe may take 4 s and three must
# fail, so a worker that answers late on a loaded machine (ranks computing, streams running, a stalled
# process) is not replaced by mistake. A killed worker's container ends, which the prober counts at once.
STEADY_PERIOD = 5
STEADY_HEALTH = {**FAST_HEALTH, "periodSeconds": STEADY_PERIOD, "timeoutSeconds": 4, "failureThreshold": 3}
MODEL = "all-MiniLM-L6-v2"


def create(control_plane: Any, namespace: str, manifest: dict[str, Any]) -> None:
    import yaml

    control_plane.kubectl("apply", "-n", namespace, "-f", "-", input=yaml.safe_dump(manifest))


def events(core: client.CoreV1Api, namespace: str, name: str, reason: str) -> list[Any]:
    found = core.list_namespaced_event(namespace, field_selector=f"involvedObject.name={name}").items
    return [e for e in found if e.reason == reason]


@pytest.mark.parametrize("fault", [signal.SIGKILL, signal.SIGSTOP], ids=["sigkill", "sigstop"])
def test_a_killed_or_hung_worker_is_replaced_under_load_without_failed_requests(
    fault: signal.Signals,
    node_agent: NodeAgentProcess,
    control_plane: Any,
    k8s: ApiClient,
    workspace: str,
    e2e_operator: Any,
) -> None:
    groups, core = Groups(k8s, workspace), client.CoreV1Api(k8s)
    name = "heal"
    create(control_plane, workspace, group_manifest(name, replicas=2, health=FAST_HEALTH))
    address = wait_serving(groups, core, node_agent, name, replicas=2)
    time.sleep(PERIOD * 2)  # the prober has seen every worker healthy: it supervises them

    load = Load(address, MODEL, clients=2).start()
    time.sleep(2)
    victim = live_ready_workers(core, workspace, name)[0]
    started = time.monotonic()
    signal_worker(victim, fault)
    recovery = await_replacement(core, groups, name, [victim], started, replicas=2)
    time.sleep(2)
    load.stop()

    print(
        f"{fault.name}: detected after {recovery.detected_s:.2f}s, serving in full after {recovery.ready_s:.2f}s"
    )
    assert load.failures == [], load.failures[:5]
    assert load.ok > 10
    if fault is signal.SIGSTOP:
        # Worst case: the stop lands just after a healthy answer; THRESHOLD rounds later the last probe times
        # out. 5 s more for a loaded machine (a stalled operator or API server); without the prober it would
        # never happen (await_replacement gives up after 180 s).
        assert recovery.detected_s <= PERIOD * THRESHOLD + TIMEOUT + 5
    unhealthy = events(core, workspace, name, "WorkerUnhealthy")
    assert any(victim.metadata.name in e.message for e in unhealthy), [e.message for e in unhealthy]
    assert (groups.get(name).get("status") or {}).get("restartCount", 0) >= 1


def true_condition(groups: Groups, name: str, kind: str, reason: str | None = None) -> dict[str, Any] | None:
    """The group's condition of type ``kind`` when it is True (and has ``reason``, when given)."""
    for condition in (groups.get(name).get("status") or {}).get("conditions") or []:
        wanted = reason is None or condition["reason"] == reason
        if condition["type"] == kind and condition["status"] == "True" and wanted:
            return dict(condition)
    return None


def sharded_smollm2(name: str, world_size: int, health: dict[str, Any]) -> dict[str, Any]:
    """The SmolLM2 example group (converted weights, a small KV cache) with ``world_size`` ranks."""
    manifest = smollm2_manifest(kv_blocks=64)
    manifest["metadata"] = {"name": name}
    spec = manifest["spec"]
    spec["worldSize"] = world_size
    spec["worker"] = {**spec["worker"], "cpu": "500m", "memory": "2Gi"}
    spec["health"] = health
    return manifest


def ask_france(address: str) -> str:
    answer = openai_client(address).chat.completions.create(
        model="smollm2",
        messages=[{"role": "user", "content": "What is the capital of France?"}],
        max_tokens=8,
        temperature=0,
    )
    return str(answer.choices[0].message.content)


def test_world_size_three_shards_smollm2_and_the_replica_policy_rebuilds_all_ranks(
    node_agent: NodeAgentProcess, control_plane: Any, k8s: ApiClient, workspace: str, e2e_operator: Any
) -> None:
    groups, core = Groups(k8s, workspace), client.CoreV1Api(k8s)
    name = "tp"
    health = {**STEADY_HEALTH, "restartPolicy": "Replica"}
    create(control_plane, workspace, sharded_smollm2(name, 3, health))
    address = wait_serving(groups, core, node_agent, name, replicas=1, timeout=400)
    assert "Paris" in ask_france(address)
    time.sleep(STEADY_PERIOD * 2)  # the prober has seen every rank healthy: it supervises them
    ranks = live_ready_workers(core, workspace, name)
    assert sorted(p.metadata.name for p in ranks) == ["tp-r0-w0", "tp-r0-w1", "tp-r0-w2"]
    started = time.monotonic()
    signal_worker(ranks[1], signal.SIGKILL)
    recovery = await_replacement(core, groups, name, ranks, started, replicas=1, timeout=400)
    print(
        f"world size 3: all ranks replaced, detected {recovery.detected_s:.2f}s, ready {recovery.ready_s:.2f}s"
    )
    assert recovery.replaced == ["tp-r0-w0", "tp-r0-w1", "tp-r0-w2"]
    # The rebuilt replica answers (the driver may take a heartbeat to see its ranks back).
    answer = eventually(
        lambda: ask_france(address), 120, "an answer from the rebuilt replica", 1.0, (Exception,)
    )
    assert "Paris" in answer


def test_a_model_that_cannot_be_sharded_is_refused_with_a_condition_naming_it(
    node_agent: NodeAgentProcess, control_plane: Any, k8s: ApiClient, workspace: str, e2e_operator: Any
) -> None:
    groups = Groups(k8s, workspace)
    name = "tp2"
    create(control_plane, workspace, sharded_smollm2(name, 2, FAST_HEALTH))

    def naming_the_refusal() -> dict[str, Any] | None:
        # The first failure reported may be rank 1's own: its peer, rank 0, refused and left the rendezvous.
        condition = true_condition(groups, name, "Degraded", "WorkerFailed")
        return condition if condition and "cannot shard" in condition["message"] else None

    condition = eventually(naming_the_refusal, 240, "the Degraded condition naming the refusal")
    message = condition["message"]
    assert "worldSize 2 cannot shard architecture LlamaForCausalLM" in message, message
    assert "9 attention heads, 3 key/value heads" in message and "1, 3" in message, message
    assert (groups.get(name).get("status") or {}).get("readyReplicas", 0) == 0


def test_an_always_crashing_worker_stops_after_the_restart_budget(
    node_agent: NodeAgentProcess, control_plane: Any, k8s: ApiClient, workspace: str, e2e_operator: Any
) -> None:
    groups, core = Groups(k8s, workspace), client.CoreV1Api(k8s)
    name = "crashy"
    health = {**FAST_HEALTH, "maxRestarts": 2, "restartWindowSeconds": 600, "backoffSeconds": 1}
    manifest = group_manifest(name, replicas=1, health=health)
    manifest["spec"]["model"]["path"] = "/nonexistent/model"
    create(control_plane, workspace, manifest)

    condition = eventually(
        lambda: true_condition(groups, name, "RestartBudgetExhausted"),
        240,
        "the RestartBudgetExhausted condition",
    )
    assert "spec.health.maxRestarts=2" in condition["message"]
    assert "crashy-r0-w0" in condition["message"]
    assert groups.get(name)["status"]["restartCount"] == 2
    pod_uid = worker_pods(core, workspace, name)[0].metadata.uid
    time.sleep(PERIOD * 4)
    assert [p.metadata.uid for p in worker_pods(core, workspace, name)] == [pod_uid]  # no more replacements
    assert groups.get(name)["status"]["restartCount"] == 2
    assert events(core, workspace, name, "RestartBudgetExhausted")


def test_a_device_fault_moves_the_replacement_to_another_node_and_names_the_node(
    node_agent: NodeAgentProcess, control_plane: Any, k8s: ApiClient, workspace: str, e2e_operator: Any
) -> None:
    from tests.e2e.faulty_worker import FAULT_DIR

    groups, core = Groups(k8s, workspace), client.CoreV1Api(k8s)
    name = "gpu"
    manifest = group_manifest(name, replicas=1, health=FAST_HEALTH)
    manifest["spec"]["worker"]["workerCls"] = "tests.e2e.faulty_worker.FaultyDeviceWorker"
    create(control_plane, workspace, manifest)
    wait_serving(groups, core, node_agent, name, replicas=1)
    time.sleep(PERIOD * 2)
    victim = live_ready_workers(core, workspace, name)[0]
    bad_node = victim.spec.node_name
    FAULT_DIR.mkdir(parents=True, exist_ok=True)
    marker = FAULT_DIR / victim.status.pod_ip
    marker.touch()
    try:
        await_replacement(core, groups, name, [victim], time.monotonic(), replicas=1)
    finally:
        marker.unlink(missing_ok=True)
        with contextlib.suppress(OSError):
            FAULT_DIR.rmdir()
    replacement = live_ready_workers(core, workspace, name)[0]
    assert replacement.spec.node_name != bad_node
    terms = replacement.spec.affinity.node_affinity.required_during_scheduling_ignored_during_execution
    assert any(
        e.operator == "NotIn" and bad_node in e.values
        for t in terms.node_selector_terms
        for e in t.match_expressions
    )
    faults = events(core, workspace, name, "DeviceFault")
    assert faults and bad_node in faults[0].message, [e.message for e in faults]
    # Kept in the status, so that an operator restart does not forget it (tests/iwg_operator/test_operator_restart.py).
    assert [e["node"] for e in groups.get(name)["status"]["avoidedNodes"]] == [bad_node]
