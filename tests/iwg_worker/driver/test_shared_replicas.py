"""Several drivers share a replica's capacity: every worker serves every driver, and each driver routes its
generation requests by the engines' own count of open requests (its own and the other drivers'), so one
driver does not pile its requests onto a replica the other already fills. Real `iwg-driver` and
`iwg-worker` processes (SmolLM2, two replicas, two drivers) wired over tcp + CURVE as the operator wires
pods.

The same group then has a worker evicted mid-stream (SIGTERM, as `kubectl drain` does): the worker tells both
drivers that it drains, they send its replica nothing new, its running stream ends with all its tokens, and
then it says goodbye and exits 0."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from iwg_operator.api import wiring
from iwg_worker.executor.multiproc import launch_worker

from tests.iwg_worker.driver.conftest import ADMIN_TOKEN, STARTUP_TIMEOUT_S, stop, wait_http, wire_group

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

AUTH = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
STREAMS = 4
BODY = {"model": "smollm2", "max_tokens": 2000, "ignore_eos": True, "stream": True}
# Long enough to still run on the draining replica when the late request is placed (about 4 s after the SIGTERM
# here, at ~14 tokens/s: room for a stalled CI machine), short enough to end within the worker's 30 s drain on a
# machine several times slower.
SHORT_TOKENS = 64
SHORT = {
    **BODY,
    "max_tokens": SHORT_TOKENS,
    "temperature": 0,
    "stream_options": {"include_usage": True},
}


async def replicas(session: aiohttp.ClientSession, url: str) -> dict[int, dict[str, Any]]:
    async with session.get(f"{url}/admin/replicas", headers=AUTH) as resp:
        assert resp.status == 200
        return {r["replica"]: r for r in (await resp.json())["replicas"]}


async def until(check: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not await check():
        assert time.monotonic() < deadline, what
        await asyncio.sleep(0.2)


def test_a_driver_routes_around_a_replica_that_another_drivers_requests_fill(tmp_path: Path) -> None:
    # 2 s heartbeats (a 6 s timeout): eight SmolLM2 streams on a loaded CI machine must not cost a replica.
    wired = wire_group(tmp_path, "share", replicas=2, bound=2, heartbeat_s=2.0, drivers=2, generate=True)
    # Strictly the fewest open requests (cacheAware would allow up to ceil(1.25 x mean) on replica 0).
    for env in wired.driver_envs:
        env[wiring.ROUTING_POLICY] = "leastLoaded"
    drivers = [wired.start_driver(i) for i in (0, 1)]
    workers = [launch_worker(wired.worker_envs[r], tmp_path / f"worker-{r}.log") for r in (0, 1)]
    try:
        for (proc, log), url in zip(drivers, wired.urls, strict=True):
            wait_http(f"{url}/readyz", proc, STARTUP_TIMEOUT_S, log)
        asyncio.run(_share(wired.urls))
        asyncio.run(_evicted_mid_stream(wired.urls, workers))
    finally:
        for worker in workers:
            stop(worker, timeout=15)
        for proc, log in drivers:
            if proc.poll() is None:
                assert stop(proc) == 0, log.read_text()[-3000:]


async def _share(urls: list[str]) -> None:
    first, second = urls
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:

        async def both_serving() -> bool:
            views = [await replicas(session, url) for url in urls]
            return all(len(v) == 2 and all(r["state"] == "serving" for r in v.values()) for v in views)

        await until(both_serving, STARTUP_TIMEOUT_S, "both drivers never saw both replicas serving")
        # The first driver sends to replica 0 only (replica 1 drained in it alone).
        async with session.post(f"{first}/admin/replicas/1/drain?timeout=1", headers=AUTH) as resp:
            assert resp.status == 200
        streams = []
        for i in range(STREAMS):
            resp = await session.post(f"{first}/v1/completions", json={**BODY, "prompt": f"Count to {i}000:"})
            assert resp.status == 200
            await resp.content.readline()
            streams.append(resp)
        assert (await replicas(session, first))[0]["inflight_batches"] == STREAMS

        async def seen_by_second() -> bool:
            return (await replicas(session, second))[0]["other_drivers_requests"] == STREAMS

        await until(seen_by_second, 60, "the second driver never saw the first one's requests on replica 0")
        # The second driver's own requests go to the replica the first one left empty.
        for i in range(STREAMS):
            resp = await session.post(f"{second}/v1/completions", json={**BODY, "prompt": f"Spell {i}:"})
            assert resp.status == 200
            await resp.content.readline()
            streams.append(resp)
        placed = {r: view["inflight_batches"] for r, view in (await replicas(session, second)).items()}
        assert placed == {0: 0, 1: STREAMS}, placed
        for resp in streams:
            resp.close()

        async def all_ended() -> bool:
            views = [await replicas(session, url) for url in urls]
            return all(r["inflight_batches"] == 0 for v in views for r in v.values())

        await until(all_ended, 30, "closed streams were not ended")


async def _evicted_mid_stream(urls: list[str], workers: list[subprocess.Popen[bytes]]) -> None:
    """Replica 1's worker gets SIGTERM while it streams a short request; replica 0 holds two long ones, so
    without the drain a new request would go to replica 1 (the fewest open requests)."""
    first = urls[0]
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:

        async def engines_idle() -> bool:  # the engines' counts of `_share`'s cancelled streams have come in
            views = [await replicas(session, url) for url in urls]
            return all(r["other_drivers_requests"] == 0 for v in views for r in v.values())

        await until(engines_idle, 60, "the engines still report `_share`'s streams")
        held = []  # replica 1 is still drained in the first driver (by `_share`): these go to replica 0
        for i in range(2):
            resp = await session.post(f"{first}/v1/completions", json={**BODY, "prompt": f"List {i}:"})
            assert resp.status == 200
            await resp.content.readline()
            held.append(resp)
        async with session.post(f"{first}/admin/replicas/1/undrain", headers=AUTH) as resp:
            assert resp.status == 200
        short = await session.post(f"{first}/v1/completions", json={**SHORT, "prompt": "Name a colour:"})
        assert short.status == 200
        lines = [await short.content.readline()]
        placed = {r: view["inflight_batches"] for r, view in (await replicas(session, first)).items()}
        assert placed == {0: 2, 1: 1}, placed

        workers[1].send_signal(signal.SIGTERM)
        signalled = time.monotonic()

        async def draining_in_both() -> bool:
            views = [await replicas(session, url) for url in urls]
            return all(view[1]["state"] == "draining" for view in views)

        await until(draining_in_both, 60, "the drivers did not mark the SIGTERMed worker's replica draining")
        seen = time.monotonic() - signalled
        late = await session.post(f"{first}/v1/completions", json={**BODY, "prompt": "Late:"})
        assert late.status == 200
        await late.content.readline()
        placed = {r: view["inflight_batches"] for r, view in (await replicas(session, first)).items()}
        # The short stream still runs on the draining replica; the new request went to the other one.
        assert placed == {0: 3, 1: 1}, placed

        lines += [line async for line in short.content]
        events = [
            json.loads(line[6:])
            for line in lines
            if line.startswith(b"data: ") and line.strip() != b"data: [DONE]"
        ]
        assert not any("error" in e for e in events), events[-1]
        assert events[-1]["usage"]["completion_tokens"] == SHORT_TOKENS, events[-1]
        assert [e["choices"][0]["finish_reason"] for e in events if e["choices"]][-1] == "length"
        code = await asyncio.to_thread(workers[1].wait, 30)
        print(
            f"SIGTERM mid-stream: draining in both drivers after {seen:.2f} s, stream of {SHORT_TOKENS} tokens "
            f"complete, worker exited {code} {time.monotonic() - signalled:.1f} s after the signal"
        )
        assert code == 0
        for resp in [*held, late]:
            resp.close()
