"""Cache-aware routing decisions (unit tests, in process against a fake replica pool): the longest recorded
prefix wins, bounded by load; new prompts by rendezvous hashing, alike in every driver; a replica that dies or
drains leaves the table. The same routing on real engines: test_driver_cache_routing.py."""

from __future__ import annotations

import contextlib
import math
from collections import Counter
from typing import Any

import pytest
from iwg_worker.driver.metrics import DriverMetrics
from iwg_worker.driver.pool import ReplicaState
from iwg_worker.driver.prefix import PrefixTable, prompt_blocks
from iwg_worker.driver.router import Router, RoutingPolicy
from iwg_worker.driver.streams import GenerationService

from tests.iwg_worker.driver.fakes import FakePool

pytestmark = pytest.mark.timeout(60)

BLOCK = 16
SYSTEM = "You are a helpful assistant who answers in plain words. " * 10  # about 8 blocks of text


def chat(user: int, *turns: str) -> dict[str, Any]:
    messages = [{"role": "system", "content": SYSTEM}]
    for i, text in enumerate(turns):
        messages.append({"role": "user" if i % 2 == 0 else "assistant", "content": f"{user}: {text}"})
    return {"messages": messages}


def router(pool: FakePool, policy: RoutingPolicy = "cacheAware", load_bound: float = 0.25) -> Router:
    r = Router(pool, DriverMetrics(), policy=policy, load_bound=load_bound)
    r.block_size = BLOCK
    return r


def route(r: Router, request: dict[str, Any]) -> int:
    replica = r.pick_generation(prompt_blocks(request, r.block_size))
    assert replica is not None
    return replica


def route_together(r: Router, requests: dict[int, dict[str, Any]]) -> dict[int, int]:
    """Route requests that are all open at once (each claimed, as its stream is while it runs)."""
    placed: dict[int, int] = {}
    with contextlib.ExitStack() as open_streams:
        for key, request in requests.items():
            placed[key] = route(r, request)
            open_streams.enter_context(r.claim(placed[key]))
    return placed


def test_a_chats_next_turn_extends_its_blocks() -> None:
    first = prompt_blocks(chat(1, "Tell me about the sea. " * 8), BLOCK)
    second = prompt_blocks(chat(1, "Tell me about the sea. " * 8, "It is big.", "And ships?"), BLOCK)
    other = prompt_blocks(chat(2, "Tell me about the sea. " * 8), BLOCK)
    assert first is not None and second is not None and other is not None
    assert second.hashes[: len(first.hashes)] == first.hashes
    assert len(second.hashes) > len(first.hashes)
    shared = len(SYSTEM) // (BLOCK * 4)  # the system prompt's full blocks, and no more
    assert other.hashes[:shared] == first.hashes[:shared] and other.hashes[shared] != first.hashes[shared]
    ids = prompt_blocks({"prompt_ids": list(range(40))}, BLOCK)
    assert ids is not None and len(ids.hashes) == 2  # token ids: blocks of the engine's block size


@pytest.mark.parametrize("policy", ["cacheAware", "leastLoaded"])
async def test_second_turns_go_where_their_first_turns_went_only_when_cache_aware(
    policy: RoutingPolicy,
) -> None:
    r = router(FakePool(replicas=4), policy)
    first = route_together(r, {u: chat(u, f"Question {u} about the sea. " * 6) for u in range(16)})
    assert len(set(first.values())) > 1  # open together, they spread (the load bound)
    again = {u: route(r, chat(u, f"Question {u} about the sea. " * 6, "An answer.", "More?")) for u in first}
    same = sum(first[u] == again[u] for u in first)
    if policy == "cacheAware":
        assert same == 16
    else:
        assert same < 16  # nothing open: the least loaded is always replica 0


async def test_64_conversations_sharing_a_system_prompt_stay_within_the_load_bound() -> None:
    pool = FakePool(replicas=2)
    r = router(pool, load_bound=0.25)
    placed: Counter[int] = Counter()
    claims = []
    for user in range(64):  # all 64 open at once (claimed, as a stream is while it runs)
        replica = route(r, chat(user, "Hello!"))
        placed[replica] += 1
        claim = r.claim(replica)
        claim.__enter__()
        claims.append(claim)
        mean = sum(placed.values()) / 2
        assert max(placed.values()) <= math.ceil(1.25 * mean)  # at every decision
    assert len(placed) == 2 and max(placed.values()) <= 40  # ceil(1.25 x 32)
    for claim in claims:
        claim.__exit__(None, None, None)


