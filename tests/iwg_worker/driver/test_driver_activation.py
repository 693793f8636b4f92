"""Scale from zero at the driver (activation.py): requests held while no replica serves, released in arrival
order once one does; bounded (429), timed (503 naming the timeout), and freed when their client leaves. In
process against the fake replica pool (unit tests)."""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import replace
from typing import Any

import aiohttp
import pytest
from aiohttp.test_utils import TestClient
from iwg_worker.driver.activation import activation_phases
from iwg_worker.driver.pool import ReplicaStartup, ReplicaState
from iwg_worker.driver.service import Driver

from tests.iwg_worker.driver.fakes import FakePool
from tests.iwg_worker.driver.test_driver_routing import embed, metric, serve, until

pytestmark = pytest.mark.timeout(60)


def at_zero() -> FakePool:
    """One replica that has not started serving yet: the group is at zero."""
    pool = FakePool(replicas=1, delay_s=0.05)
    pool.replicas[0].state = ReplicaState.JOINING
    return pool


def waiting(driver: Driver) -> float:
    return metric(driver, "iwg_activation_waiting")


async def complete(client: TestClient[Any, Any], prompt: str, stream: bool) -> tuple[int, str]:
    body = {"model": "minilm", "prompt": prompt, "max_tokens": 8, "stream": stream}
    resp = await client.post("/v1/completions", json=body)
    if not stream or resp.status != 200:
        data = await resp.json()
        return resp.status, data["choices"][0]["text"] if resp.status == 200 else json.dumps(data)
    text = ""
    async for line in resp.content:
        if line.startswith(b"data: {"):
            text += json.loads(line[6:])["choices"][0]["text"]
    return resp.status, text


async def test_requests_at_zero_wait_and_are_served_in_arrival_order_once_a_replica_serves() -> None:
    pool = at_zero()
    async with serve(pool, task="generate", activation_timeout_s=30.0) as (client, driver):
        ready = await client.get("/readyz")
        assert ready.status == 200  # it holds requests: the Service may send it clients at zero
        prompts = [f"prompt-{i}" for i in range(6)]
        tasks = []
        for i, prompt in enumerate(prompts):  # one after another, so that their arrival order is known
            tasks.append(asyncio.create_task(complete(client, prompt, stream=i % 2 == 0)))
            await until(lambda: waiting(driver) == len(tasks))
        await asyncio.sleep(0.3)
        # Held, not failed; a streamed request has no answer at all yet (not even its headers).
        assert not any(t.done() for t in tasks) and pool.replicas[0].requests == []
        pool.set_state(0, ReplicaState.SERVING)
        results = await asyncio.gather(*tasks)
        assert waiting(driver) == 0
    assert results == [(200, p[::-1][:8]) for p in prompts]
    assert [r["prompt"] for r in pool.replicas[0].requests] == prompts  # arrival order
    histogram = "iwg_activation_seconds_count"
    assert metric(driver, histogram) == 6 and metric(driver, "iwg_activation_seconds_sum") >= 6 * 0.3


async def test_embeddings_at_zero_wait_and_a_request_that_needs_no_wait_is_not_counted() -> None:
    pool = at_zero()
    async with serve(pool, activation_timeout_s=30.0) as (client, driver):
        held = [asyncio.create_task(embed(client, f"text {i}")) for i in range(3)]
        await until(lambda: waiting(driver) == 3)
        pool.set_state(0, ReplicaState.SERVING)
        results = await asyncio.gather(*held)
        status, _, _ = await embed(client, "served at once")
    assert [s for s, _, _ in results] == [200, 200, 200] and status == 200
    assert metric(driver, "iwg_activation_seconds_count") == 3


async def test_beyond_max_queue_waiting_requests_get_429_with_retry_after() -> None:
    pool = at_zero()
    async with serve(pool, task="generate", activation_timeout_s=30.0, max_queue=2) as (client, driver):
        held = [asyncio.create_task(complete(client, f"p{i}", stream=False)) for i in range(2)]
        await until(lambda: waiting(driver) == 2)
        resp = await client.post(
            "/v1/completions", json={"model": "minilm", "prompt": "more", "stream": True}
        )
        body = await resp.json()
        assert resp.status == 429 and resp.headers["Retry-After"] == "1"
        assert body["error"]["code"] == "queue_full"
        pool.set_state(0, ReplicaState.SERVING)
        assert [s for s, _ in await asyncio.gather(*held)] == [200, 200]


