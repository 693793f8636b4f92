"""The group survives its driver: the driver process SIGKILLed under load (the kubelet, here the node agent,
restarts its container). The group's status says the driver is down while it is; the workers keep running
(same processes, one model load in their logs) and serve the restarted driver within 10 s of its pod being
Ready; every request is answered correctly or fails with a connection error (or, sent before the driver was
Ready again, a 503 from the driver that has no worker yet), none hangs."""

from __future__ import annotations

import os
import signal
import time
from typing import Any

import pytest
from kubernetes import client
from kubernetes.client import ApiClient

from tests.e2e.harness import (
    Load,
    driver_pods,
    eventually,
    group_manifest,
    live_ready_workers,
    pod_ready,
    process_of,
    wait_serving,
)
from tests.e2e.test_selfheal import MODEL, create
from tests.iwg_operator.conftest import Groups
from tests.nodeagent.fixture import NodeAgentProcess

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

LOADED = "ready on"  # WorkerProc's line once its model is loaded
SERVING_AGAIN_LIMIT_S = 10.0


def driver_condition(groups: Groups, name: str) -> dict[str, Any]:
    for condition in (groups.get(name).get("status") or {}).get("conditions") or []:
        if condition["type"] == "DriverAvailable":
            return dict(condition)
    return {}


def test_a_killed_driver_comes_back_and_the_same_workers_serve_it(
    node_agent: NodeAgentProcess, control_plane: Any, k8s: ApiClient, workspace: str, e2e_operator: Any
) -> None:
    groups, core = Groups(k8s, workspace), client.CoreV1Api(k8s)
    name = "phoenix"
    create(control_plane, workspace, group_manifest(name, replicas=2))
    address = wait_serving(groups, core, node_agent, name, replicas=2)
    workers = live_ready_workers(core, workspace, name)
    pids = {p.metadata.name: process_of(p) for p in workers}
    eventually(lambda: driver_condition(groups, name).get("status") == "True", 30, "DriverAvailable")

    load = Load(address, MODEL, clients=3).start()
    time.sleep(2)
    (driver,) = driver_pods(core, workspace, name)
    killed = time.monotonic()
    process = process_of(driver)
    os.kill(process, signal.SIGKILL)

    down: dict[str, Any] = {}
    ready_at: float | None = None
    deadline = killed + 120
    while ready_at is None:
        assert time.monotonic() < deadline, (
            f"the driver did not come back; condition {driver_condition(groups, name)}"
        )
        condition = driver_condition(groups, name)
        if not down and condition.get("status") == "False":
            down = {**condition, "after_s": time.monotonic() - killed}
        (pod,) = driver_pods(core, workspace, name)
        if down and pod_ready(pod) and process_of(pod) != process:
            ready_at = time.monotonic()
        time.sleep(0.05)
    time.sleep(SERVING_AGAIN_LIMIT_S)
    load.stop()

    answered_after = sorted(
        start + seconds for start, seconds in load.latencies if start + seconds > ready_at
    )
    serving_again_s = answered_after[0] - ready_at if answered_after else float("inf")
    print(
        f"driver SIGKILL: status said down after {down['after_s']:.2f} s ({down['reason']}); pod Ready again after "
        f"{ready_at - killed:.2f} s; serving {serving_again_s:.2f} s after Ready; {load.ok} answered, "
        f"{len(load.failures)} failed"
    )
    assert down["reason"] == "DriverDown", down
    assert serving_again_s <= SERVING_AGAIN_LIMIT_S
    # Answers are checked by Load (one 384-float vector per input); failures are connection errors, or a 503
    # from the restarted driver to a request sent before its pod was Ready (a Service would not send it one).
    for failure, sent in zip(load.failures, load.failed_at, strict=True):
        refused_early = failure.startswith("InternalServerError: Error code: 503") and sent < ready_at
        assert failure.startswith("APIConnectionError") or refused_early, (failure, sent - killed)
    assert any(f.startswith("APIConnectionError") for f in load.failures), (
        "the load never met the dead driver"
    )
    assert sum(1 for start, _ in load.latencies if start > ready_at) > 5
    eventually(lambda: driver_condition(groups, name).get("status") == "True", 30, "DriverAvailable again")

    # The same worker processes, never restarted, with one model load each.
    after = {p.metadata.name: p for p in live_ready_workers(core, workspace, name)}
    assert {n: process_of(p) for n, p in after.items()} == pids
    for pod in after.values():
        assert all(s.restart_count == 0 for s in pod.status.container_statuses)
        log = node_agent.container_log(workspace, pod.metadata.name, "worker", lines=100_000)
        assert log.count(LOADED) == 1, log[-3000:]
        # A worker that missed three pings says so, and says when the new driver reached it (one whose pings
        # resumed sooner, the driver back within its heartbeat window, need not have noticed).
        if "driver lost: no ping" in log:
            assert "driver reached this worker again" in log, log[-3000:]
