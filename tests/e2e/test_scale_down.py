"""`kubectl scale` (or an HPA) lowering replicas under load: the operator drains the leaving replica in every
driver before it deletes its pods, so no batch in flight is cut (no driver retries one) and no request fails;
a driver that does not answer holds a scale-down for at most the drain timeout."""

from __future__ import annotations

import contextlib
import signal
import time
import urllib.request
from typing import Any

import pytest
import yaml
from kubernetes import client
from kubernetes.client import ApiClient

from tests.e2e.harness import (
    Load,
    driver_pods,
    eventually,
    group_manifest,
    pod_ready,
    signal_worker,
    wait_serving,
)
from tests.iwg_operator.conftest import Groups
from tests.nodeagent.fixture import NodeAgentProcess

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

MODEL = "all-MiniLM-L6-v2"
# The undo test's batches: long enough that a drain outlasts the steps of a scale-down and its undo on a loaded
# machine (kubectl twice, the operator's watch and pass), short enough that the driver's limits hold: two
# batches in flight on one replica (run one after the other) within its 30 s batch timeout, and a request that
# waits behind four batches (replica 1 drained, all on replica 0) within its 60 s request timeout.
UNDO_BATCH_S = 10


def driver_metric(address: str, series: str, port: int = 8000) -> float:
    """The sum of the driver's samples whose line starts with `series` (a name, or a name and labels)."""
    with urllib.request.urlopen(f"http://{address}:{port}/metrics", timeout=5) as response:
        text = response.read().decode()
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(series))


def retried_batches(address: str, port: int = 8000) -> float:
    """Batches the driver retried on another replica because theirs went away."""
    return driver_metric(address, "iwg_batch_retries_total", port)


def serve_slow_group(
    control_plane: Any,
    node_agent: NodeAgentProcess,
    groups: Groups,
    core: client.CoreV1Api,
    name: str,
    batch_seconds: float | None = None,
    max_batch_size: int | None = None,
    drivers: int = 1,
) -> str:
    """Two serving replicas of SlowWorker and `drivers` ready drivers; returns a driver's address."""
    manifest = group_manifest(name, replicas=2)
    manifest["spec"]["driver"]["replicas"] = drivers
    if max_batch_size is not None:
        manifest["spec"]["driver"]["batching"] = {"maxBatchSize": max_batch_size}
    manifest["spec"]["worker"]["workerCls"] = "tests.e2e.slow_worker.SlowWorker"
    if batch_seconds is not None:
        manifest["spec"]["worker"]["env"] = [{"name": "E2E_SLOW_BATCH_S", "value": f"{batch_seconds:g}"}]
    control_plane.kubectl("apply", "-n", groups.namespace, "-f", "-", input=yaml.safe_dump(manifest))
    address = wait_serving(groups, core, node_agent, name, replicas=2)
    eventually(
        lambda: len([p for p in driver_pods(core, groups.namespace, name) if pod_ready(p)]) == drivers,
        120,
        f"{drivers} drivers ready",
    )
    return address


def test_kubectl_scale_down_drains_the_leaving_replica_in_every_driver_before_deleting_its_pods(
    node_agent: NodeAgentProcess, control_plane: Any, k8s: ApiClient, workspace: str, e2e_operator: Any
) -> None:
    groups, core = Groups(k8s, workspace), client.CoreV1Api(k8s)
    name = "shrink"
    serve_slow_group(control_plane, node_agent, groups, core, name, drivers=2)
    drivers = {p.metadata.name: p.status.pod_ip for p in driver_pods(core, workspace, name)}
    # Each driver routes its own clients' batches to both replicas (each batch takes 0.4 s more than the model
    # needs), so each has batches in flight on replica 1 when the scale-down comes.
    loads = {pod: Load(ip, MODEL, clients=3, inputs=2).start() for pod, ip in drivers.items()}
    time.sleep(3)
    before = {pod: retried_batches(ip) for pod, ip in drivers.items()}

    control_plane.kubectl("scale", "-n", workspace, f"inferenceworkergroup/{name}", "--replicas=1")
    eventually(
        lambda: {p.metadata.labels["inference.iwg.dev/replica"] for p in groups.pods(name)} == {"0"},
        90,
        "replica 1's pods gone",
    )
    time.sleep(2)
    for load in loads.values():
        load.stop()

    for pod, load in loads.items():
        assert load.failures == [], (pod, load.failures[:3])
        assert load.ok > 5, pod
        assert retried_batches(drivers[pod]) == before[pod], (
            f"{pod} cut a batch: replica 1 went with it in flight"
        )
        # Both drivers were asked, not only the first one ready.
        log = node_agent.container_log(workspace, pod, "driver", lines=100_000)
        assert "replica 1: draining" in log and "replica 1: drained" in log, log[-3000:]
    events = core.list_namespaced_event(workspace, field_selector=f"involvedObject.name={name}").items
    drained = [e.message for e in events if e.reason == "DrainedReplicas"]
    assert len(drained) == 1 and "replicas 1 in 2 drivers" in drained[0], drained