async def test_a_request_waiting_longer_than_the_activation_timeout_gets_503_naming_it() -> None:
    pool = at_zero()
    async with serve(pool, task="generate", activation_timeout_s=0.5) as (client, driver):
        plain, streamed = await asyncio.gather(
            complete(client, "late", stream=False), complete(client, "late too", stream=True)
        )
        assert waiting(driver) == 0
    for status, text in (plain, streamed):
        error = json.loads(text)["error"]
        assert status == 503 and error["code"] == "activation_timeout", error
        assert "0.5 s" in error["message"] and "activationTimeoutSeconds" in error["message"]
    assert metric(driver, "iwg_rejected_requests_total", {"reason": "activation_timeout"}) == 2


async def test_a_client_that_leaves_while_waiting_frees_its_place() -> None:
    pool = at_zero()
    async with serve(pool, task="generate", activation_timeout_s=30.0, max_queue=2) as (client, driver):
        leaving = asyncio.create_task(complete(client, "gone", stream=True))
        await until(lambda: waiting(driver) == 1)
        staying = asyncio.create_task(complete(client, "stays", stream=False))
        await until(lambda: waiting(driver) == 2)
        leaving.cancel()  # the client closes its connection
        await until(lambda: waiting(driver) == 1)
        # Its place is free: another request is held, not refused.
        another = asyncio.create_task(complete(client, "another", stream=False))
        await until(lambda: waiting(driver) == 2)
        pool.set_state(0, ReplicaState.SERVING)
        assert await asyncio.gather(staying, another) == [(200, "syats"), (200, "rehtona")]
    assert [r["prompt"] for r in pool.replicas[0].requests] == ["stays", "another"]


async def test_without_an_activation_timeout_the_driver_is_not_ready_and_answers_503_at_zero() -> None:
    pool = at_zero()
    async with serve(pool, no_replica_grace_s=0.2) as (client, driver):
        assert (await client.get("/readyz")).status == 503
        status, body, _ = await embed(client, "x")
    assert status == 503 and body["error"]["code"] == "no_replica"
    assert waiting(driver) == 0


async def test_a_request_that_finds_the_replica_it_was_let_through_for_gone_waits_like_a_held_one() -> None:
    """The activator let the request through while a replica served; before the request picked one, that
    replica left (the last one of a scale to zero, as in CI). It waits for the replica that starts again, up
    to the activation timeout, not the router's grace of a group without activation."""
    pool = FakePool(replicas=1, delay_s=0.05)
    async with serve(pool, task="generate", activation_timeout_s=30.0, no_replica_grace_s=0.2) as (
        client,
        driver,
    ):
        let_through = asyncio.Event()

        async def saw_it_serving() -> None:  # hold() answered at once: a replica served then
            let_through.set()

        driver.activation.hold = saw_it_serving  # type: ignore[method-assign,assignment]
        pool.set_state(0, ReplicaState.DEAD)  # ... and it left before the request got to the router
        answer = asyncio.create_task(complete(client, "late", stream=True))
        await let_through.wait()
        await asyncio.sleep(0.6)  # three times the grace
        assert not answer.done()
        pool.set_state(0, ReplicaState.SERVING)
        assert await answer == (200, "etal")


async def test_an_activation_is_split_into_the_parts_the_workers_hello_tells_and_they_add_up() -> None:
    """The serving replica's worker said when it started and loaded its model: the activation's parts are
    those marks' gaps, each at least zero, and they add up to the whole (iwg_last_activation_seconds)."""
    pool = at_zero()
    async with serve(pool, activation_timeout_s=30.0) as (client, driver):
        # The driver holds the request (its activation's start) between these two marks: as close as the
        # test can know it, however long a loaded machine stalls this process between them.
        sent_at = time.monotonic()
        held = asyncio.create_task(embed(client, "text"))
        await until(lambda: waiting(driver) == 1)
        held_at = time.monotonic()
        await asyncio.sleep(0.4)  # the pod starts; its worker loads the model for 0.2 s; it says hello
        now = time.monotonic()
        pool.startups[0] = ReplicaStartup(
            process_started=now - 0.3, load_began=now - 0.25, load_done=now - 0.05
        )
        pool.set_state(0, ReplicaState.SERVING)  # the replica serves from here (the driver's mark) ...
        await held
        answered_at = time.monotonic()  # ... to no later than here
        parts = {
            phase: metric(driver, "iwg_last_activation_phase_seconds", {"phase": phase})
            for phase in ("pod_start", "worker_start", "model_load", "ready", "first_answer")
        }
        total = metric(driver, "iwg_last_activation_seconds")
    eps = 1e-6
    assert now - 0.3 - held_at - eps <= parts["pod_start"] <= now - 0.3 - sent_at + eps, (
        parts,
        held_at - sent_at,
    )
    assert parts["worker_start"] == pytest.approx(0.05, abs=0.01)
    assert parts["model_load"] == pytest.approx(0.2, abs=0.01)
    # From the load's end (now - 0.05) to serving: 0.05 s, and whatever a stall put between `now` and the release.
    assert 0.05 - eps <= parts["ready"] <= answered_at - now + 0.05 + eps, (parts, answered_at - now)
    assert parts["first_answer"] > 0
    assert sum(parts.values()) == pytest.approx(total, abs=0.01)
    assert metric(driver, "iwg_activation_phase_seconds_count", {"phase": "model_load"}) == 1


