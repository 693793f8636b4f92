"""Streaming generation through `iwg serve` (driver + a worker process + ZMQ + SmolLM2's real weights), on each
generation engine in turn (transformers' and vLLM's: every test of the module runs on both, one group each):
greedy answers of 16 batched prompts equal the engine library's own generate, 64 concurrent streams, first
tokens long before the last stream ends, streams dropped by their clients cancelled on the worker with their
KV cache freed, the official client, hostile requests."""

from __future__ import annotations

import asyncio
import json
import random
import re
import socket
import time
from collections.abc import Iterator
from typing import Annotated, Any

import aiohttp
import pytest

from tests.iwg_worker.driver.conftest import Served, start_smollm2, stop, subprocess_env

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

MODEL = "smollm2"


@pytest.fixture(scope="module", params=["transformers", "vllm"])
def served_smollm2(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Served]:
    served = start_smollm2(
        tmp_path_factory.mktemp(f"serve-lm-{request.param}"),
        {**subprocess_env(), "OMP_NUM_THREADS": "2"},
        engine=request.param,
    )
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


async def test_greedy_answers_of_16_batched_prompts_equal_the_engine_librarys_own_generate(
    served_smollm2: Served,
) -> None:
    """The oracle: vLLM's own `LLM.generate` (in a process of its own) for the vLLM group, transformers'
    `generate` for the transformers group, on the same weights, dtype and token ids."""
    from iwg_worker.engine.front import render_chat
    from iwg_worker.models.loading import load_tokenizer, model_source

    from tests.iwg_worker.driver.oracle import library_greedy
    from tests.iwg_worker.engine.test_engine import QUESTIONS
    from tests.models import smollm2_dir

    tokenizer = load_tokenizer(model_source(smollm2_dir()))
    prompts = [render_chat(tokenizer, [{"role": "user", "content": q}]) for q in QUESTIONS]
    assert len({len(p) for p in prompts}) > 8  # prompts of different lengths
    body = {"model": MODEL, "prompt": prompts, "max_tokens": 12, "temperature": 0, "logprobs": 0}
    async with (
        aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=500)) as session,
        session.post(f"{served_smollm2.url}/v1/completions", json=body) as resp,
    ):
        assert resp.status == 200, await resp.text()
        answer = await resp.json()
    expected = library_greedy(served_smollm2.engine or "transformers", smollm2_dir(), prompts, 12)
    for choice, want in zip(answer["choices"], expected, strict=True):
        # The same text from as many tokens (each named by its text, an end-of-sequence token spelt out).
        assert choice["text"] == tokenizer.decode(want, skip_special_tokens=True), choice["index"]
        assert choice["logprobs"]["tokens"] == [tokenizer.decode([t]) for t in want], choice["index"]


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
            # Long prompts, each its own from the first token: the dropped requests hold more blocks than the
            # keepers can grow into meanwhile (4 x 5 blocks of 64 tokens; a keeper needs 3 at most).
            prompt = f"Poem {i}: " + "a river of words, " * 60 + "write it."
            body = {"model": MODEL, "prompt": prompt, "max_tokens": 400, "stream": True}
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
        # The cache gauge comes with the engine's next stats (a step later than the count on a busy machine).
        while (
            left := await metric(session, url, "iwg_kv_cache_usage")
        ) >= busy and time.monotonic() < deadline:
            await asyncio.sleep(0.5)
        assert left < busy, f"KV cache usage {busy} with 8 requests, {left} after 4 were dropped"
        results = await asyncio.gather(*keep)
        assert [r["finish"] for r in results] == ["length"] * 4
        deadline = time.monotonic() + 60  # the keepers may have taken a while on a busy machine
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
        ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
        ({"messages": [{"role": "developer", "content": "x"}]}, "messages[0].role"),
        ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tool_choice"),
        ({"messages": []}, "messages"),
        ({"top_logprobs": 2}, "top_logprobs"),
        ({"n": 17}, "n"),
        ({"max_completion_tokens": 0}, "max_completion_tokens"),
        ({"max_tokens": 9000}, "max_tokens"),
        ({"messages": [{"role": "user", "content": "hi " * 9000}]}, "messages"),
    ],
    ids=[
        "json_schema without its schema",
        "unknown role",
        "tool_choice auto",
        "no messages",
        "top_logprobs without logprobs",
        "n=17",
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


def test_chat_n_and_logprobs_through_the_official_client(served_smollm2: Served) -> None:
    from openai import OpenAI

    api = OpenAI(base_url=f"{served_smollm2.url}/v1", api_key="unused", max_retries=0, timeout=120)
    messages: Any = [{"role": "user", "content": "What is the capital of France?"}]
    options: Any = {"max_tokens": 8, "temperature": 0, "n": 2, "logprobs": True, "top_logprobs": 2}
    plain = api.chat.completions.create(model=MODEL, messages=messages, **options)
    assert [c.index for c in plain.choices] == [0, 1]
    assert plain.choices[0].message.content == plain.choices[1].message.content  # greedy: the same answer
    for choice in plain.choices:
        assert choice.logprobs is not None and choice.logprobs.content
        entries = choice.logprobs.content
        # The tokens spell the answer, and the end-of-sequence token that ended it (counted, not in the text).
        assert "".join(e.token for e in entries) == f"{choice.message.content}<|im_end|>"
        assert choice.finish_reason == "stop"
        for entry in entries:
            assert entry.bytes == list(entry.token.encode())
            assert len(entry.top_logprobs) == 2
            assert entry.top_logprobs[0].token == entry.token  # greedy: the most likely token was chosen
            assert entry.top_logprobs[0].logprob == entry.logprob <= 0.0
            assert entry.top_logprobs[1].logprob <= entry.logprob
    # The prompt is counted once for its two choices.
    single = api.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=0)
    assert plain.usage is not None and single.usage is not None
    assert plain.usage.prompt_tokens == single.usage.prompt_tokens
    assert plain.usage.completion_tokens == 2 * single.usage.completion_tokens
    streamed = list(api.chat.completions.create(model=MODEL, messages=messages, stream=True, **options))
    for choice in plain.choices:
        mine = [c.choices[0] for c in streamed if c.choices and c.choices[0].index == choice.index]
        assert "".join(c.delta.content or "" for c in mine) == choice.message.content
        tokens = [e.token for c in mine if c.logprobs and c.logprobs.content for e in c.logprobs.content]
        assert tokens == [e.token for e in choice.logprobs.content or []]