async def test_without_the_bound_one_system_prompt_takes_every_conversation_to_one_replica() -> None:
    r = router(FakePool(replicas=2), load_bound=1000.0)
    placed = Counter()
    for user in range(64):
        replica = route(r, chat(user, "Hello!"))
        placed[replica] += 1
        r.claim(replica).__enter__()
    assert len(placed) == 1  # the prefix wins: what the bound above prevents


async def test_two_drivers_send_a_new_conversation_to_the_same_replica() -> None:
    pool = FakePool(replicas=5)
    a, b = router(pool), router(pool)
    chosen: set[int] = set()
    for user in range(20):
        request = {"prompt": f"User {user} asks: " + "what is the sea? " * 20}  # no prompt in common
        replica = route(a, request)
        assert route(b, request) == replica
        chosen.add(replica)
    assert len(chosen) > 1  # and conversations with nothing in common spread


async def test_a_replica_that_dies_or_drains_leaves_the_table_at_once() -> None:
    pool = FakePool(replicas=3)
    r = router(pool)
    placed = route_together(r, {u: chat(u, f"Conversation {u}. " * 10) for u in range(12)})
    victim = placed[0]
    held = r.table.size(victim)
    assert held > 0
    pool.set_state(victim, ReplicaState.DEAD)
    assert r.table.size(victim) == 0
    moved = {u: route(r, chat(u, f"Conversation {u}. " * 10, "ok", "next")) for u, p in placed.items()}
    assert victim not in moved.values()
    survivors = [u for u, p in placed.items() if p != victim]
    assert all(moved[u] == placed[u] for u in survivors)  # the others' conversations stay where they were
    # A draining replica leaves the table too, and gets nothing new.
    other = placed[survivors[0]]
    drain = r.drain(other, timeout=0.1)
    await drain
    assert r.table.size(other) == 0
    assert route(r, chat(survivors[0], f"Conversation {survivors[0]}. " * 10, "ok", "next")) != other


def test_the_table_forgets_the_least_recently_used_blocks_first_beyond_its_bound() -> None:
    table = PrefixTable(max_blocks=10)
    old = prompt_blocks({"prompt_ids": list(range(6 * BLOCK))}, BLOCK)
    new = prompt_blocks({"prompt_ids": list(range(1000, 1000 + 6 * BLOCK))}, BLOCK)
    assert old is not None and new is not None
    table.record(0, old.hashes)
    table.record(0, new.hashes)
    assert table.size(0) == 10
    assert table.match(0, new.hashes) == 6
    assert table.match(0, old.hashes) == 4  # its last two blocks went first: its first four still match


async def test_an_engine_that_evicted_its_cached_blocks_empties_its_replicas_table() -> None:
    pool = FakePool(replicas=2)
    counts = {0: {"prefix_cache_queries": 0, "prefix_cache_evictions": 0}, 1: {"prefix_cache_queries": 0}}

    async def engine_stats(
        replica: int, timeout: float, blocks_since: list[int] | None = None
    ) -> dict[str, Any]:
        return {"requests_running": 0, "requests_waiting": 0, "block_size": BLOCK, **counts[replica]}

    pool.engine_stats = engine_stats  # type: ignore[method-assign]
    r = router(pool)
    service = GenerationService(pool, r, r._metrics, timeout_s=60)
    placed = route_together(r, {u: chat(u, f"Conversation {u}. " * 10) for u in range(8)})
    assert set(placed.values()) == {0, 1}
    await service.poll_once()
    assert r.table.size(0) > 0 and r.table.size(1) > 0  # nothing evicted yet
    counts[0] = {"prefix_cache_queries": 100, "prefix_cache_evictions": 1}
    await service.poll_once()
    assert r.table.size(0) == 0 and r.table.size(1) > 0
    assert r._metrics.registry.get_sample_value("vllm:prefix_cache_queries_total") == 100