def test_a_driver_that_does_not_answer_holds_a_scale_down_only_for_the_drain_timeout(
    node_agent: NodeAgentProcess, control_plane: Any, k8s: ApiClient, workspace: str, e2e_operator: Any
) -> None:
    groups, core = Groups(k8s, workspace), client.CoreV1Api(k8s)
    name = "stuck"
    control_plane.kubectl(
        "apply",
        "-n",
        workspace,
        "-f",
        "-",
        input=yaml.safe_dump(group_manifest(name, replicas=2, rollout={"drainTimeoutSeconds": 2})),
    )
    wait_serving(groups, core, node_agent, name, replicas=2)
    selector = f"inference.iwg.dev/group={name},app.kubernetes.io/component=driver"
    driver = next(
        p for p in core.list_namespaced_pod(workspace, label_selector=selector).items if pod_ready(p)
    )
    signal_worker(driver, signal.SIGSTOP)  # still Ready for a while: the drain request is sent and hangs
    try:
        started = time.monotonic()
        control_plane.kubectl("scale", "-n", workspace, f"inferenceworkergroup/{name}", "--replicas=1")
        eventually(
            lambda: all(
                p.metadata.deletion_timestamp
                for p in groups.pods(name)
                if p.metadata.labels["inference.iwg.dev/replica"] == "1"
            ),
            60,
            "replica 1's pods deleted",
        )
        held = time.monotonic() - started
    finally:
        with contextlib.suppress(ProcessLookupError):  # the kubelet's liveness probe may have restarted it
            signal_worker(driver, signal.SIGCONT)
    events = core.list_namespaced_event(workspace, field_selector=f"involvedObject.name={name}").items
    failed = [e.message for e in events if e.reason == "DrainFailed"]
    assert len(failed) == 1 and "replicas 1 not drained" in failed[0], failed
    assert f"driver pod {driver.metadata.name}:" in failed[0], failed  # which driver did not answer
    # The drain request waits drainTimeoutSeconds plus 10 s for the driver's answer, then the pods go.
    assert 2 <= held < 2 + 10 + 15, held


def replica_state(address: str, replica: int) -> str:
    """The driver's state of one replica."""
    for state in ("joining", "serving", "draining", "dead"):
        if driver_metric(address, f'iwg_replica_state{{replica="{replica}",state="{state}"}}') == 1:
            return state
    return "unknown"


def test_a_scale_down_undone_while_draining_leaves_the_replica_serving(
    node_agent: NodeAgentProcess, control_plane: Any, k8s: ApiClient, workspace: str, e2e_operator: Any
) -> None:
    groups, core = Groups(k8s, workspace), client.CoreV1Api(k8s)
    name = "undo"
    # One input per batch: four clients' requests arriving together would otherwise share one batch, sent to
    # replica 0 every time, and replica 1 might never get one.
    address = serve_slow_group(
        control_plane, node_agent, groups, core, name, batch_seconds=UNDO_BATCH_S, max_batch_size=1
    )
    eventually(lambda: replica_state(address, 1) == "serving", 30, "replica 1 serving")
    replica_1 = {
        p.metadata.uid for p in groups.pods(name) if p.metadata.labels["inference.iwg.dev/replica"] == "1"
    }
    load = Load(address, MODEL, clients=4, inputs=1).start()  # 10 s batches on both replicas
    eventually(
        lambda: driver_metric(address, 'iwg_inflight_batches{replica="1"}') >= 1, 30, "a batch on replica 1"
    )

    # The drain lasts until replica 1's batches in flight are done (up to two of 10 s, run one after the
    # other); the undo must land within it, or the operator deletes replica 1's pods.
    control_plane.kubectl("scale", "-n", workspace, f"inferenceworkergroup/{name}", "--replicas=1")
    eventually(lambda: replica_state(address, 1) == "draining", 30, "replica 1 draining")
    control_plane.kubectl("scale", "-n", workspace, f"inferenceworkergroup/{name}", "--replicas=2")
    # Undrained by the pass after the drain's (which waits for the batches in flight).
    eventually(lambda: replica_state(address, 1) == "serving", 60, "replica 1 serving again")
    load.stop()

    assert {
        p.metadata.uid
        for p in groups.live_pods(name)
        if p.metadata.labels["inference.iwg.dev/replica"] == "1"
    } == replica_1
    assert load.failures == [], load.failures[:3]