async def test_completions_n_logprobs_and_stop_through_the_async_client(served_smollm2: Served) -> None:
    from openai import AsyncOpenAI

    api = AsyncOpenAI(base_url=f"{served_smollm2.url}/v1", api_key="unused", max_retries=0, timeout=120)
    options: Any = {"max_tokens": 10, "temperature": 0, "n": 2, "logprobs": 2, "stop": ["."]}
    plain = await api.completions.create(model=MODEL, prompt="The capital of France is", **options)
    assert len(plain.choices) == 2
    for choice in plain.choices:
        assert "." not in choice.text
        logprobs = choice.logprobs
        assert logprobs is not None and logprobs.tokens and logprobs.text_offset and logprobs.top_logprobs
        # Each token's text sits in the answer at its offset.
        for token, offset in zip(logprobs.tokens, logprobs.text_offset, strict=True):
            assert choice.text[offset : offset + len(token)] == token
        assert all(len(top) >= 2 for top in logprobs.top_logprobs)
    streamed = [
        c
        async for c in await api.completions.create(
            model=MODEL, prompt="The capital of France is", stream=True, **options
        )
    ]
    for choice in plain.choices:
        mine = [c.choices[0] for c in streamed if c.choices[0].index == choice.index]
        assert "".join(c.text for c in mine) == choice.text
        assert mine[-1].finish_reason == choice.finish_reason


