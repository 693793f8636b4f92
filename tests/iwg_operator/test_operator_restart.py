"""Kill the operator (SIGKILL) and start it again: in the middle of creating a 16-pod group it leaves exactly 16
pods; what it learnt about faulty nodes (status.avoidedNodes) still keeps new pods off them."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from iwg_operator import labels
from iwg_operator.api import v1alpha1 as api

from tests.cluster.waiting import eventually
from tests.iwg_operator.conftest import Groups

pytestmark = pytest.mark.cluster

ROOT = Path(__file__).resolve().parents[2]
REPLICAS, WORLD_SIZE = 4, 4


class OperatorProcess:
    """`iwg-operator` as its own process, so that it can be killed without a chance to clean up."""

    def __init__(self, control_plane: Any, namespace: str, log: Path) -> None:
        self.control_plane = control_plane
        self.namespace = namespace
        self.log = log
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        env = {**self.control_plane.env(), "PYTHONPATH": os.pathsep.join([str(ROOT / "operator"), str(ROOT)])}
        with self.log.open("ab") as out:
            self.proc = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "iwg_operator.main",
                    "--namespace",
                    self.namespace,
                    "--log-level",
                    "warning",
                ],
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT,
            )

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(timeout=10)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.kill()


@pytest.fixture
def operator_process(
    controller_manager: Any, iwg_crd: Any, control_plane: Any, namespace: str, tmp_path: Path
) -> Iterator[OperatorProcess]:
    process = OperatorProcess(control_plane, namespace, tmp_path / "operator.log")
    try:
        yield process
    finally:
        process.stop()


def replica_ranks(pods: list[Any]) -> list[tuple[int, int]]:
    return sorted((int(p.metadata.labels[labels.REPLICA]), int(p.metadata.labels[labels.RANK])) for p in pods)


def test_killed_mid_create_then_restarted_leaves_exactly_one_pod_per_rank(
    operator_process: OperatorProcess, groups: Groups
) -> None:
    expected = [(r, k) for r in range(REPLICAS) for k in range(WORLD_SIZE)]
    partial_seen = None
    for attempt in range(3):
        name = f"big{attempt}"
        operator_process.start()
        groups.create(name, replicas=REPLICAS, worldSize=WORLD_SIZE, worker={"gpus": 0})
        deadline = time.monotonic() + 60
        while not groups.pods(name):
            assert time.monotonic() < deadline, operator_process.log.read_text()[-3000:]
            time.sleep(0.005)
        operator_process.kill()
        time.sleep(0.5)  # creates already sent have landed
        at_kill = len(groups.pods(name))

        operator_process.start()
        eventually(lambda name=name: len(groups.pods(name)) >= len(expected), timeout=60, what="16 pods")
        time.sleep(3)  # a duplicate or a second round of creates would show up now
        pods = groups.pods(name)
        assert replica_ranks(pods) == expected, "exactly one pod per (replica, rank)"
        assert len({p.metadata.name for p in pods}) == len(expected)
        status = eventually(
            lambda name=name: (s := groups.get(name).get("status") or {}).get("replicas") == REPLICAS and s,
            what="status counts all replicas",
        )
        assert status["worldSize"] == WORLD_SIZE
        operator_process.stop()
        groups.delete(name)
        if 0 < at_kill < len(expected):
            partial_seen = at_kill
            break
    assert partial_seen is not None, "the operator was never caught in the middle of creating the group"


def test_nodes_with_a_device_fault_stay_avoided_after_an_operator_restart(
    operator_process: OperatorProcess, groups: Groups
) -> None:
    operator_process.start()
    groups.create("avoid", replicas=1, worker={"gpus": 0})
    eventually(lambda: (groups.get("avoid").get("status") or {}).get("replicas") == 1, what="the first pod")
    first = groups.live_pods("avoid")[0]
    # What the health prober writes after a device fault (tests/e2e/test_selfheal.py shows it does), and an
    # entry from two hours ago that has expired.
    now = datetime.now(UTC).replace(microsecond=0)
    stamp = lambda t: t.isoformat().replace("+00:00", "Z")  # noqa: E731
    avoided = [
        {"node": "gpu-old", "since": stamp(now - timedelta(hours=2))},
        {"node": "gpu-bad", "since": stamp(now)},
    ]
    groups.custom.patch_namespaced_custom_object_status(
        api.GROUP, api.VERSION, groups.namespace, api.PLURAL, "avoid", {"status": {"avoidedNodes": avoided}}
    )
    operator_process.kill()
    operator_process.start()
    groups.core.delete_namespaced_pod(first.metadata.name, groups.namespace, grace_period_seconds=0)

    replacement = eventually(
        lambda: next((p for p in groups.live_pods("avoid") if p.metadata.uid != first.metadata.uid), None),
        timeout=60,
        what="the replacement pod",
    )
    terms = replacement.spec.affinity.node_affinity.required_during_scheduling_ignored_during_execution
    excluded = [
        value
        for term in terms.node_selector_terms
        for expression in term.match_expressions
        if expression.key == "kubernetes.io/hostname" and expression.operator == "NotIn"
        for value in expression.values
    ]
    assert excluded == ["gpu-bad"], operator_process.log.read_text()[-3000:]
    eventually(
        lambda: [e["node"] for e in groups.get("avoid")["status"]["avoidedNodes"]] == ["gpu-bad"],
        timeout=30,
        what="the expired entry pruned from the status",
    )
