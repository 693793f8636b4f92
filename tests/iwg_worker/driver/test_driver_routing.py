"""Batching, routing, fail-over, admission and admin, in process against a fake replica pool (unit tests)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import replace
from typing import Any, cast

import pytest
from aiohttp.test_utils import TestClient, TestServer
from iwg_worker.driver.app import build_app
from iwg_worker.driver.executor_pool import ExecutorPool
from iwg_worker.driver.metrics import DriverMetrics
from iwg_worker.driver.pool import ReplicaState
from iwg_worker.driver.router import Router
from iwg_worker.driver.service import Driver, DriverConfig
from iwg_worker.executor.base import MembershipEvent as ExecutorEvent

from tests.iwg_worker.driver.fakes import FakePool

pytestmark = pytest.mark.timeout(60)

BASE = DriverConfig(served_name="minilm", task="embed", max_batch_size=4, max_wait_ms=20, max_queue=64)
TOKEN = "s3cret-admin-token"


@asynccontextmanager
async def serve(pool: FakePool, **overrides: Any) -> AsyncIterator[tuple[TestClient[Any, Any], Driver]]:
    driver = Driver(replace(BASE, **overrides), pool)
    driver.start()
    # As the driver's own server (server.py): a client that goes away cancels its handler.
    client = TestClient(TestServer(build_app(driver, admin_token=TOKEN), handler_cancellation=True))
    await client.start_server()
    try:
        yield client, driver
    finally:
        await client.close()
        await driver.stop()


async def embed(client: TestClient[Any, Any], text: str | list[str]) -> tuple[int, dict[str, Any], Any]:
    resp = await client.post("/v1/embeddings", json={"model": "minilm", "input": text})
    return resp.status, await resp.json(), resp.headers


def answered_by(body: dict[str, Any]) -> list[int]:
    return [int(d["embedding"][1]) for d in body["data"]]


async def until(condition: Callable[[], bool], timeout: float = 30.0) -> None:
    """Return once ``condition()`` holds (checked every 10 ms); fail after ``timeout`` s."""
    deadline = asyncio.get_running_loop().time() + timeout
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, f"not within {timeout} s"
        await asyncio.sleep(0.01)


def metric(driver: Driver, name: str, labels: dict[str, str] | None = None) -> float:
    value = driver.metrics.registry.get_sample_value(name, labels or {})
    return 0.0 if value is None else value


async def test_concurrent_requests_are_batched_up_to_max_batch_size() -> None:
    pool = FakePool(replicas=1, delay_s=0.05)
    async with serve(pool, max_wait_ms=50) as (client, _driver):
        texts = [f"text number {i}" for i in range(10)]
        results = await asyncio.gather(*(embed(client, t) for t in texts))
    assert all(status == 200 for status, _, _ in results)
    # Every request got the embedding of its own text, once.
    assert [body["data"][0]["embedding"][0] for _, body, _ in results] == [float(len(t)) for t in texts]
    sizes = [len(b.inputs) for b in pool.replicas[0].batches]
    assert sum(sizes) == 10 and max(sizes) == 4 and len(sizes) < 10


async def test_a_request_larger_than_a_batch_is_split_and_reassembled_in_order() -> None:
    pool = FakePool(replicas=2)
    async with serve(pool) as (client, _driver):
        texts = ["x" * (i + 1) for i in range(11)]
        status, body, _ = await embed(client, texts)
    assert status == 200
    assert [d["index"] for d in body["data"]] == list(range(11))
    assert [d["embedding"][0] for d in body["data"]] == [float(i + 1) for i in range(11)]


async def test_least_loaded_replica_is_chosen() -> None:
    # Each batch takes 3 s: the first is still in flight when the second is placed, however slow the machine.
    pool = FakePool(replicas=3, delay_s=3.0)
    async with serve(pool, max_batch_size=1, max_wait_ms=0) as (client, driver):
        first = asyncio.create_task(embed(client, "a"))
        await until(lambda: driver.router.inflight(0) == 1)
        second = asyncio.create_task(embed(client, "b"))
        await until(lambda: sum(driver.router.inflight(r) for r in range(3)) == 2)
        assert (driver.router.inflight(0), driver.router.inflight(1)) == (1, 1)
        assert driver.router.pick() == 2
        await asyncio.gather(first, second)


async def test_other_drivers_requests_on_a_replica_count_as_its_load() -> None:
    pool = FakePool(replicas=3)
    async with serve(pool) as (_client, driver):
        router = driver.router
        with router.claim(0):
            # Replica 0's engine holds 3 requests: ours and two of other drivers; replica 1's holds 1 of theirs.
            router.observe_engine(0, 3)
            router.observe_engine(1, 1)
            assert [r["other_drivers_requests"] for r in router.snapshot()] == [2, 1, 0]
            assert router.pick() == 2
            router.observe_engine(2, 4)
            assert router.pick() == 1
            router.observe_engine(1, 5)
            assert router.pick() == 0  # 1 ours + 2 theirs, against 5 and 4 of theirs
        pool.set_state(1, ReplicaState.DEAD)  # a replica that left forgets what was counted on it
        assert [r["other_drivers_requests"] for r in router.snapshot()] == [2, 0, 4]


async def test_batch_of_a_dying_replica_is_retried_once_on_another() -> None:
    pool = FakePool(replicas=2)
    pool.replicas[0].fail_next = 1
    async with serve(pool, max_batch_size=8) as (client, driver):
        status, body, _ = await embed(client, ["one", "three"])
        assert status == 200
        assert answered_by(body) == [1, 1]
        assert metric(driver, "iwg_batch_retries_total") == 1
        assert metric(driver, "iwg_replica_failures_total", {"replica": "0"}) == 1


async def test_a_timed_out_replica_counts_as_failed_and_the_batch_moves_on() -> None:
    pool = FakePool(replicas=2)
    pool.replicas[0].hang = True
    async with serve(pool, batch_timeout_s=0.3) as (client, _driver):
        status, body, _ = await embed(client, "late")
    assert status == 200 and answered_by(body) == [1]


async def test_two_failures_end_the_request_with_503_not_a_third_try() -> None:
    pool = FakePool(replicas=3)
    for r in (0, 1, 2):
        pool.replicas[r].fail_next = 1
    async with serve(pool) as (client, _driver):
        status, body, headers = await embed(client, "doomed")
    assert status == 503 and body["error"]["code"] == "replica_failure"
    assert "Retry-After" in headers
    assert sum(len(rep.batches) for rep in pool.replicas.values()) == 2


async def test_worker_error_is_not_retried_and_is_a_server_error() -> None:
    pool = FakePool(replicas=2)
    pool.replicas[0].error_next = 1
    async with serve(pool) as (client, _driver):
        status, body, _ = await embed(client, "boom")
    assert status == 500 and "ValueError: boom" in body["error"]["message"]
    assert len(pool.replicas[1].batches) == 0


async def test_no_serving_replica_gives_503_with_retry_after() -> None:
    pool = FakePool(replicas=2)
    pool.replicas[0].state = pool.replicas[1].state = ReplicaState.DEAD
    async with serve(pool, no_replica_grace_s=0.2) as (client, driver):
        status, body, headers = await embed(client, "anyone?")
        ready = await client.get("/readyz")
        assert ready.status == 503
        assert metric(driver, "iwg_rejected_requests_total", {"reason": "no_replica"}) == 1
    assert status == 503 and body["error"]["type"] == "service_unavailable"
    assert int(headers["Retry-After"]) >= 1


async def test_a_request_arriving_while_no_replica_serves_is_served_by_one_back_within_the_grace() -> None:
    """The only replica drops for a moment (a missed heartbeat: it is back at its next one). An embedding request
    arriving meanwhile waits the grace a generation request waits, and is served; one arriving when none comes
    back within the grace gets 503."""
    pool = FakePool(replicas=1)
    pool.replicas[0].state = ReplicaState.DEAD
    async with serve(pool, no_replica_grace_s=3.0) as (client, driver):
        asked = asyncio.create_task(embed(client, "still there?"))
        await asyncio.sleep(0.5)
        assert not asked.done()
        pool.set_state(0, ReplicaState.SERVING)
        status, body, _ = await asked
        assert status == 200 and answered_by(body) == [0]
        assert metric(driver, "iwg_rejected_requests_total", {"reason": "no_replica"}) == 0


async def test_queued_inputs_fail_with_503_when_every_replica_dies_and_none_returns() -> None:
    pool = FakePool(replicas=1, delay_s=0.5)
    async with serve(pool, max_batch_size=1, max_inflight_per_replica=1, no_replica_grace_s=0.3) as (
        client,
        _d,
    ):
        tasks = [asyncio.create_task(embed(client, f"q{i}")) for i in range(3)]
        await asyncio.sleep(0.1)
        pool.set_state(0, ReplicaState.DEAD)
        results = await asyncio.gather(*tasks)
    assert sorted(status for status, _, _ in results) == [503, 503, 503]


async def test_dead_replica_leaves_routing_and_rejoins() -> None:
    pool = FakePool(replicas=2)
    async with serve(pool) as (client, driver):
        pool.set_state(1, ReplicaState.DEAD)
        assert driver.router.serving() == [0]
        assert metric(driver, "iwg_replica_state", {"replica": "1", "state": "dead"}) == 1
        for _ in range(3):
            status, body, _ = await embed(client, "x")
            assert status == 200 and answered_by(body) == [0]
        pool.set_state(1, ReplicaState.SERVING)
        assert driver.router.serving() == [0, 1]
        assert metric(driver, "iwg_serving_replicas") == 2


async def test_queue_overflow_gives_429_with_retry_after_and_admitted_requests_complete() -> None:
    pool = FakePool(replicas=1, delay_s=0.3)
    async with serve(pool, max_batch_size=1, max_inflight_per_replica=1, max_queue=3) as (client, driver):
        tasks = [asyncio.create_task(embed(client, f"r{i}")) for i in range(8)]
        results = await asyncio.gather(*tasks)
        assert metric(driver, "iwg_rejected_requests_total", {"reason": "queue_full"}) >= 1
    statuses = [status for status, _, _ in results]
    assert 429 in statuses and 200 in statuses and set(statuses) == {200, 429}
    for status, body, headers in results:
        if status == 429:
            assert int(headers["Retry-After"]) >= 1
            assert body["error"]["type"] == "rate_limit_error"


async def test_request_larger_than_the_queue_is_refused_whole() -> None:
    pool = FakePool(replicas=1)
    async with serve(pool, max_queue=3) as (client, _driver):
        status, _, _ = await embed(client, ["a", "b", "c", "d"])
    assert status == 429
    assert pool.replicas[0].batches == []


async def test_drain_stops_new_batches_and_waits_for_inflight() -> None:
    pool = FakePool(replicas=2, delay_s=0.01)
    # Replica 0's batch takes 3 s: still in flight when the drain starts, however slow the machine.
    pool.replicas[0].delay_s = 3.0
    auth = {"Authorization": f"Bearer {TOKEN}"}
    async with serve(pool, max_batch_size=1, max_wait_ms=0) as (client, driver):
        inflight = asyncio.create_task(embed(client, "in flight on 0"))
        await until(lambda: driver.router.inflight(0) == 1)
        resp = await client.post("/admin/replicas/0/drain", headers=auth)
        body = await resp.json()
        assert resp.status == 200 and body["drained"] is True and body["inflight_batches"] == 0
        status, result, _ = await inflight
        assert status == 200 and answered_by(result) == [0]
        assert metric(driver, "iwg_replica_state", {"replica": "0", "state": "draining"}) == 1
        for _ in range(3):
            _, result, _ = await embed(client, "after drain")
            assert answered_by(result) == [1]
        resp = await client.post("/admin/replicas/0/undrain", headers=auth)
        assert resp.status == 200
        assert driver.router.serving() == [0, 1]


class SwappingExecutor:
    """Just enough of an executor for ExecutorPool: replica 0 serves, and its events are published by hand."""

    world_size = 1

    def __init__(self) -> None:
        self.serving: frozenset[int] = frozenset({0})
        self.callback: Callable[[ExecutorEvent], None] | None = None

    def subscribe(self, callback: Callable[[ExecutorEvent], None]) -> Callable[[], None]:
        self.callback = callback
        return lambda: None

    def serving_replicas(self) -> frozenset[int]:
        return self.serving

    def draining_replicas(self) -> frozenset[int]:
        return frozenset()


async def test_a_drained_replica_whose_pod_is_replaced_before_the_loop_looks_serves_again() -> None:
    # The operator drained replica 0 to scale to zero, then a held request scaled it back up: the old pod left
    # and the new one joined on the executor's I/O thread before the event loop ran either event. The router
    # must still see the replica lost (so the drain of the pod that went ends) and then serving.
    executor = SwappingExecutor()
    router = Router(ExecutorPool(cast(Any, executor)), DriverMetrics())
    assert await router.drain(0, timeout=1) and router.serving() == []
    assert executor.callback is not None
    executor.callback(ExecutorEvent("left", 0, 0, "goodbye", frozenset()))
    executor.callback(ExecutorEvent("lost", 0, None, "rank 0 left", frozenset()))
    executor.callback(ExecutorEvent("joined", 0, 0, "pod new", frozenset()))
    executor.callback(ExecutorEvent("serving", 0, None, "all ranks joined", frozenset({0})))
    await asyncio.sleep(0.05)  # the events, in order, on the loop: the executor serves replica 0 all along
    assert router.serving() == [0]


async def test_adjust_batch_params_applies_to_the_drivers_batcher() -> None:
    pool = FakePool(replicas=2, delay_s=0.05)
    auth = {"Authorization": f"Bearer {TOKEN}"}
    async with serve(pool, max_batch_size=8, max_wait_ms=50) as (client, driver):
        resp = await client.post(
            "/admin/batch-params", headers=auth, json={"max_batch_size": 2, "max_wait_ms": 5}
        )
        body = await resp.json()
        assert resp.status == 200, body
        assert body == {"max_batch_size": 2, "max_wait_ms": 5.0}
        assert metric(driver, "iwg_max_batch_size") == 2
        await asyncio.gather(*(embed(client, f"t{i}") for i in range(9)))
    sizes = [len(b.inputs) for rep in pool.replicas.values() for b in rep.batches]
    assert max(sizes) <= 2 and sum(sizes) == 9


@pytest.mark.parametrize(
    ("headers", "status"),
    [({}, 401), ({"Authorization": "Bearer wrong"}, 401), ({"Authorization": f"Basic {TOKEN}"}, 401)],
)
async def test_admin_needs_the_token(headers: dict[str, str], status: int) -> None:
    async with serve(FakePool()) as (client, driver):
        for call in (
            client.get("/admin/replicas", headers=headers),
            client.post("/admin/replicas/0/drain", headers=headers),
        ):
            resp = await call
            assert resp.status == status
            assert (await resp.json())["error"]["type"] == "authentication_error"
        assert driver.router.serving() == [0, 1]


async def test_admin_is_disabled_without_a_token() -> None:
    pool = FakePool()
    driver = Driver(BASE, pool)
    driver.start()
    async with TestClient(TestServer(build_app(driver, admin_token=None))) as client:
        resp = await client.get("/admin/replicas", headers={"Authorization": "Bearer "})
        assert resp.status == 403
    await driver.stop()


async def test_admin_bad_input_is_a_4xx() -> None:
    auth = {"Authorization": f"Bearer {TOKEN}"}
    async with serve(FakePool()) as (client, _driver):
        checks: list[tuple[Callable[[], Any], int]] = [
            (lambda: client.post("/admin/replicas/7/drain", headers=auth), 404),
            (lambda: client.post("/admin/replicas/x/drain", headers=auth), 404),
            (lambda: client.post("/admin/batch-params", headers=auth, json={"max_batch_size": 0}), 400),
            (lambda: client.post("/admin/batch-params", headers=auth, json={"max_batch": 3}), 400),
        ]
        for call, status in checks:
            resp = await call()
            assert resp.status == status, await resp.text()


async def test_metrics_expose_queue_inflight_latency_and_batch_sizes() -> None:
    pool = FakePool(replicas=1)
    async with serve(pool) as (client, _driver):
        await asyncio.gather(*(embed(client, "m") for _ in range(5)))
        text = await (await client.get("/metrics")).text()
    for name in (
        "iwg_queue_depth",
        "iwg_inflight_requests",
        "iwg_inflight_batches",
        'iwg_request_latency_seconds_count{endpoint="embeddings"} 5.0',
        "iwg_batch_latency_seconds_bucket",
        "iwg_batch_size_sum 5.0",
        'iwg_replica_state{replica="0",state="serving"} 1.0',
        'iwg_requests_total{endpoint="embeddings",status="200"} 5.0',
    ):
        assert name in text, name


async def test_completions_stream_each_prompt_from_an_engine_with_its_own_parameters() -> None:
    pool = FakePool(replicas=1, delay_s=0.05)
    async with serve(pool, task="generate", max_wait_ms=30) as (client, _driver):

        async def complete(**body: Any) -> tuple[int, dict[str, Any]]:
            resp = await client.post("/v1/completions", json={"model": "minilm", **body})
            return resp.status, await resp.json()

        (s1, short), (s2, long), (s3, stopped) = await asyncio.gather(
            complete(prompt="abcdef", max_tokens=3),
            complete(prompt=["hello", "world"], max_tokens=10),
            complete(prompt="xyz-stop-abc", max_tokens=20, stop=["pots"]),
        )
    assert (s1, s2, s3) == (200, 200, 200)
    assert short["choices"] == [{"text": "fed", "index": 0, "logprobs": None, "finish_reason": "length"}]
    assert [c["text"] for c in long["choices"]] == ["olleh", "dlrow"]
    assert [c["finish_reason"] for c in long["choices"]] == ["stop", "stop"]
    assert long["usage"] == {"prompt_tokens": 10, "completion_tokens": 10, "total_tokens": 20}
    assert stopped["choices"][0]["text"] == "cba-" and stopped["choices"][0]["finish_reason"] == "stop"
    assert stopped["object"] == "text_completion" and stopped["id"].startswith("cmpl-")
    # Every prompt is its own engine request, carrying its request's parameters; none was cancelled.
    requests = pool.replicas[0].requests
    assert sorted(r["max_tokens"] for r in requests) == [3, 10, 10, 20]
    assert [r["stop"] for r in requests if r["max_tokens"] == 20] == [["pots"]]
    assert len({r["id"] for r in requests}) == 4 and pool.replicas[0].cancelled == []


async def test_streams_beyond_the_generation_limit_get_429_with_retry_after_and_the_rest_serve() -> None:
    pool = FakePool(replicas=1, delay_s=1.0)
    async with serve(pool, task="generate", max_streams=4) as (client, driver):
        body = {"model": "minilm", "prompt": "abcdefgh", "max_tokens": 8, "stream": True}
        first = await client.post("/v1/completions", json={**body, "n": 3})
        assert first.status == 200
        await first.content.readline()  # its three choices run
        second = await client.post("/v1/completions", json={**body, "n": 2})  # 3 + 2 > 4
        refused = await second.json()
        assert second.status == 429 and second.headers["Retry-After"] == "1", refused
        assert refused["error"]["code"] == "queue_full"
        third = await client.post("/v1/completions", json={**body, "n": 1})  # 3 + 1 fits
        assert third.status == 200
        texts = [await first.text(), await third.text()]
        assert all(t.rstrip().endswith("data: [DONE]") for t in texts)
        assert driver.generations.active == 0
        again = await client.post("/v1/completions", json={**body, "n": 4})  # room again once they ended
        assert again.status == 200 and (await again.text()).rstrip().endswith("data: [DONE]")
    assert metric(driver, "iwg_rejected_requests_total", {"reason": "queue_full"}) == 1


async def test_embeddings_on_a_generate_group_is_a_400() -> None:
    async with serve(FakePool(), task="generate") as (client, _driver):
        status, body, _ = await embed(client, "x")
    assert status == 400 and "/v1/completions" in body["error"]["message"]


@pytest.mark.parametrize(
    ("vocab_size", "prompt", "param", "words"),
    [
        (97, [5, 97], "prompt", ["97", "vocabulary of 97"]),
        (97, [[1, 2], [3, 400]], "prompt[1]", ["400", "vocabulary of 97"]),
        (None, [2**31], "prompt", [str(2**31)]),
        (None, [2**70], "prompt", [str(2**70)]),
    ],
    ids=["at the vocabulary size", "second prompt", "above int32, vocabulary unknown", "beyond int64"],
)
async def test_token_ids_outside_the_vocabulary_are_a_400_and_never_reach_a_replica(
    vocab_size: int | None, prompt: Any, param: str, words: list[str]
) -> None:
    pool = FakePool(replicas=1)
    async with serve(pool, task="generate", vocab_size=vocab_size) as (client, _driver):
        resp = await client.post("/v1/completions", json={"model": "minilm", "prompt": prompt})
        body = await resp.json()
        ok = await client.post("/v1/completions", json={"model": "minilm", "prompt": [5, 96]})
    assert resp.status == 400, body
    assert body["error"]["param"] == param, body
    for word in words:
        assert word in body["error"]["message"], body
    assert ok.status == 200
    assert [r["prompt_ids"] for r in pool.replicas[0].requests] == [[5, 96]]


async def test_a_drained_replica_that_left_serves_again_when_its_index_comes_back() -> None:
    pool = FakePool(replicas=2, delay_s=0.01)
    auth = {"Authorization": f"Bearer {TOKEN}"}
    async with serve(pool) as (client, driver):
        resp = await client.post("/admin/replicas/1/drain", headers=auth)
        assert resp.status == 200 and driver.router.serving() == [0]
        pool.set_state(1, ReplicaState.DEAD)  # scaled down: its pods went
        pool.set_state(1, ReplicaState.SERVING)  # scaled up again: new pods joined
        assert driver.router.serving() == [0, 1]


async def test_a_token_id_prompt_that_fills_the_models_context_is_a_400() -> None:
    pool = FakePool(replicas=1)
    async with serve(pool, task="generate", context_length=64) as (client, _driver):
        resp = await client.post("/v1/completions", json={"model": "minilm", "prompt": [[1] * 10, [1] * 64]})
        body = await resp.json()
        ok = await client.post("/v1/completions", json={"model": "minilm", "prompt": [1] * 63})
    assert resp.status == 400 and body["error"]["param"] == "prompt[1]", body
    assert "64 tokens" in body["error"]["message"] and "64 positions" in body["error"]["message"], body
    assert ok.status == 200
    assert [len(r["prompt_ids"]) for r in pool.replicas[0].requests] == [63]


async def test_a_stream_that_produced_nothing_is_retried_and_one_that_did_is_not() -> None:
    pool = FakePool(replicas=2, delay_s=0.02)
    async with serve(pool, task="generate") as (client, _driver):
        pool.replicas[0].die_after_items = 0
        pool.replicas[1].die_after_items = 0
        # Both replicas die before any output: tried on each, once, then a 503 that says so.
        resp = await client.post("/v1/completions", json={"model": "minilm", "prompt": "abcdef"})
        assert resp.status == 503 and (await resp.json())["error"]["code"] == "replica_failure"
        assert [len(pool.replicas[r].requests) for r in (0, 1)] == [1, 1]
        pool.replicas[1].die_after_items = None
        resp = await client.post("/v1/completions", json={"model": "minilm", "prompt": "abcdef"})
        body = await resp.json()
        assert resp.status == 200 and body["choices"][0]["text"] == "fedcba", body
        # Output already sent cannot be taken back: a replica dying mid-stream fails the request, no retry.
        pool.replicas[0].die_after_items = 2
        pool.replicas[1].die_after_items = 2
        before = [len(pool.replicas[r].requests) for r in (0, 1)]
        resp = await client.post("/v1/completions", json={"model": "minilm", "prompt": "abcdef"})
        body = await resp.json()
        assert resp.status == 503 and "mid-way" in body["error"]["message"], body
        after = [len(pool.replicas[r].requests) for r in (0, 1)]
        assert sum(after) - sum(before) == 1