# (endpoint, body or raw bytes, the field the 400 names; None where the body has no field to name)
HOSTILE: list[tuple[str, Any, str | None]] = [
    ("chat", {"messages": "hi"}, "messages"),
    ("chat", {"messages": [{"role": "user"}]}, "messages[0].content"),
    ("chat", {"messages": [{"role": 5, "content": "x"}]}, "messages[0].role"),
    ("chat", {"messages": [{"role": "user", "content": 7}]}, "messages[0].content"),
    ("chat", {"messages": [{"role": "user", "content": "x" * 40_000}]}, "messages[0].content"),
    ("chat", {"messages": [{"role": "user", "content": "x"}] * 300}, "messages"),
    ("chat", {"messages": [{"role": "user", "content": "x", "extra": 1}]}, "messages[0].extra"),
    ("chat", {"max_tokens": -1}, "max_tokens"),
    ("chat", {"max_tokens": 2**40}, "max_tokens"),
    ("chat", {"max_tokens": "10"}, "max_tokens"),
    ("chat", {"n": 0}, "n"),
    ("chat", {"n": 1000}, "n"),
    ("chat", {"temperature": -1}, "temperature"),
    ("chat", {"temperature": "hot"}, "temperature"),
    (
        "chat",
        b'{"model": "smollm2", "messages": [{"role": "user", "content": "x"}], "temperature": NaN}',
        None,
    ),
    ("chat", {"top_p": 0}, "top_p"),
    ("chat", {"stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ("chat", {"stop": [""]}, "stop"),
    ("chat", {"stop": 5}, "stop"),
    ("chat", {"seed": 2**70}, "seed"),
    ("chat", {"logprobs": "yes"}, "logprobs"),
    ("chat", {"logprobs": True, "top_logprobs": 50}, "top_logprobs"),
    ("chat", {"stream": "true"}, "stream"),
    ("chat", {"stream": True, "stream_options": {"include_usage": 1}}, "stream_options.include_usage"),
    ("chat", {"stop_token_ids": [-1]}, "stop_token_ids[0]"),
    ("chat", {"tools": [{"type": "function"}]}, "tools[0].function"),
    ("chat", {"model": "gpt-4"}, "model"),
    ("chat", {"model": None}, "model"),
    ("completions", {"prompt": []}, "prompt"),
    ("completions", {"prompt": [[-5]]}, "prompt[0]"),
    ("completions", {"prompt": [[10**9]]}, "prompt[0]"),
    ("completions", {"prompt": list(range(100, 9100))}, "prompt"),
    ("completions", {"prompt": "x", "best_of": 4}, "best_of"),
    ("completions", {"prompt": "x", "echo": True, "logprobs": 1}, "echo"),
    ("completions", {"prompt": "x", "logprobs": 99}, "logprobs"),
    ("completions", {"prompt": "x", "suffix": "y"}, "suffix"),
    ("completions", {"prompt": "x", "max_tokens": 0}, "max_tokens"),
    ("completions", b"{not json", None),
    ("completions", b"[1, 2, 3]", None),
    ("completions", b"\xff\xfe\x00", None),
]


async def test_hostile_generation_requests_are_refused_alone_and_the_server_serves_on(
    served_smollm2: Served,
) -> None:
    url = served_smollm2.url
    assert len(HOSTILE) >= 30
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:
        for endpoint, body, param in HOSTILE:
            path = "/v1/chat/completions" if endpoint == "chat" else "/v1/completions"
            if isinstance(body, bytes):
                kwargs: dict[str, Any] = {"data": body, "headers": {"Content-Type": "application/json"}}
            else:
                base: dict[str, Any] = {"model": MODEL, "max_tokens": 4}
                if endpoint == "chat":
                    base["messages"] = [{"role": "user", "content": "hi"}]
                kwargs = {"json": {**base, **body}}
            async with session.post(f"{url}{path}", **kwargs) as resp:
                payload = await resp.json()
                assert 400 <= resp.status < 500, (body, resp.status, payload)
                assert payload["error"]["message"], payload
                if param is not None:
                    assert payload["error"]["param"] == param, (body, payload)

        # Slowloris: a body that never finishes and headers that never end, held open while others are served.
        host, port = url.removeprefix("http://").split(":")
        stalled = []
        for head in (
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b'Content-Length: 5000\r\n\r\n{"model": "smol',
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Le",
        ):
            sock = socket.create_connection((host, int(port)))
            sock.sendall(head)
            stalled.append(sock)
        # A stream torn down mid-way (after its first event).
        resp = await session.post(
            f"{url}/v1/completions",
            json={"model": MODEL, "prompt": "Once", "max_tokens": 200, "stream": True, "ignore_eos": True},
        )
        assert resp.status == 200
        await resp.content.readline()
        resp.close()
        answer = await stream(session, url, "The capital of France is", 6, time.monotonic())
        assert answer["finish"] in ("stop", "length") and answer["text"]
        for sock in stalled:
            sock.close()
        async with session.get(f"{url}/metrics") as metrics:
            assert 'status="5' not in await metrics.text()  # no 5xx was answered to any of it
        deadline = time.monotonic() + 60
        while (await metric(session, url, "iwg_requests_running")) > 0 and time.monotonic() < deadline:
            await asyncio.sleep(0.5)
        assert await metric(session, url, "iwg_requests_running") == 0


async def test_100_streams_dropped_at_random_points_under_load_free_their_cache(
    served_smollm2: Served,
) -> None:
    url = served_smollm2.url
    rng = random.Random(16)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=500)) as session:
        started = time.monotonic()
        keep = [
            asyncio.create_task(
                stream(session, url, f"Tell a tale number {i}.", 40, started, ignore_eos=True)
            )
            for i in range(6)
        ]
        read_before_drop: list[int] = []

        async def dropped(i: int) -> None:
            await asyncio.sleep(rng.random() * 3)
            body = {
                "model": MODEL,
                "prompt": f"Count sheep, round {i}:",
                "max_tokens": 300,
                "stream": True,
                "ignore_eos": True,
            }
            resp = await session.post(f"{url}/v1/completions", json=body)
            assert resp.status == 200, await resp.text()
            events = rng.randrange(0, 6)
            read = 0
            while read < events:
                line = await resp.content.readline()
                read += line.startswith(b"data: ")
            read_before_drop.append(read)
            resp.close()  # the client goes away at this point of its stream

        await asyncio.gather(*(dropped(i) for i in range(100)))
        assert len(read_before_drop) == 100 and len(set(read_before_drop)) > 3
        results = await asyncio.gather(*keep)
        assert [r["finish"] for r in results] == ["length"] * 6  # the others complete
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and (
            await metric(session, url, "iwg_requests_running") > 0
            or await metric(session, url, "iwg_kv_cache_usage") > 0
        ):
            await asyncio.sleep(0.5)
        assert await metric(session, url, "iwg_requests_running") == 0
        assert await metric(session, url, "iwg_requests_waiting") == 0
        assert await metric(session, url, "iwg_kv_cache_usage") == 0  # every dropped request's blocks freed