def test_parts_before_the_first_request_held_count_as_none() -> None:
    """A worker that started (and loaded) before the first request was held: no pod start, no load in it."""
    started = ReplicaStartup(process_started=1.0, load_began=2.0, load_done=3.0)
    parts = dict(activation_phases(10.0, started, 12.0, 12.5))
    assert parts == {"pod_start": 0, "worker_start": 0, "model_load": 0, "ready": 2.0, "first_answer": 0.5}
    assert dict(activation_phases(10.0, None, 12.0, 12.5)) == {"first_answer": 0.5}


async def _stopping_driver_with_held_requests(
    serve_during_lame_duck: bool,
) -> tuple[list[tuple[int | None, str]], float, FakePool]:
    """`run_driver` (the driver's own server) at zero holding one embedding and two completions (one
    streamed), then told to stop: a replica serving during its lame duck, or none."""
    from iwg_worker.driver.server import run_driver

    from tests.iwg_worker.driver.test_driver_routing import BASE

    pool = at_zero()
    config = replace(BASE, task="generate", activation_timeout_s=60.0)
    driver = Driver(config, pool)
    stop, listening = asyncio.Event(), asyncio.get_running_loop().create_future()
    server = asyncio.create_task(
        run_driver(
            driver, "127.0.0.1", 0, None, stop=stop, on_listening=listening.set_result,
            drain_timeout_s=1.0, lame_duck_s=0.5, signals=(),
        )
    )  # fmt: skip
    url = f"http://127.0.0.1:{await listening}"

    async def ask(prompt: str, stream: bool) -> tuple[int | None, str]:
        body = {"model": "minilm", "prompt": prompt, "max_tokens": 8, "stream": stream}
        try:
            async with (
                aiohttp.ClientSession() as session,
                session.post(f"{url}/v1/completions", json=body) as r,
            ):
                return r.status, (await r.read()).decode()
        except aiohttp.ClientError as error:  # the connection closed under it: a client retries that
            return None, type(error).__name__

    asks = [asyncio.create_task(ask(f"held-{i}", stream=i == 1)) for i in range(3)]
    await until(lambda: waiting(driver) == 3)
    stopped = time.monotonic()
    stop.set()
    if serve_during_lame_duck:
        await asyncio.sleep(0.2)
        pool.set_state(0, ReplicaState.SERVING)
    results = await asyncio.wait_for(asyncio.gather(*asks), 10)
    took = time.monotonic() - stopped
    await asyncio.wait_for(server, 10)
    given_back = metric(driver, "iwg_rejected_requests_total", {"reason": "driver_stopping"})
    assert given_back == (0 if serve_during_lame_duck else 3)
    return results, took, pool


async def test_a_driver_told_to_stop_while_holding_requests_serves_them_if_a_replica_comes_in_time() -> None:
    """A driver pod deleted (a drain, a rollout) while it holds requests at zero: the replica being started
    for them joins it during its lame duck, and it answers them."""
    results, _, pool = await _stopping_driver_with_held_requests(serve_during_lame_duck=True)
    assert [status for status, _ in results] == [200, 200, 200], results
    assert results[1][1].endswith("data: [DONE]\n\n")  # the streamed one, as events
    assert sorted(r["prompt"] for r in pool.replicas[0].requests) == ["held-0", "held-1", "held-2"]


async def test_a_driver_that_stops_with_no_replica_come_gives_its_held_requests_back_for_retry() -> None:
    """No replica came before the driver's lame duck and drain ended: each held request is answered 503
    `driver_stopping` with Retry-After (the openai client retries it, reaching a driver that still runs),
    not left hanging until the process ends."""
    results, took, _ = await _stopping_driver_with_held_requests(serve_during_lame_duck=False)
    assert [status for status, _ in results] == [503, 503, 503], results
    assert all('"driver_stopping"' in text for _, text in results), results
    # The lame duck and the drain, then at once (5 s of room for a stalled machine): not the 60 s activation timeout.
    assert 0.5 + 1.0 <= took < 0.5 + 1.0 + 5.0, took
