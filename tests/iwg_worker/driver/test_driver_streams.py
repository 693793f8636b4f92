"""Streaming generation through `iwg serve` (driver + a worker process + ZMQ + SmolLM2's real weights):
64 concurrent streams, first tokens long before the last stream ends, and streams dropped by their clients
cancelled on the worker with their KV cache freed."""

from __future__ import annotations

import asyncio
import json
import re
import time
from collections.abc import Iterator
from typing import Any

import aiohttp
import pytest

from tests.iwg_worker.driver.conftest import Served, start_smollm2, stop, subprocess_env

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

MODEL = "smollm2"


@pytest.fixture(scope="module")
def served_smollm2(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    served = start_smollm2(tmp_path_factory.mktemp("serve-lm"), {**subprocess_env(), "OMP_NUM_THREADS": "2"})
    try:
        yield served
    finally:
        code = stop(served.process)
        assert code == 0, served.log.read_text(errors="replace")[-3000:]


async def stream(
    session: aiohttp.ClientSession, url: str, prompt: str, max_tokens: int, started: float, **extra: Any
) -> dict[str, Any]:
    body = {
        "model": MODEL,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        **extra,
    }
    first = None
    text = ""
    finish = None
    async with session.post(f"{url}/v1/completions", json=body) as resp:
        assert resp.status == 200, await resp.text()
        async for raw in resp.content:
            line = raw.decode().strip()
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                break
            chunk = json.loads(line[6:])
            choice = chunk["choices"][0]
            if first is None:
                first = time.monotonic() - started
            text += choice["text"]
            finish = choice["finish_reason"] or finish
    return {"first": first, "done": time.monotonic() - started, "text": text, "finish": finish}


async def metric(session: aiohttp.ClientSession, url: str, name: str) -> float:
    async with session.get(f"{url}/metrics") as resp:
        text = await resp.text()
    values = [float(v) for v in re.findall(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", text, re.M)]
    return sum(values)


async def test_64_concurrent_streams_complete_and_first_tokens_come_before_the_longest_ends(
    served_smollm2: Served,
) -> None:
    prompts = [f"Tell me fact number {i} about {'the sea ' * (i % 8 + 1)}." for i in range(64)]
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=500)) as session:
        started = time.monotonic()
        results = await asyncio.gather(
            *(
                stream(session, served_smollm2.url, p, 48 if i == 0 else 8, started, ignore_eos=i == 0)
                for i, p in enumerate(prompts)
            )
        )
    assert all(r["finish"] in ("stop", "length") for r in results)
    assert results[0]["finish"] == "length"
    longest = max(r["done"] for r in results)
    firsts = [r["first"] for r in results]
    assert all(f is not None for f in firsts)
    # Streaming is real: every stream's first token arrived before the longest stream ended.
    assert max(firsts) < longest, (max(firsts), longest)


async def test_dropped_streams_are_cancelled_on_the_worker_and_free_their_cache(
    served_smollm2: Served,
) -> None:
    url = served_smollm2.url
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=500)) as session:
        started = time.monotonic()
        keep = [
            asyncio.create_task(
                stream(session, url, f"Write a story number {i}.", 160, started, ignore_eos=True)
            )
            for i in range(4)
        ]
        dropped: list[aiohttp.ClientResponse] = []
        for i in range(4):
            body = {"model": MODEL, "prompt": f"Write a poem number {i}.", "max_tokens": 400, "stream": True}
            resp = await session.post(f"{url}/v1/completions", json={**body, "ignore_eos": True})
            assert resp.status == 200
            await resp.content.readline()  # the first event: it is generating
            dropped.append(resp)
        deadline = time.monotonic() + 60
        while (await metric(session, url, "iwg_requests_running")) < 8 and time.monotonic() < deadline:
            await asyncio.sleep(0.5)
        busy = await metric(session, url, "iwg_kv_cache_usage")
        assert busy > 0
        # The same signals under vLLM's names, for an inference gateway's endpoint picker.
        assert await metric(session, url, "vllm:num_requests_running") == 8
        assert await metric(session, url, "vllm:kv_cache_usage_perc") == busy  # one replica: its own
        for resp in dropped:
            resp.close()  # the client goes away mid-stream
        while (await metric(session, url, "iwg_requests_running")) > 4 and time.monotonic() < deadline:
            await asyncio.sleep(0.5)
        assert await metric(session, url, "iwg_requests_running") <= 4
        assert await metric(session, url, "iwg_kv_cache_usage") < busy
        results = await asyncio.gather(*keep)
        assert [r["finish"] for r in results] == ["length"] * 4
        while (await metric(session, url, "iwg_kv_cache_usage")) > 0 and time.monotonic() < deadline:
            await asyncio.sleep(0.5)
        assert await metric(session, url, "iwg_kv_cache_usage") == 0