# -- structured outputs and tool calls (issue 27) ----------------------------------------------------------


def generated_schemas(count: int) -> list[tuple[str, dict[str, Any]]]:
    """``count`` JSON schemas of varied shapes (objects, arrays, enums, nesting, required fields, bounded
    numbers, patterned strings), each with a prompt asking for it; drawn from a fixed seed."""
    rng = random.Random(27)
    things = ["a book", "a city", "a planet", "a recipe", "a car", "a song", "a river", "a painter"]

    def field_schema(depth: int) -> dict[str, Any]:
        kind = rng.choice(
            ["int", "number", "enum", "pattern", "bool", "array", "object" if depth < 2 else "int"]
        )
        if kind == "int":
            low = rng.randint(0, 50)
            return {"type": "integer", "minimum": low, "maximum": low + rng.randint(1, 1000)}
        if kind == "number":
            return {"type": "number", "minimum": -10.0, "maximum": 10.0}
        if kind == "enum":
            return {"enum": rng.sample(["red", "green", "blue", "small", "large", "yes", "no", "north"], 3)}
        if kind == "pattern":
            return {"type": "string", "pattern": rng.choice(["^[A-Z][a-z]{2,8}$", "^[0-9]{3}-[0-9]{4}$"])}
        if kind == "bool":
            return {"type": "boolean"}
        if kind == "array":
            return {
                "type": "array",
                "items": {"type": "integer", "minimum": 0, "maximum": 99},
                "minItems": 1,
                "maxItems": 3,
            }
        return obj(depth + 1, rng.randint(1, 2))

    def obj(depth: int, size: int) -> dict[str, Any]:
        names = rng.sample(["name", "id", "size", "color", "tags", "score", "code", "owner", "open"], size)
        properties = {n: field_schema(depth) for n in names}
        return {
            "type": "object",
            "properties": properties,
            "required": rng.sample(names, rng.randint(1, size)),
        }

    out = []
    for i in range(count):
        thing = things[i % len(things)]
        schema = obj(0, rng.randint(1, 3)) if i % 4 else {"type": "array", "items": obj(1, 2), "maxItems": 2}
        out.append((f"Describe {thing} as JSON.", schema))
    return out


