"""Two operator processes with --leader-elect against the real control plane: exactly one reconciles, the
standby writes nothing (its own request metrics), and when the leader is SIGKILLed the standby takes the Lease
and reconciles what changed after the kill within 60 s (a lease duration, 15 s, a retry period and a pass,
with room for a loaded machine)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client
from kubernetes.client import ApiClient
from kubernetes.client.exceptions import ApiException
from prometheus_client.parser import text_string_to_metric_families

from tests.cluster.waiting import eventually
from tests.iwg_operator.conftest import Groups

pytestmark = pytest.mark.cluster

ROOT = Path(__file__).resolve().parents[2]
LEASE = "iwg-operator"
WRITE_VERBS = ("create", "apply", "patch", "update", "delete")
TAKEOVER_LIMIT_S = 60.0


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


class Candidate:
    """`iwg-operator --leader-elect` as its own process, with its own metrics and liveness ports."""

    def __init__(self, identity: str, control_plane: Any, namespace: str, log: Path) -> None:
        self.identity = identity
        self.metrics_port, self.health_port = _free_port(), _free_port()
        env = {
            **control_plane.env(),
            "PYTHONPATH": os.pathsep.join([str(ROOT / "operator"), str(ROOT)]),
            "IWG_METRICS_ADDRESS": "127.0.0.1",
        }
        self.log = log
        with log.open("ab") as out:
            self.proc = subprocess.Popen(
                [
                    sys.executable, "-m", "iwg_operator.main",
                    "--namespace", namespace,
                    "--log-level", "warning",
                    "--leader-elect",
                    "--leader-elect-namespace", namespace,
                    "--leader-elect-identity", identity,
                    "--metrics-port", str(self.metrics_port),
                    "--liveness", f"http://127.0.0.1:{self.health_port}/healthz",
                ],
                env=env, stdout=out, stderr=subprocess.STDOUT,
            )  # fmt: skip

    def output(self) -> str:
        return self.log.read_text(errors="replace")[-4000:]

    def running(self) -> bool:
        return self.proc.poll() is None

    def healthy(self) -> bool:
        try:
            url = f"http://127.0.0.1:{self.health_port}/healthz"
            with urllib.request.urlopen(url, timeout=2) as response:
                return bool(response.status == 200)
        except OSError:
            return False

    def requests(self) -> dict[tuple[str, str], float]:
        """iwg_operator_api_requests_total by (verb, resource), every status code together."""
        url = f"http://127.0.0.1:{self.metrics_port}/metrics"
        with urllib.request.urlopen(url, timeout=5) as response:
            text = response.read().decode()
        counts: dict[tuple[str, str], float] = {}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name == "iwg_operator_api_requests_total":
                    key = (sample.labels["verb"], sample.labels["resource"])
                    counts[key] = counts.get(key, 0.0) + sample.value
        return counts

    def writes(self, *, leases: bool) -> float:
        return sum(
            n
            for (verb, resource), n in self.requests().items()
            if verb in WRITE_VERBS and (resource == "leases") == leases
        )

    def kill(self) -> None:
        if self.running():
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(timeout=10)

    def stop(self) -> int | None:
        if self.running():
            self.proc.terminate()
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.kill()
        return self.proc.returncode


class Candidates(list[Candidate]):
    def __init__(self, control_plane: Any, namespace: str, logs: Path) -> None:
        super().__init__()
        self.control_plane, self.namespace, self.logs = control_plane, namespace, logs

    def start(self, identity: str) -> Candidate:
        candidate = Candidate(identity, self.control_plane, self.namespace, self.logs / f"{identity}.log")
        self.append(candidate)
        return candidate


@pytest.fixture
def candidates(
    controller_manager: Any, iwg_crd: Any, control_plane: Any, namespace: str, tmp_path: Path
) -> Iterator[Candidates]:
    started = Candidates(control_plane, namespace, tmp_path)
    try:
        yield started
    finally:
        for candidate in started:
            candidate.stop()


def _holder(k8s: ApiClient, namespace: str) -> str | None:
    try:
        lease = client.CoordinationV1Api(k8s).read_namespaced_lease(LEASE, namespace)
    except ApiException as error:
        if error.status == 404:
            return None
        raise
    holder: str | None = lease.spec.holder_identity
    return holder


def test_one_of_two_replicas_reconciles_and_the_other_takes_over_after_a_sigkill(
    candidates: Candidates, groups: Groups, k8s: ApiClient, namespace: str
) -> None:
    first = candidates.start("op-a")
    eventually(lambda: _holder(k8s, namespace) == "op-a", timeout=60, what=f"op-a leads\n{first.output()}")
    second = candidates.start("op-b")
    eventually(second.healthy, timeout=60, what=f"the standby's liveness endpoint\n{second.output()}")
    eventually(first.healthy, timeout=60, what="the leader's liveness endpoint (Kopf's)")

    # The leader does all the work while the standby watches the Lease.
    groups.create("before", replicas=2, worker={"gpus": 0})
    eventually(lambda: len(groups.live_pods("before")) == 2, timeout=60, what="the leader creates 2 pods")
    eventually(
        lambda: (groups.get("before").get("status") or {}).get("replicas") == 2, what="the leader's status"
    )
    time.sleep(5)  # two more renewals, and a supervisor round or two of the leader
    assert second.running(), second.output()
    assert first.writes(leases=False) > 0, "the leader wrote nothing"
    assert first.writes(leases=True) > 0, "the leader never renewed"
    standby = second.requests()
    assert second.writes(leases=False) == 0, f"the standby wrote: {standby}"
    assert second.writes(leases=True) == 0, f"the standby wrote the Lease while it was held: {standby}"
    assert set(standby) == {("get", "leases")}, standby
    assert _holder(k8s, namespace) == "op-a"

    # The leader's process dies without a chance to release anything; changes made after are the standby's.
    first.kill()
    killed = time.monotonic()
    doomed = groups.live_pods("before")[0]
    groups.core.delete_namespaced_pod(doomed.metadata.name, namespace, grace_period_seconds=0)
    groups.create("after", replicas=1, worker={"gpus": 0})

    eventually(
        lambda: _holder(k8s, namespace) == "op-b", timeout=TAKEOVER_LIMIT_S, what="op-b takes the Lease"
    )
    lease_taken = time.monotonic() - killed
    eventually(
        lambda: len(groups.live_pods("after")) == 1, timeout=TAKEOVER_LIMIT_S, what="the new group's pod"
    )
    new_group = time.monotonic() - killed
    eventually(
        lambda: (
            len(groups.live_pods("before")) == 2
            and doomed.metadata.uid not in {p.metadata.uid for p in groups.live_pods("before")}
        ),
        timeout=TAKEOVER_LIMIT_S,
        what="the deleted worker pod recreated",
    )
    healed = time.monotonic() - killed
    print(f"takeover after SIGKILL: lease {lease_taken:.1f} s, new group's pod {new_group:.1f} s, "
          f"deleted pod recreated {healed:.1f} s")  # fmt: skip
    assert healed < TAKEOVER_LIMIT_S, second.output()
    assert second.writes(leases=False) > 0
    assert ("update", "leases") in second.requests()


def test_a_stopped_leader_releases_the_lease_and_the_standby_takes_it_at_once(
    candidates: Candidates, groups: Groups, k8s: ApiClient, namespace: str
) -> None:
    first = candidates.start("op-a")
    eventually(lambda: _holder(k8s, namespace) == "op-a", timeout=60, what=f"op-a leads\n{first.output()}")
    second = candidates.start("op-b")
    eventually(second.healthy, timeout=60, what=f"the standby's liveness endpoint\n{second.output()}")
    assert first.stop() == 0, first.output()
    exited = time.monotonic()  # timed from the exit: how long the graceful shutdown took does not count
    # Released before the process ended (or already taken by the standby): not left to expire.
    assert _holder(k8s, namespace) != "op-a", f"the stopped leader kept the Lease\n{first.output()}"
    eventually(lambda: _holder(k8s, namespace) == "op-b", timeout=30, what="op-b takes the released Lease")
    handover = time.monotonic() - exited
    print(f"handover after SIGTERM: {handover:.1f} s after the exit")
    # The standby's next retry (2 s), with room for a loaded machine; an unreleased Lease is held a lease
    # duration (15 s) after its last renewal.
    assert handover < 10, handover
    groups.create("handed", replicas=1, worker={"gpus": 0})
    eventually(lambda: len(groups.live_pods("handed")) == 1, timeout=30, what="the new leader reconciles")


def test_a_leader_that_loses_the_lease_stops_all_work_at_once(
    candidates: Candidates, groups: Groups, k8s: ApiClient, namespace: str
) -> None:
    """Another holder written into the Lease (what a standby does once the leader failed to renew): the
    leader's next renewal sees it and the process ends, with no write after."""
    leader = candidates.start("op-a")
    eventually(lambda: _holder(k8s, namespace) == "op-a", timeout=60, what=f"op-a leads\n{leader.output()}")
    eventually(leader.healthy, timeout=60, what="the leader's liveness endpoint (Kopf's)")
    lost = time.monotonic()
    client.CoordinationV1Api(k8s).patch_namespaced_lease(
        LEASE, namespace, {"spec": {"holderIdentity": "someone-else"}}
    )
    eventually(lambda: not leader.running(), timeout=10, what="the leader's process ends")
    print(f"leader stopped {time.monotonic() - lost:.1f} s after losing the lease")
    assert leader.proc.returncode == 1
    assert "leadership lost" in leader.output()
    groups.create("orphan", replicas=1, worker={"gpus": 0})
    time.sleep(3)
    assert not groups.pods("orphan"), "nothing reconciles without a leader"
