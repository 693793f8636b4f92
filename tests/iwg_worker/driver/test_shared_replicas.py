"""Several drivers share a replica's capacity: every worker serves every driver, and each driver routes its
generation requests by the engines' own count of open requests (its own and the other drivers'), so one
driver does not pile its requests onto a replica the other already fills. Real `iwg-driver` and
`iwg-worker` processes (SmolLM2, two replicas, two drivers) wired over tcp + CURVE as the operator wires
pods."""

from __future__ import annotations

import asyncio
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
    wired = wire_group(tmp_path, "share", replicas=2, bound=2, heartbeat_s=0.5, drivers=2, generate=True)
    # Strictly the fewest open requests (cacheAware would allow up to ceil(1.25 x mean) on replica 0).
    for env in wired.driver_envs:
        env[wiring.ROUTING_POLICY] = "leastLoaded"
    drivers = [wired.start_driver(i) for i in (0, 1)]
    workers = [launch_worker(wired.worker_envs[r], tmp_path / f"worker-{r}.log") for r in (0, 1)]
    try:
        for (proc, log), url in zip(drivers, wired.urls, strict=True):
            wait_http(f"{url}/readyz", proc, STARTUP_TIMEOUT_S, log)
        asyncio.run(_share(wired.urls))
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

        await until(seen_by_second, 15, "the second driver never saw the first one's requests on replica 0")
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