def valid(text: str, schema: dict[str, Any]) -> bool:
    import jsonschema

    try:
        jsonschema.validate(json.loads(text), schema)
    except (ValueError, jsonschema.ValidationError):
        return False
    return True


async def chat_text(session: aiohttp.ClientSession, url: str, question: str, **extra: Any) -> str:
    body = {"model": MODEL, "messages": [{"role": "user", "content": question}], "temperature": 0, **extra}
    async with session.post(f"{url}/v1/chat/completions", json=body) as resp:
        assert resp.status == 200, await resp.text()
        return str((await resp.json())["choices"][0]["message"]["content"])


async def test_32_generated_schemas_validate_constrained_and_unconstrained_neighbours_keep_their_tokens(
    served_smollm2: Served,
) -> None:
    """32 schemas sent at once with response_format json_schema: every output validates (jsonschema); the same
    prompts unconstrained mostly do not. 8 unconstrained requests batched with the 32 constrained ones answer
    exactly what they answered alone (greedy)."""
    url = served_smollm2.url
    cases = generated_schemas(32)
    fmt = [
        {"type": "json_schema", "json_schema": {"name": f"s{i}", "schema": s}}
        for i, (_, s) in enumerate(cases)
    ]
    async with aiohttp.ClientSession() as session:
        alone = await asyncio.gather(*(chat_text(session, url, q, max_tokens=64) for q, _ in cases))
        both = await asyncio.gather(
            *(
                chat_text(session, url, q, max_tokens=64, response_format=f)
                for (q, _), f in zip(cases, fmt, strict=True)
            ),
            *(chat_text(session, url, q, max_tokens=64) for q, _ in cases[:8]),
        )
    constrained, neighbours = both[:32], both[32:]
    valid_constrained = sum(valid(t, s) for t, (_, s) in zip(constrained, cases, strict=True))
    valid_plain = sum(valid(t, s) for t, (_, s) in zip(alone, cases, strict=True))
    print(
        f"{served_smollm2.engine}: valid constrained {valid_constrained}/32, unconstrained {valid_plain}/32"
    )
    assert valid_constrained == 32, [
        t for t, (_, s) in zip(constrained, cases, strict=True) if not valid(t, s)
    ]
    assert valid_plain < 16
    assert neighbours == alone[:8]


