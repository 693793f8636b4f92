"""Fencing of replaced ranks, in real `iwg-worker` processes and a real driver over real ZMQ: a worker the operator
replaced (a newer incarnation of its rank said hello) that comes back — a partitioned node, a process resumed
after SIGSTOP — is refused by the driver: it never becomes a member again, answers no request, and its goodbye
does not take its replacement out of the replica."""

from __future__ import annotations

import json
import os
import signal
import time
import urllib.request
from pathlib import Path

import pytest
from iwg_operator.api import wiring
from iwg_worker.executor.multiproc import launch_worker

from tests.iwg_worker.driver.conftest import STARTUP_TIMEOUT_S, stop, wait_http, wire_group
from tests.iwg_worker.test_worker_proc import health_port

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

# The driver drops a silent member after 3 heartbeats (6 s at HEARTBEAT_S). Nothing here waits for that (a newer
# incarnation's hello replaces the old one at once). Shorter heartbeats failed on a loaded machine (the full
# suite): at 0.2 s (0.6 s) the first embedding went unanswered for its 30 s; at 0.5 s (1.5 s) the machine stalled
# past 1.5 s and the new incarnation's replica was dropped for a moment (a 503); at the default 1 s (3 s) the
# suite's parallel lanes stall a process 2-3 s, and a " left: " in the driver's log failed the last check.
HEARTBEAT_S = 2.0
BACK_S = 5 * HEARTBEAT_S  # how long the resumed old process heartbeats before the checks: 5 of its heartbeats


def calls_served(port: int) -> float:
    """The worker's calls served, all methods (its /metrics)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
        lines = resp.read().decode().splitlines()
    return sum(
        float(line.rsplit(" ", 1)[1]) for line in lines if line.startswith("iwg_worker_requests_total")
    )


def embed(url: str, text: str) -> None:
    body = json.dumps({"model": "minilm", "input": text}).encode()
    request = urllib.request.Request(
        f"{url}/v1/embeddings", body, {"Content-Type": "application/json"}, method="POST"
    )
    with urllib.request.urlopen(request, timeout=30) as resp:
        assert len(json.loads(resp.read())["data"][0]["embedding"]) == 384


def embed_until(url: str, done: object, timeout: float, what: str) -> int:
    """Embeddings one after another until ``done()`` holds; failures are allowed (a replica rejoining)."""
    deadline, sent = time.monotonic() + timeout, 0
    while not done():  # type: ignore[operator]
        assert time.monotonic() < deadline, f"{what}: not within {timeout} s"
        try:
            embed(url, f"owls {sent}")
        except OSError:
            time.sleep(0.1)
        sent += 1
    return sent


def test_a_replaced_incarnation_that_comes_back_is_refused(tmp_path: Path) -> None:
    wired = wire_group(tmp_path, "fence", replicas=1, bound=1, heartbeat_s=HEARTBEAT_S)
    driver, driver_log = wired.start_driver(0)
    env = wired.worker_envs[0]
    old_log, new_log = tmp_path / "old.log", tmp_path / "new.log"
    old = launch_worker({**env, wiring.POD_NAME: "fence-0-0-old", wiring.INCARNATION: "100"}, old_log)
    new = None
    try:
        wait_http(f"{wired.url}/readyz", driver, STARTUP_TIMEOUT_S, driver_log)
        old_port = health_port(old_log)
        embed(wired.url, "served by the first incarnation")
        assert calls_served(old_port) > 0

        # The node of the old pod is cut off: its process stops; the operator creates the rank anew.
        os.kill(old.pid, signal.SIGSTOP)
        new = launch_worker({**env, wiring.POD_NAME: "fence-0-0-new", wiring.INCARNATION: "200"}, new_log)
        new_port = health_port(new_log)
        embed_until(wired.url, lambda: calls_served(new_port) > 0, STARTUP_TIMEOUT_S, "the new pod serving")

        # The old process comes back and heartbeats (hello) on its old link.
        os.kill(old.pid, signal.SIGCONT)
        served_old = calls_served(old_port)
        served_new = calls_served(new_port)
        deadline, answered = time.monotonic() + BACK_S, 0
        while time.monotonic() < deadline:
            embed(wired.url, f"owls after the old one came back {answered}")  # every one answered
            answered += 1
        log = driver_log.read_text(errors="replace")
        assert "replaced by pod 'fence-0-0-old'" not in log, log[-3000:]
        assert "from pod 'fence-0-0-old' (replica 0 rank 0): incarnation 100 is older than 200" in log, log[
            -3000:
        ]
        assert calls_served(old_port) == served_old, "the replaced incarnation answered requests"
        assert calls_served(new_port) >= served_new + answered

        # Its goodbye (the kubelet stops it once the node is back) does not take the replica down.
        left_before = log.count(" left: ")
        assert stop(old, timeout=15) == 0
        time.sleep(5 * HEARTBEAT_S)
        for n in range(5):
            embed(wired.url, f"owls after the old one left {n}")
        log = driver_log.read_text(errors="replace")
        assert log.count(" left: ") == left_before, log[-3000:]
        assert "ignored the goodbye of replica 0 rank 0's replaced incarnation 100" in log, log[-3000:]
    finally:
        if old.poll() is None:
            os.kill(old.pid, signal.SIGCONT)
            stop(old, timeout=15)
        if new is not None:
            stop(new, timeout=15)
        stop(driver, timeout=15)
