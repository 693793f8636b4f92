"""Chaos on a real group wired as the operator wires pods: `iwg-driver` (ClusterExecutor, tcp + CURVE) and two
`iwg-worker` processes with real MiniLM weights. Under load, SIGKILL one worker: every request is answered
once and correctly, the dead replica leaves routing within the heartbeat timeout and rejoins when restarted;
a drained replica gets no batches; with no worker left the driver answers 503."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
import pytest
from iwg_operator.api import wiring
from iwg_worker.driver.service import DriverConfig
from iwg_worker.executor.multiproc import launch_worker

from tests.iwg_worker.driver.conftest import (
    ADMIN_TOKEN,
    STARTUP_TIMEOUT_S,
    stop,
    wait_http,
    wire_group,
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

# Long enough that a 2-3 s stall of a loaded CI machine does not miss three heartbeats of a live worker.
HEARTBEAT_S = 2.0
HEARTBEAT_TIMEOUT_S = HEARTBEAT_S * wiring.DEFAULT_HEARTBEAT_MISSES
# The executor checks on a 20 ms tick and the router learns through the event loop: allow one more interval,
# and 3 s for a stalled process. Still well under the 30 s after which the replica "never left routing".
DETECTION_LIMIT_S = HEARTBEAT_TIMEOUT_S + HEARTBEAT_S + 3.0
TEXTS = [
    f"sentence number {i} about {topic}" for i, topic in enumerate(["cats", "GPUs", "rivers", "tea"] * 4)
]
AUTH = {"Authorization": f"Bearer {ADMIN_TOKEN}"}


@dataclass
class Group:
    url: str
    driver: subprocess.Popen[bytes]
    worker_envs: dict[int, dict[str, str]]
    tmp: Path
    workers: dict[int, subprocess.Popen[bytes]] = field(default_factory=dict)

    def start_worker(self, replica: int) -> None:
        log = self.tmp / f"worker-{replica}-{time.monotonic_ns()}.log"
        self.workers[replica] = launch_worker(self.worker_envs[replica], log)

    def kill_worker(self, replica: int) -> None:
        self.workers[replica].send_signal(signal.SIGKILL)
        self.workers[replica].wait()


@pytest.fixture(scope="module")
def group(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Group]:
    tmp = tmp_path_factory.mktemp("chaos")
    # Room for a third replica that never comes: it must not show up as a dead one.
    wired = wire_group(tmp, "chaos", replicas=2, bound=3, heartbeat_s=HEARTBEAT_S)
    driver, driver_log = wired.start_driver()
    g = Group(wired.url, driver, wired.worker_envs, tmp)
    try:
        wait_http(f"{g.url}/healthz", driver, 60, driver_log)
        for replica in (0, 1):
            g.start_worker(replica)
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while serving(g) != [0, 1]:
            assert time.monotonic() < deadline, driver_log.read_text()[-3000:]
            assert all(w.poll() is None for w in g.workers.values()), "a worker exited during start-up"
            time.sleep(0.5)
        yield g
    finally:
        for worker in g.workers.values():
            stop(worker, timeout=15)
        assert stop(driver) == 0, driver_log.read_text()[-3000:]


def admin_replicas(g: Group) -> dict[int, str]:
    import urllib.request

    req = urllib.request.Request(f"{g.url}/admin/replicas", headers=AUTH)
    with urllib.request.urlopen(req, timeout=10) as resp:
        return {r["replica"]: r["state"] for r in json.loads(resp.read())["replicas"]}


def serving(g: Group) -> list[int]:
    return sorted(r for r, state in admin_replicas(g).items() if state == "serving")


def metric(text: str, sample: str) -> float:
    """The value of one sample (`name{labels}` exactly as exposed), 0 when absent."""
    for line in text.splitlines():
        if line.startswith(sample + " "):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


async def fetch_metrics(session: aiohttp.ClientSession, url: str) -> str:
    async with session.get(f"{url}/metrics") as resp:
        return await resp.text()


async def embed(
    session: aiohttp.ClientSession, url: str, text: str
) -> tuple[int, list[float] | None, dict[str, Any]]:
    async with session.post(f"{url}/v1/embeddings", json={"model": "minilm", "input": text}) as resp:
        body = await resp.json()
        vector = body["data"][0]["embedding"] if resp.status == 200 else None
        return resp.status, vector, {"headers": dict(resp.headers), "body": body}


def test_sigkill_under_load_loses_nothing_and_the_replica_leaves_and_rejoins(group: Group) -> None:
    asyncio.run(_chaos(group))


async def _chaos(g: Group) -> None:
    timeout = aiohttp.ClientTimeout(total=120)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        # What each text embeds to, from the healthy group: every later answer must match its own text.
        reference = {}
        for text in TEXTS:
            status, vector, _ = await embed(session, g.url, text)
            assert status == 200
            reference[text] = np.asarray(vector)
        before = await fetch_metrics(session, g.url)

        answers: list[tuple[str, int, list[float] | None]] = []
        stop_load = asyncio.Event()

        async def client(index: int) -> None:
            n = 0
            while not stop_load.is_set():
                text = TEXTS[(index * 7 + n) % len(TEXTS)]
                status, vector, _ = await embed(session, g.url, text)
                answers.append((text, status, vector))
                n += 1

        clients = [asyncio.create_task(client(i)) for i in range(8)]
        deadline = time.monotonic() + 60
        while not answers:
            assert time.monotonic() < deadline, "no request completed in 60 s of load"
            await asyncio.sleep(0.1)
        await asyncio.sleep(1.0)  # the load under way on both replicas
        killed_at = time.monotonic()
        g.kill_worker(1)
        while 1 in await asyncio.to_thread(serving, g):
            assert time.monotonic() - killed_at < 30, "replica 1 never left routing"
            await asyncio.sleep(0.05)
        detected_s = time.monotonic() - killed_at
        await asyncio.sleep(2.0)  # more load on the surviving replica
        stop_load.set()
        await asyncio.gather(*clients)
        after = await fetch_metrics(session, g.url)

        assert detected_s <= DETECTION_LIMIT_S, f"replica 1 left routing after {detected_s:.2f} s"
        statuses = [status for _, status, _ in answers]
        assert statuses and set(statuses) == {200}, statuses
        for text, _, vector in answers:
            assert float(np.dot(reference[text], np.asarray(vector))) >= 0.9999, text
        # Exactly one answer per request: the driver answered as many 200s as the clients received.
        answered = metric(after, 'iwg_requests_total{endpoint="embeddings",status="200"}') - metric(
            before, 'iwg_requests_total{endpoint="embeddings",status="200"}'
        )
        assert answered == len(answers)
        assert metric(after, "iwg_batch_retries_total") >= 1, "the killed replica's batch was not retried"
        assert admin_replicas(g) == {0: "serving", 1: "dead"}

        # Restarted (as a pod would be), the replica joins and gets batches again.
        batches_before = metric(after, 'iwg_batches_total{replica="1"}')
        g.start_worker(1)
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while await asyncio.to_thread(serving, g) != [0, 1]:
            assert time.monotonic() < deadline, "replica 1 did not rejoin"
            assert g.workers[1].poll() is None, "the restarted worker exited"
            await asyncio.sleep(0.5)
        results = await asyncio.gather(*(embed(session, g.url, t) for t in TEXTS * 2))
        assert all(status == 200 for status, _, _ in results)
        rejoined = await fetch_metrics(session, g.url)
        assert metric(rejoined, 'iwg_batches_total{replica="1"}') > batches_before

        # Drained (as the operator does before scaling down), replica 0 gets no new batches; undrained, again.
        async with session.post(f"{g.url}/admin/replicas/0/drain?timeout=30", headers=AUTH) as resp:
            assert resp.status == 200 and (await resp.json())["drained"] is True
        drained_at = metric(await fetch_metrics(session, g.url), 'iwg_batches_total{replica="0"}')
        results = await asyncio.gather(*(embed(session, g.url, t) for t in TEXTS))
        assert all(status == 200 for status, _, _ in results)
        assert metric(await fetch_metrics(session, g.url), 'iwg_batches_total{replica="0"}') == drained_at
        async with session.post(f"{g.url}/admin/replicas/0/undrain", headers=AUTH) as resp:
            assert resp.status == 200
        assert await asyncio.to_thread(serving, g) == [0, 1]

        # No worker at all: 503 with Retry-After once the driver's grace has passed, and /readyz says so.
        g.kill_worker(0)
        g.kill_worker(1)
        deadline = time.monotonic() + 30
        while await asyncio.to_thread(serving, g):
            assert time.monotonic() < deadline
            await asyncio.sleep(0.1)
        started = time.monotonic()
        status, _, extra = await embed(session, g.url, "anyone there?")
        assert status == 503, extra
        grace = DriverConfig.no_replica_grace_s  # the default, which iwg-driver runs with
        assert grace - 0.5 <= time.monotonic() - started < grace + 10
        assert int(extra["headers"]["Retry-After"]) >= 1
        assert extra["body"]["error"]["type"] == "service_unavailable"
        async with session.get(f"{g.url}/readyz") as resp:
            assert resp.status == 503