def test_parse_with_a_pydantic_model_and_forced_tool_calls_through_the_official_client(
    served_smollm2: Served,
) -> None:
    import jsonschema
    from openai import OpenAI
    from pydantic import BaseModel, Field

    class City(BaseModel):
        name: Annotated[str, Field(max_length=16)]
        country: Annotated[str, Field(max_length=16)]
        population: Annotated[int, Field(ge=0, le=100_000_000)]

    api = OpenAI(base_url=f"{served_smollm2.url}/v1", api_key="unused", max_retries=0, timeout=120)
    messages: Any = [{"role": "user", "content": "Describe Paris."}]
    parsed = api.chat.completions.parse(
        model=MODEL, messages=messages, response_format=City, max_tokens=64, temperature=0
    )
    city = parsed.choices[0].message.parsed
    assert isinstance(city, City), parsed.choices[0].message.content
    # Completions take a response_format too.
    done = api.completions.create(
        model=MODEL,
        prompt="A JSON object with a number a:",
        max_tokens=16,
        temperature=0,
        extra_body={
            "response_format": {
                "type": "json_schema",
                "json_schema": {
                    "name": "a",
                    "schema": {
                        "type": "object",
                        "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9}},
                        "required": ["a"],
                    },
                },
            }
        },
    )
    assert json.loads(done.choices[0].text)["a"] in range(10), done.choices[0].text

    weather = {
        "type": "object",
        "properties": {
            "city": {"type": "string", "maxLength": 20},
            "unit": {"enum": ["celsius", "fahrenheit"]},
        },
        "required": ["city", "unit"],
    }
    tools: Any = [
        {
            "type": "function",
            "function": {"name": "get_weather", "description": "Weather now", "parameters": weather},
        },
        {
            "type": "function",
            "function": {
                "name": "get_time",
                "parameters": {
                    "type": "object",
                    "properties": {"zone": {"type": "string", "pattern": "^[A-Z]{3}$"}},
                    "required": ["zone"],
                },
            },
        },
    ]
    ask: Any = [{"role": "user", "content": "What is the weather in Paris?"}]
    schemas = {"get_weather": weather, "get_time": tools[1]["function"]["parameters"]}
    for choice in ({"type": "function", "function": {"name": "get_weather"}}, "required"):
        options: Any = {"tools": tools, "tool_choice": choice, "max_tokens": 48, "temperature": 0}
        plain = api.chat.completions.create(model=MODEL, messages=ask, **options)
        answer = plain.choices[0]
        assert answer.finish_reason == "tool_calls" and answer.message.tool_calls, answer
        calls = answer.message.tool_calls
        for call in calls:
            assert call.id.startswith("call_") and call.type == "function"
            jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])
        if isinstance(choice, dict):
            assert [c.function.name for c in calls] == ["get_weather"]
        chunks = list(api.chat.completions.create(model=MODEL, messages=ask, stream=True, **options))
        streamed: dict[int, dict[str, str]] = {}
        for chunk in chunks:
            for delta in chunk.choices[0].delta.tool_calls or []:
                entry = streamed.setdefault(delta.index, {"id": "", "name": "", "arguments": ""})
                entry["id"] += delta.id or ""
                entry["name"] += (delta.function.name or "") if delta.function else ""
                entry["arguments"] += (delta.function.arguments or "") if delta.function else ""
        assert chunks[-1].choices[0].finish_reason == "tool_calls"
        assert [(e["name"], e["arguments"]) for e in streamed.values()] == [
            (c.function.name, c.function.arguments) for c in calls
        ]
        assert all(e["id"].startswith("call_") for e in streamed.values())
    # n > 1: every choice is a forced call of its own (ids distinct), sampled, plain and streamed alike. One
    # call each (parallel_tool_calls false): sampled, the model would add calls until max_tokens ("length").
    sampled: Any = {
        "tools": tools,
        "tool_choice": "required",
        "parallel_tool_calls": False,
        "max_tokens": 64,
        "temperature": 1.0,
        "seed": 7,
    }
    several = api.chat.completions.create(model=MODEL, messages=ask, n=2, **sampled)
    assert [c.index for c in several.choices] == [0, 1]
    ids = set()
    for answer in several.choices:
        assert answer.finish_reason == "tool_calls" and answer.message.tool_calls, answer
        for made in answer.message.tool_calls:
            ids.add(made.id)
            jsonschema.validate(json.loads(made.function.arguments), schemas[made.function.name])
    assert len(ids) == sum(len(c.message.tool_calls or []) for c in several.choices)
    per_choice: dict[int, dict[int, str]] = {0: {}, 1: {}}
    finished = {}
    for chunk in api.chat.completions.create(model=MODEL, messages=ask, n=2, stream=True, **sampled):
        for part in chunk.choices:
            for delta in part.delta.tool_calls or []:
                args = (delta.function.arguments or "") if delta.function else ""
                per_choice[part.index][delta.index] = per_choice[part.index].get(delta.index, "") + args
            if part.finish_reason:
                finished[part.index] = part.finish_reason
    assert finished == {0: "tool_calls", 1: "tool_calls"}
    for index, answer in enumerate(several.choices):  # the same seed: the same calls, streamed
        assert list(per_choice[index].values()) == [
            c.function.arguments for c in answer.message.tool_calls or []
        ]
    # The call and its result go back through the chat template: the conversation continues.
    call = calls[0]
    follow = [
        *ask,
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 21}'},
    ]
    after = api.chat.completions.create(model=MODEL, messages=follow, max_tokens=16, temperature=0)
    assert after.choices[0].message.content


