"""The driver's routing table follows what the engine really evicts: `iwg serve` with one SmolLM2 replica and a
KV cache of 16 blocks (1,024 tokens), on each engine. A conversation's prompt, pushed out of the cache by two
longer prompts, is no longer claimed: its next turn is routed as new, and the engine finds none of it cached.
vLLM's engine reports its blocks one by one (its KV cache events, engine.kv_events); the transformers engine
evicts every cached block at once and counts it. Without either report the driver would still route the
conversation "by prefix" to a cache that lost it."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import aiohttp
import pytest

from tests.iwg_worker.driver.conftest import Served, scrape_metrics, start_smollm2, stop, subprocess_env
from tests.iwg_worker.driver.test_driver_cache_routing import chat, delta, routed, settled

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

KV_BLOCKS = 16  # of 64 tokens: 1,024 tokens
REPORTED = "iwg_routing_blocks_reported_total"


@pytest.fixture(scope="module", params=["transformers", "vllm"])
def small_cache(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    served = start_smollm2(
        tmp_path_factory.mktemp(f"cache-evictions-{request.param}"),
        {**subprocess_env(), "OMP_NUM_THREADS": "2"},
        kv_blocks=KV_BLOCKS,
        engine=request.param,
    )
    try:
        yield served
    finally:
        code = stop(served.process)
        assert code == 0, served.log.read_text(errors="replace")[-3000:]


def words(topic: str, count: int) -> str:
    return " ".join(f"{topic} {i} is written here." for i in range(count))


def reported(sample: dict[str, float], event: str) -> float:
    return sum(v for k, v in sample.items() if k.startswith(f'{REPORTED}{{event="{event}"'))


async def polled(session: aiohttp.ClientSession, url: str) -> None:
    """Until the driver has read the engine's counts once (its block size among them: prompts are hashed in
    blocks of it)."""
    deadline = time.monotonic() + 30
    while 'iwg_kv_cache_usage{replica="0"}' not in await scrape_metrics(session, url):
        assert time.monotonic() < deadline, "the driver read no engine stats in 30 s"
        await asyncio.sleep(0.25)


async def test_a_conversation_the_engine_evicted_is_routed_as_new_and_finds_nothing_cached(
    small_cache: Served,
) -> None:
    url = small_cache.url
    conversation = [
        {"role": "system", "content": words("Rule", 50)},  # 410 tokens: six full blocks
        {"role": "user", "content": "What is rule 3?"},
    ]
    async with aiohttp.ClientSession() as session:
        await polled(session, url)
        start = await scrape_metrics(session, url)
        first = await chat(session, url, conversation, 2)
        assert first["usage"]["prompt_tokens"] >= 6 * 64, first["usage"]
        after_first = await settled(session, url, start)
        if small_cache.engine == "vllm":  # its engine reported the blocks the driver hashed
            assert reported(after_first, "stored") > reported(start, "stored")

        # The same conversation again: routed for its prefix, found in the cache.
        await chat(session, url, conversation, 2)
        held = await settled(session, url, after_first)
        assert delta(routed(held, "prefix"), routed(after_first, "prefix")) == {0: 1.0}
        hits = held["vllm:prefix_cache_hits_total"] - after_first["vllm:prefix_cache_hits_total"]
        assert hits >= 6 * 64, hits

        # Two prompts of 911 tokens each, one after the other: the cache holds 1,024 tokens.
        for topic in ("Lamp", "Stone"):
            flood = [{"role": "user", "content": words(topic, 110)}]
            await chat(session, url, flood, 2)
        flooded = await settled(session, url, held)
        if small_cache.engine == "vllm":
            assert reported(flooded, "evicted") > reported(held, "evicted")

        # The conversation once more: the driver knows it is gone (routed by hash, not prefix), and it is.
        await chat(session, url, conversation, 2)
        last = await settled(session, url, flooded)
    assert delta(routed(last), routed(flooded)) == {0: 1.0}
    assert delta(routed(last, "hash"), routed(flooded, "hash")) == {0: 1.0}, "still claimed as cached"
    assert last["vllm:prefix_cache_hits_total"] == flooded["vllm:prefix_cache_hits_total"]
