"""The client's request scheduler: bounded in-flight requests, waiting ones started in priority order."""

from __future__ import annotations

import asyncio

from iwg_operator.kube import Priority, RequestScheduler


async def test_waiting_requests_start_by_priority_then_arrival_and_never_exceed_the_limit() -> None:
    scheduler = RequestScheduler(limit=2)
    started: list[str] = []
    release = asyncio.Event()
    peak = 0

    async def request(name: str, priority: int) -> None:
        nonlocal peak
        async with scheduler.slot(priority):
            started.append(name)
            peak = max(peak, scheduler.in_flight)
            await release.wait()

    first = [asyncio.create_task(request(f"busy{i}", Priority.SUPPORT)) for i in range(2)]
    await asyncio.sleep(0)
    waiting = [
        ("support", Priority.SUPPORT),
        ("pod-a", Priority.PODS),
        ("status", Priority.STATUS),
        ("secret", Priority.BEFORE_PODS),
        ("pod-b", Priority.PODS),
    ]
    later = [asyncio.create_task(request(name, priority)) for name, priority in waiting]
    await asyncio.sleep(0)
    assert started == ["busy0", "busy1"], "the limit holds the rest back"
    release.set()
    await asyncio.gather(*first, *later)
    assert started[2:] == ["secret", "pod-a", "pod-b", "status", "support"]
    assert peak == 2
    assert scheduler.in_flight == 0


async def test_a_cancelled_waiter_gives_up_its_place_without_losing_a_slot() -> None:
    scheduler = RequestScheduler(limit=1)
    release = asyncio.Event()
    started: list[str] = []

    async def request(name: str) -> None:
        async with scheduler.slot(Priority.PODS):
            started.append(name)
            await release.wait()

    busy = asyncio.create_task(request("busy"))
    await asyncio.sleep(0)
    gone = asyncio.create_task(request("gone"))
    after = asyncio.create_task(request("after"))
    await asyncio.sleep(0)
    gone.cancel()
    release.set()
    await asyncio.gather(busy, after)
    assert gone.cancelled()
    assert started == ["busy", "after"]
    assert scheduler.in_flight == 0