HOSTILE_SCHEMAS: list[tuple[str, Any, str | None]] = [
    # (what, schema, the param of a 400; None: may be served)
    ("nested 200 deep", {"type": "object", "properties": {"a": {}}}, None),
    ("invalid type", {"type": "bogus"}, "response_format.json_schema.schema"),
    ("minimum not a number", {"type": "integer", "minimum": "zero"}, "response_format.json_schema.schema"),
    ("missing $ref", {"$ref": "#/$defs/nothing"}, "response_format.json_schema.schema"),
    (
        "recursive $ref",
        {
            "$defs": {
                "node": {
                    "type": "object",
                    "properties": {"children": {"type": "array", "items": {"$ref": "#/$defs/node"}}},
                    "required": ["children"],
                }
            },
            "$ref": "#/$defs/node",
        },
        None,
    ),
    ("huge enum", {"enum": [f"value-{i}" for i in range(3000)]}, None),
    (
        "enum beyond the size bound",
        {"enum": [f"value-number-{i}" for i in range(5000)]},
        "response_format.json_schema.schema",
    ),
    (
        "500 anyOf branches",
        {
            "anyOf": [
                {"type": "object", "properties": {f"k{i}": {"type": "integer"}}, "required": [f"k{i}"]}
                for i in range(500)
            ]
        },
        None,
    ),
    ("bad regex", {"type": "string", "pattern": "(unclosed"}, "response_format.json_schema.schema"),
    ("not an object", [1, 2], "response_format.json_schema.schema"),
]


def _nest(depth: int) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "integer"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
    return schema


HOSTILE_SCHEMAS[0] = ("nested 33 deep", _nest(33), "response_format.json_schema.schema")
HOSTILE_SCHEMAS.append(("nested 200 deep", _nest(200), "body"))  # past the body's own bound: no field named


async def test_hostile_schemas_are_refused_naming_the_field_or_compile_in_bounded_time_while_a_stream_flows(
    served_smollm2: Served,
) -> None:
    url = served_smollm2.url
    async with aiohttp.ClientSession() as session:
        started = time.monotonic()
        flowing = asyncio.create_task(stream(session, url, "Once upon a time", 48, started, ignore_eos=True))

        async def send(schema: Any) -> tuple[int, dict[str, Any], float]:
            t0 = time.monotonic()
            body = {
                "model": MODEL,
                "messages": [{"role": "user", "content": "Answer in JSON."}],
                "max_tokens": 8,
                "response_format": {"type": "json_schema", "json_schema": {"name": "h", "schema": schema}},
            }
            async with session.post(f"{url}/v1/chat/completions", json=body) as resp:
                return resp.status, await resp.json(), time.monotonic() - t0

        results = await asyncio.gather(*(send(s) for _, s, _ in HOSTILE_SCHEMAS))
        other = await flowing
    for (what, _, param), (status, body, seconds) in zip(HOSTILE_SCHEMAS, results, strict=True):
        print(
            f"{served_smollm2.engine}: {what}: {status} in {seconds:.2f} s {body.get('error', {}).get('message', '')[:80]}"
        )
        assert status in (200, 400), (what, status, body)
        assert seconds < 60, (what, seconds)
        if param == "body":
            assert status == 400 and "nests" in body["error"]["message"], (what, body)
        elif param is not None:
            assert status == 400 and body["error"]["param"] == param, (what, body)
        elif status == 400:
            assert body["error"]["param"] == "response_format.json_schema.schema", (what, body)
    assert other["finish"] == "length" and other["text"]