def test_chat_through_the_official_client_answers_paris_and_streams_the_same_text(
    served_smollm2: Served,
) -> None:
    from openai import OpenAI

    api = OpenAI(base_url=f"{served_smollm2.url}/v1", api_key="unused", max_retries=0, timeout=120)
    messages: Any = [{"role": "user", "content": "What is the capital of France?"}]
    plain = api.chat.completions.create(model=MODEL, messages=messages, max_tokens=20, temperature=0)
    answer = plain.choices[0].message.content or ""
    assert "Paris" in answer and plain.choices[0].finish_reason == "stop"
    assert plain.object == "chat.completion" and plain.choices[0].message.role == "assistant"
    chunks = list(
        api.chat.completions.create(
            model=MODEL,
            messages=messages,
            max_completion_tokens=20,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == answer
    assert (
        chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == plain.usage.completion_tokens
    )


async def test_streamed_completions_through_the_async_client_join_to_the_plain_text(
    served_smollm2: Served,
) -> None:
    from openai import AsyncOpenAI

    api = AsyncOpenAI(base_url=f"{served_smollm2.url}/v1", api_key="unused", max_retries=0, timeout=120)
    plain = await api.completions.create(
        model=MODEL, prompt="The sea is", max_tokens=12, temperature=0, stop=[","]
    )
    chunks = [
        c
        async for c in await api.completions.create(
            model=MODEL, prompt="The sea is", max_tokens=12, temperature=0, stop=[","], stream=True
        )
    ]
    assert "".join(c.choices[0].text for c in chunks) == plain.choices[0].text
    assert chunks[-1].choices[0].finish_reason == plain.choices[0].finish_reason
    assert "," not in plain.choices[0].text


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"response_format": {"type": "json_object"}}, "response_format.type"),
        ({"messages": [{"role": "tool", "content": "x"}]}, "messages[0].role"),
        ({"messages": []}, "messages"),
        ({"logprobs": True}, "logprobs"),
        ({"n": 2}, "n"),
        ({"max_completion_tokens": 0}, "max_completion_tokens"),
        ({"max_tokens": 9000}, "max_tokens"),
        ({"messages": [{"role": "user", "content": "hi " * 9000}]}, "messages"),
    ],
    ids=[
        "json response format",
        "unknown role",
        "no messages",
        "logprobs",
        "n=2",
        "zero tokens",
        "too many tokens",
        "beyond the context",
    ],
)
def test_bad_chat_requests_are_a_400_naming_the_field(
    served_smollm2: Served, body: dict[str, Any], param: str
) -> None:
    import urllib.error
    import urllib.request

    request = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], **body}
    req = urllib.request.Request(
        f"{served_smollm2.url}/v1/chat/completions",
        data=json.dumps(request).encode(),
        headers={"Content-Type": "application/json"},
    )
    with pytest.raises(urllib.error.HTTPError) as info:
        urllib.request.urlopen(req, timeout=60)
    payload = json.loads(info.value.read())
    assert info.value.code == 400 and payload["error"]["param"] == param, payload