async def test_the_table_follows_the_blocks_an_engine_reports_stored_and_evicted() -> None:
    """vLLM's engine reports the driver hashes its prefix cache stored and evicted (engine.kv_events): an
    evicted prefix is no longer claimed, a prefix another driver sent is learned, and a reset starts again
    from what the engine holds."""
    pool = FakePool(replicas=2)
    reports: dict[int, dict[str, Any]] = {}
    asked: list[tuple[int, list[int] | None]] = []

    async def engine_stats(
        replica: int, timeout: float, blocks_since: list[int] | None = None
    ) -> dict[str, Any]:
        asked.append((replica, blocks_since))
        report = reports.pop(replica, {"epoch": 7, "seq": 0, "reset": False, "stored": [], "removed": []})
        return {"requests_running": 0, "requests_waiting": 0, "block_size": BLOCK, "prefix_blocks": report}

    pool.engine_stats = engine_stats  # type: ignore[method-assign]
    r = router(pool)
    service = GenerationService(pool, r, r._metrics, timeout_s=60)
    conversation = prompt_blocks(chat(1, "Tell me about the sea. " * 8), BLOCK)
    elsewhere = prompt_blocks(chat(2, "Tell me about the mountains. " * 8), BLOCK)
    assert conversation is not None and elsewhere is not None
    placed = r.pick_generation(conversation)
    assert placed is not None
    other = 1 - placed
    assert r.table.match(placed, conversation.hashes) == len(conversation.hashes)

    # The engine evicted the conversation's blocks from the sixth on; another driver's request put a prompt
    # on the other replica.
    reports[placed] = {
        "epoch": 7,
        "seq": 3,
        "reset": False,
        "stored": [],
        "removed": list(conversation.hashes[5:]),
    }
    reports[other] = {"epoch": 9, "seq": 4, "reset": False, "stored": list(elsewhere.hashes), "removed": []}
    await service.poll_once()
    assert r.table.match(placed, conversation.hashes) == 5
    assert r.table.match(other, elsewhere.hashes) == len(elsewhere.hashes)
    assert r.pick_generation(elsewhere) == other  # routed by the prefix it learned, not by hashing
    metrics = r._metrics.registry
    assert (
        metrics.get_sample_value(
            "iwg_routing_blocks_reported_total", {"replica": str(placed), "event": "evicted"}
        )
        == len(conversation.hashes) - 5
    )

    # Each replica is asked from its last report on.
    asked.clear()
    await service.poll_once()
    assert dict(asked) == {placed: [7, 3], other: [9, 4]}

    # A reset (the engine restarted, or its events were lost): what it holds now, nothing else.
    reports[placed] = {
        "epoch": 8,
        "seq": 1,
        "reset": True,
        "stored": list(conversation.hashes[:2]),
        "removed": [],
    }
    await service.poll_once()
    assert r.table.match(placed, conversation.hashes) == 2
    assert r.table.size(placed) == 2
    assert r.table.match(other, elsewhere.hashes) == len(elsewhere.hashes)  # the other replica's view stays


async def test_leastloaded_routing_asks_no_engine_for_its_blocks() -> None:
    pool = FakePool(replicas=1)
    asked: list[list[int] | None] = []

    async def engine_stats(
        replica: int, timeout: float, blocks_since: list[int] | None = None
    ) -> dict[str, Any]:
        asked.append(blocks_since)
        return {"requests_running": 0, "requests_waiting": 0}

    pool.engine_stats = engine_stats  # type: ignore[method-assign]
    r = router(pool, policy="leastLoaded")
    await GenerationService(pool, r, r._metrics, timeout_s=60).poll_once()
    assert asked == [None]


@pytest.mark.parametrize(
    "malformed",
    [
        {"epoch": 7, "reset": False, "stored": [], "removed": []},  # no seq
        {"epoch": 7, "seq": 1, "stored": ["not a hash"], "removed": []},
        {"epoch": 7, "seq": 1, "stored": 5, "removed": []},
        ["not", "an", "object"],
    ],
)
async def test_a_malformed_block_report_costs_its_replica_its_table_and_not_the_poll(malformed: Any) -> None:
    """A report the driver cannot read (a worker of another version, a bug) is not applied in part: that
    replica's table is forgotten and its next report asked for from the start; the other replica's report is
    applied, the counts exported, and the next poll runs."""
    pool = FakePool(replicas=2)
    asked: list[tuple[int, list[int] | None]] = []
    good = {"epoch": 3, "seq": 2, "reset": False, "stored": [], "removed": []}
    reports: dict[int, Any] = {0: malformed, 1: good}

    async def engine_stats(
        replica: int, timeout: float, blocks_since: list[int] | None = None
    ) -> dict[str, Any]:
        asked.append((replica, blocks_since))
        return {
            "requests_running": 1,
            "requests_waiting": 0,
            "block_size": BLOCK,
            "prefix_blocks": reports[replica],
        }

    pool.engine_stats = engine_stats  # type: ignore[method-assign]
    r = router(pool)
    service = GenerationService(pool, r, r._metrics, timeout_s=60)
    placed = route_together(r, {u: chat(u, f"Conversation {u}. " * 10) for u in range(8)})
    assert set(placed.values()) == {0, 1}
    service._blocks_seen[0] = [3, 1]
    await service.poll_once()  # does not raise
    assert r.table.size(0) == 0 and r.table.size(1) > 0
    assert r._metrics.registry.get_sample_value("iwg_requests_running") == 1  # replica 1's count
    reports[0] = good
    asked.clear()
    await service.poll_once()
    assert dict(asked) == {0: [], 1: [3, 2]}
