"""Cache-aware routing on real engines: `iwg serve` with two SmolLM2 replicas (transformers' engine, prefix
caching on). A conversation's second turn goes to the replica that served its first, and the engines'
prefix-cache hits show it; 64 conversations sharing one system prompt spread within the load bound."""

from __future__ import annotations

import asyncio
import math
import re
import time
from collections.abc import Iterator
from typing import Any

import aiohttp
import pytest

from tests.iwg_worker.driver.conftest import Served, scrape_metrics, start_smollm2, stop, subprocess_env

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

MODEL = "smollm2"
POLICY = "cacheAware"  # leastLoaded here makes the second-turn test fail (checked by hand)
LOAD_BOUND = 0.25
STATS_POLL_S = 1.0  # the driver reads the engines' counts every second
PREFIX_CACHE = ("vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total")


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    served = start_smollm2(
        tmp_path_factory.mktemp("cache-routing"),
        {**subprocess_env(), "OMP_NUM_THREADS": "1"},
        replicas=2,
        spec={"driver": {"routing": {"policy": POLICY, "loadBound": LOAD_BOUND}}},
    )
    try:
        yield served
    finally:
        code = stop(served.process)
        assert code == 0, served.log.read_text(errors="replace")[-3000:]


def routed(sample: dict[str, float], reason: str | None = None) -> dict[int, float]:
    """Routing decisions per replica (of one reason, or all)."""
    out: dict[int, float] = {}
    for key, value in sample.items():
        match = re.match(r'iwg_routing_decisions_total\{reason="(\w+)",replica="(\d+)"\}', key)
        if match and (reason is None or match.group(1) == reason):
            out[int(match.group(2))] = out.get(int(match.group(2)), 0.0) + value
    return out


def delta(after: dict[int, float], before: dict[int, float]) -> dict[int, float]:
    return {r: v - before.get(r, 0.0) for r, v in after.items() if v - before.get(r, 0.0) > 0}


async def chat(
    session: aiohttp.ClientSession, url: str, messages: list[dict[str, str]], max_tokens: int, **extra: Any
) -> dict[str, Any]:
    body = {"model": MODEL, "messages": messages, "max_tokens": max_tokens, "temperature": 0, **extra}
    async with session.post(f"{url}/v1/chat/completions", json=body) as resp:
        assert resp.status == 200, await resp.text()
        return dict(await resp.json())


async def settled(session: aiohttp.ClientSession, url: str, since: dict[str, float]) -> dict[str, float]:
    """/metrics once the driver has read the engines' counts after the last request: its prefix-cache queries
    moved past their count in ``since`` (every request queries the cache), and its prefix-cache counters held
    still for three of its polls (a loaded machine may stall a poll a few seconds, so not a fixed wait)."""
    deadline = time.monotonic() + 60
    last: tuple[float, ...] = ()
    still_since = time.monotonic()
    while True:
        sample = await scrape_metrics(session, url)
        counts = tuple(sample.get(name, 0.0) for name in PREFIX_CACHE)
        now = time.monotonic()
        if counts != last:
            last, still_since = counts, now
        elif counts[0] > since.get(PREFIX_CACHE[0], 0.0) and now - still_since >= 3 * STATS_POLL_S:
            return sample
        assert now < deadline, f"the engines' prefix-cache counts did not settle in 60 s: {counts}"
        await asyncio.sleep(0.25)


async def test_second_turns_land_on_their_first_turns_replica_and_hit_its_prefix_cache(
    served: Served,
) -> None:
    topics = ["the sea", "mountains", "bread", "trains", "rain", "clocks", "bees", "maps"]
    first_turns = [
        [
            {
                "role": "user",
                "content": f"Conversation {u}. I want to learn about {topics[u % 8]}. "
                + " ".join(
                    f"Point {i}: tell me something true about {topics[u % 8]} number {u}." for i in range(8)
                ),
            }
        ]
        for u in range(16)
    ]
    async with aiohttp.ClientSession() as session:
        before = await scrape_metrics(session, served.url)
        # First turns all at once: the load bound spreads them (least-loaded would too).
        answers = await asyncio.gather(*(chat(session, served.url, m, 4) for m in first_turns))
        middle = await settled(session, served.url, before)
        first = delta(routed(middle), routed(before))
        assert len(first) == 2 and sum(first.values()) == 16, first
        # Second turns one at a time, last conversation first: nothing is open, so least-loaded would send
        # every one to replica 0; cache-aware sends each to the replica holding its first turn.
        prompt_tokens = []
        for u in reversed(range(16)):
            reply = answers[u]["choices"][0]["message"]["content"]
            messages = [
                *first_turns[u],
                {"role": "assistant", "content": reply},
                {"role": "user", "content": "Go on."},
            ]
            await chat(session, served.url, messages, 2)
            prompt_tokens.append(answers[u]["usage"]["prompt_tokens"])
        after = await settled(session, served.url, middle)
    # Every second turn found its first turn's full blocks (64 tokens each) in its replica's cache.
    hits = after["vllm:prefix_cache_hits_total"] - middle["vllm:prefix_cache_hits_total"]
    expected = sum(t // 64 * 64 for t in prompt_tokens)
    assert expected >= 16 * 64 and hits >= expected, (hits, expected)
    queries = after["vllm:prefix_cache_queries_total"] - middle["vllm:prefix_cache_queries_total"]
    assert queries > hits
    # The driver chose each for its prefix.
    assert delta(routed(after, "prefix"), routed(middle, "prefix")) == delta(routed(after), routed(middle))


async def test_64_conversations_sharing_a_system_prompt_spread_within_the_load_bound(served: Served) -> None:
    system = "You are the help desk of a railway. " + " ".join(
        f"Rule {i}: be brief and polite." for i in range(8)
    )  # about one block of text (the driver's) and of tokens (the engine's), shared
    async with aiohttp.ClientSession() as session:
        before = routed(await scrape_metrics(session, served.url))
        started = time.monotonic()
        await asyncio.gather(
            *(
                chat(
                    session,
                    served.url,
                    [
                        {"role": "system", "content": system},
                        {"role": "user", "content": f"I am passenger {u}."},
                    ],
                    4,
                    ignore_eos=True,
                )
                for u in range(64)
            )
        )
        elapsed = time.monotonic() - started
        placed = delta(routed(await scrape_metrics(session, served.url)), before)
    assert sum(placed.values()) == 64
    # Not all on the replica holding the system prompt; none above ceil((1 + eps) x mean) (all 64 were open).
    assert len(placed) == 2 and max(placed.values()) <= math.ceil((1 + LOAD_BOUND) * 32), (placed, elapsed)
