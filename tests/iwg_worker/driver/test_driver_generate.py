"""/v1/completions end to end through the driver onto a real generate worker (UniProcExecutor in this
process, a small randomly initialised GPT-2 with a word-level tokenizer), checked against greedy decoding
with transformers directly."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import torch
from aiohttp.test_utils import TestClient, TestServer
from iwg_worker.driver.app import build_app
from iwg_worker.driver.executor_pool import ExecutorPool
from iwg_worker.driver.service import Driver, DriverConfig
from iwg_worker.executor.uniproc import UniProcExecutor
from iwg_worker.worker_base import WorkerConfig

pytestmark = pytest.mark.timeout(300)

WORDS = ["<unk>", *(f"w{i}" for i in range(95)), "<eos>"]  # 97 tokens, <eos> last


@pytest.fixture(scope="module")
def tiny_lm(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import GPT2Config, GPT2LMHeadModel, PreTrainedTokenizerFast

    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("tiny-lm")
    config = GPT2Config(
        vocab_size=len(WORDS), n_positions=64, n_embd=32, n_layer=2, n_head=2, eos_token_id=96
    )
    GPT2LMHeadModel(config).save_pretrained(path)
    vocab = {w: i for i, w in enumerate(WORDS)}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="<unk>", eos_token="<eos>")
    fast.save_pretrained(path)
    return path


def greedy(path: Path, prompt_ids: list[int], max_tokens: int) -> list[int]:
    from transformers import GPT2LMHeadModel

    model = GPT2LMHeadModel.from_pretrained(path).eval()
    ids = list(prompt_ids)
    out: list[int] = []
    with torch.no_grad():
        for _ in range(max_tokens):
            token = int(model(torch.tensor([ids])).logits[0, -1].argmax())
            out.append(token)
            if token == 96:
                break
            ids.append(token)
    return out


@pytest.fixture
async def client(tiny_lm: Path) -> AsyncIterator[TestClient[Any, Any]]:
    executor = UniProcExecutor(
        WorkerConfig(task="generate", model_path=str(tiny_lm), device="cpu", engine="transformers")
    )
    driver = Driver(DriverConfig(served_name="tiny", task="generate", max_wait_ms=20), ExecutorPool(executor))
    driver.start()
    async with TestClient(TestServer(build_app(driver))) as test_client:
        yield test_client
    await driver.stop()
    await driver.pool.close()


async def test_completions_match_greedy_decoding(client: TestClient[Any, Any], tiny_lm: Path) -> None:
    prompts = ["w1 w2 w3", "w40 w7"]
    resp = await client.post(
        "/v1/completions", json={"model": "tiny", "prompt": prompts, "max_tokens": 6, "temperature": 0}
    )
    body = await resp.json()
    assert resp.status == 200, body
    for choice, prompt in zip(body["choices"], prompts, strict=True):
        ids = [WORDS.index(w) for w in prompt.split()]
        expected = greedy(tiny_lm, ids, 6)
        words = [WORDS[t] for t in expected if t != 96]
        assert choice["text"].split() == words
        assert choice["finish_reason"] == ("stop" if len(expected) < 6 else "length")
    assert body["usage"]["prompt_tokens"] == 5
    assert body["usage"]["completion_tokens"] == sum(
        len(greedy(tiny_lm, [WORDS.index(w) for w in p.split()], 6)) for p in prompts
    )


async def test_token_id_prompts_and_seeded_sampling(client: TestClient[Any, Any]) -> None:
    async def complete(**body: Any) -> dict[str, Any]:
        resp = await client.post("/v1/completions", json={"model": "tiny", "max_tokens": 8, **body})
        payload: dict[str, Any] = await resp.json()
        assert resp.status == 200, payload
        return payload

    by_ids = await complete(prompt=[[WORDS.index(w) for w in ("w1", "w2", "w3")]], temperature=0)
    by_text = await complete(prompt="w1 w2 w3", temperature=0)
    assert by_ids["choices"][0]["text"] == by_text["choices"][0]["text"]
    first = await complete(prompt="w5 w6", temperature=1.5, seed=11)
    again = await complete(prompt="w5 w6", temperature=1.5, seed=11)
    assert first["choices"][0]["text"] == again["choices"][0]["text"]


async def test_bad_completion_requests(client: TestClient[Any, Any]) -> None:
    cases: list[tuple[dict[str, Any], str]] = [
        ({"prompt": "w1", "max_tokens": 0}, "max_tokens"),
        ({"prompt": "w1", "max_tokens": 100_000}, "max_tokens"),
        ({"prompt": "w1", "temperature": 3}, "temperature"),
        ({"prompt": "w1", "n": 0}, "n"),
        ({"prompt": "w1", "n": 17}, "n"),
        ({"prompt": ["w1"] * 100, "n": 16}, "n"),  # 1600 generations, above the server's 1024 at once
        ({"prompt": ["w1", [1, 2]]}, "prompt"),
        ({"prompt": "w1", "stop": [""]}, "stop"),
        ({"prompt": "w1", "logprobs": 21}, "logprobs"),
        ({"prompt": "w1", "logprobs": -1}, "logprobs"),
        ({"prompt": "w1", "logprobs": True}, "logprobs"),
        ({"prompt": "w1", "best_of": 3}, "best_of"),
        ({"prompt": "w1", "echo": True, "logprobs": 1}, "echo"),
        ({"prompt": "w1", "echo": "yes"}, "echo"),
    ]
    for body, param in cases:
        resp = await client.post("/v1/completions", json={"model": "tiny", **body})
        payload = await resp.json()
        assert resp.status == 400, (body, payload)
        assert payload["error"]["param"] == param, (body, payload)


async def test_a_streamed_completion_is_server_sent_events_that_join_to_the_same_answer(
    client: TestClient[Any, Any],
) -> None:
    body = {"model": "tiny", "prompt": ["w1 w2 w3", "w9"], "max_tokens": 6, "temperature": 0}
    plain = await (await client.post("/v1/completions", json=body)).json()
    resp = await client.post(
        "/v1/completions", json={**body, "stream": True, "stream_options": {"include_usage": True}}
    )
    assert resp.status == 200 and resp.headers["Content-Type"].startswith("text/event-stream")
    raw = await resp.text()
    events = [e.removeprefix("data: ") for e in raw.split("\n\n") if e]
    assert all(e.startswith("data: ") for e in raw.split("\n\n") if e)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert len(chunks) > 3  # token by token, not one body
    for index, choice in enumerate(plain["choices"]):
        mine = [c["choices"][0] for c in chunks if c["choices"] and c["choices"][0]["index"] == index]
        assert "".join(c["text"] for c in mine) == choice["text"]
        assert [c["finish_reason"] for c in mine][-1] == choice["finish_reason"]
        assert all(c["finish_reason"] is None for c in mine[:-1])
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == plain["usage"]
    assert {c["id"] for c in chunks} == {chunks[0]["id"]} and chunks[0]["object"] == "text_completion"


async def test_a_streamed_request_refused_by_the_engine_is_an_ordinary_400(
    client: TestClient[Any, Any],
) -> None:
    # 60 tokens of prompt leave room for 4 new ones in this model's 64 positions.
    body = {"model": "tiny", "prompt": " ".join(["w1"] * 60), "max_tokens": 10, "stream": True}
    resp = await client.post("/v1/completions", json=body)
    payload = await resp.json()
    assert resp.status == 400 and payload["error"]["param"] == "max_tokens", payload
    assert "64" in payload["error"]["message"]


async def test_chat_on_a_model_without_a_chat_template_is_a_400(client: TestClient[Any, Any]) -> None:
    body = {"model": "tiny", "messages": [{"role": "user", "content": "w1"}]}
    resp = await client.post("/v1/chat/completions", json=body)
    payload = await resp.json()
    assert resp.status == 400 and payload["error"]["param"] == "messages", payload
    assert "chat template" in payload["error"]["message"]


def logprobs_of(path: Path, prompt_ids: list[int], tokens: list[int]) -> list[torch.Tensor]:
    """The model's log-softmax before each of ``tokens``, as transformers computes it."""
    from transformers import GPT2LMHeadModel

    model = GPT2LMHeadModel.from_pretrained(path).eval()
    ids = list(prompt_ids)
    out = []
    with torch.no_grad():
        for token in tokens:
            out.append(torch.log_softmax(model(torch.tensor([ids])).logits[0, -1].float(), dim=-1))
            ids.append(token)
    return out


async def test_n_choices_per_prompt_with_their_logprobs(client: TestClient[Any, Any], tiny_lm: Path) -> None:
    prompts = ["w1 w2 w3", "w9"]
    body = {"model": "tiny", "prompt": prompts, "max_tokens": 5, "temperature": 0, "n": 2, "logprobs": 2}
    resp = await client.post("/v1/completions", json=body)
    payload = await resp.json()
    assert resp.status == 200, payload
    choices = payload["choices"]
    assert [c["index"] for c in choices] == [0, 1, 2, 3]  # choice i * n + j: sample j of prompt i
    for i, prompt in enumerate(prompts):
        ids = [WORDS.index(w) for w in prompt.split()]
        expected = greedy(tiny_lm, ids, 5)
        reference = logprobs_of(tiny_lm, ids, expected)
        for choice in choices[2 * i : 2 * i + 2]:
            logprobs = choice["logprobs"]
            assert logprobs["tokens"] == [WORDS[t] for t in expected]
            for k, token in enumerate(expected):
                assert logprobs["token_logprobs"][k] == pytest.approx(float(reference[k][token]), abs=1e-4)
                top = logprobs["top_logprobs"][k]
                assert set(top) == {WORDS[t] for t in torch.topk(reference[k], 2).indices.tolist()}
                assert top[WORDS[token]] == logprobs["token_logprobs"][k]  # greedy: the best one was chosen
            assert len(logprobs["text_offset"]) == len(expected)
    # A prompt's tokens are counted once, however many choices it has; every choice's tokens are counted.
    assert payload["usage"]["prompt_tokens"] == 4
    assert payload["usage"]["completion_tokens"] == sum(len(c["logprobs"]["tokens"]) for c in choices)


async def test_seeded_samples_of_one_request_differ_and_repeat(client: TestClient[Any, Any]) -> None:
    body = {"model": "tiny", "prompt": "w5 w6", "max_tokens": 8, "temperature": 1.5, "n": 3, "seed": 7}
    first = await (await client.post("/v1/completions", json=body)).json()
    again = await (await client.post("/v1/completions", json=body)).json()
    texts = [c["text"] for c in first["choices"]]
    assert len(set(texts)) == 3, texts  # three samples, not one repeated
    assert [c["text"] for c in again["choices"]] == texts
    # Sample 0 of n is the same request as n=1 with that seed.
    single = await (await client.post("/v1/completions", json={**body, "n": 1})).json()
    assert single["choices"][0]["text"] == texts[0]


async def test_echo_puts_the_prompt_first_plain_and_streamed(client: TestClient[Any, Any]) -> None:
    base = {"model": "tiny", "max_tokens": 4, "temperature": 0, "echo": True}
    plain = await (await client.post("/v1/completions", json={**base, "prompt": "w1 w2"})).json()
    bare = await (
        await client.post("/v1/completions", json={**base, "prompt": "w1 w2", "echo": False})
    ).json()
    assert plain["choices"][0]["text"] == "w1 w2" + bare["choices"][0]["text"]
    ids = [WORDS.index(w) for w in ("w1", "w2")]
    by_ids = await (await client.post("/v1/completions", json={**base, "prompt": ids})).json()
    assert by_ids["choices"][0]["text"].startswith("w1 w2")  # token ids: the worker decodes them
    assert by_ids["choices"][0]["text"].removeprefix("w1 w2") == bare["choices"][0]["text"]
    resp = await client.post("/v1/completions", json={**base, "prompt": "w1 w2", "stream": True})
    events = [e.removeprefix("data: ") for e in (await resp.text()).split("\n\n") if e]
    chunks = [json.loads(e) for e in events[:-1]]
    assert chunks[0]["choices"][0]["text"].startswith("w1 w2")
    assert "".join(c["choices"][0]["text"] for c in chunks) == plain["choices"][0]["text"]


async def test_streamed_n_choices_and_logprobs_join_to_the_plain_answer(client: TestClient[Any, Any]) -> None:
    body = {"model": "tiny", "prompt": "w3 w4", "max_tokens": 5, "temperature": 0, "n": 2, "logprobs": 1}
    plain = await (await client.post("/v1/completions", json=body)).json()
    resp = await client.post("/v1/completions", json={**body, "stream": True})
    events = [e.removeprefix("data: ") for e in (await resp.text()).split("\n\n") if e]
    chunks = [json.loads(e)["choices"][0] for e in events[:-1]]
    for choice in plain["choices"]:
        mine = [c for c in chunks if c["index"] == choice["index"]]
        assert "".join(c["text"] for c in mine) == choice["text"]
        joined = [t for c in mine for t in c["logprobs"]["tokens"]]
        assert joined == choice["logprobs"]["tokens"]
        # The same tokens; their logprobs to float32 rounding (the two runs' steps may batch the choices
        # differently, and a CPU matmul's sums then round differently: 4.8e-7 apart seen once).
        streamed_logprobs = [v for c in mine for v in c["logprobs"]["token_logprobs"]]
        assert streamed_logprobs == pytest.approx(choice["logprobs"]["token_logprobs"], rel=1e-5, abs=1e-6)
        assert mine[-1]["finish_reason"] == choice["finish_reason"]


def dechunk(raw: bytes) -> bytes:
    """The body of an HTTP/1.1 response sent with chunked transfer encoding."""
    head, _, rest = raw.partition(b"\r\n\r\n")
    assert b"chunked" in head.lower(), head
    body = b""
    while rest:
        size_line, _, rest = rest.partition(b"\r\n")
        size = int(size_line.split(b";")[0], 16)
        if size == 0:
            break
        body, rest = body + rest[:size], rest[size + 2 :]
    return body


async def test_a_reader_that_stops_reading_holds_only_its_own_response(tiny_lm: Path) -> None:
    """Back-pressure: a client that stops reading fills the TCP buffers (made small on both ends here, so that
    one request's output overflows them); its handler waits on its own writes while the engine finishes its
    requests (their KV cache freed, the rest of the output waiting in the driver) and other streams are served
    to the end; once the client reads again it gets every token."""
    import asyncio
    import socket

    from aiohttp import ClientSession, web

    executor = UniProcExecutor(
        WorkerConfig(task="generate", model_path=str(tiny_lm), device="cpu", engine="transformers")
    )
    driver = Driver(DriverConfig(served_name="tiny", task="generate", max_wait_ms=5), ExecutorPool(executor))
    driver.start()
    listener = socket.socket()
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)  # accepted sockets inherit it
    listener.bind(("127.0.0.1", 0))
    runner = web.AppRunner(build_app(driver))
    await runner.setup()
    await web.SockSite(runner, listener).start()
    port = listener.getsockname()[1]
    body = {"model": "tiny", "prompt": "w1 w2", "max_tokens": 60, "ignore_eos": True, "temperature": 0}
    slow = socket.socket()

    def peek() -> bytes:
        try:
            return slow.recv(1 << 20, socket.MSG_PEEK | socket.MSG_DONTWAIT)
        except BlockingIOError:
            return b""

    try:
        slow.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        slow.connect(("127.0.0.1", port))
        # 16 choices x 60 tokens with 5 top logprobs each: about 300 KB of events, far beyond the buffers.
        payload = json.dumps({**body, "n": 16, "logprobs": 5, "stream": True}).encode()
        slow.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Connection: close\r\nContent-Length: %d\r\n\r\n%s" % (len(payload), payload)
        )
        for _ in range(600):
            if b"data: " in peek() and driver.generations.active == 0:
                break
            await asyncio.sleep(0.05)
        # The engine is done with the slow request (nothing of it runs or holds cache) ...
        assert driver.generations.active == 0
        stats = await driver.pool.engine_stats(0, 10)
        assert stats["streams"] == 0 and stats["kv_cache_blocks_used"] == 0, stats
        async with ClientSession(f"http://127.0.0.1:{port}") as session:

            async def full(index: int) -> str:
                async with session.post(
                    "/v1/completions", json={**body, "prompt": f"w{index} w2", "stream": True}
                ) as resp:
                    assert resp.status == 200
                    text = await resp.text()
                    assert text.endswith("data: [DONE]\n\n")
                    return text

            # ... other clients' streams are served to the end meanwhile ...
            others = await asyncio.wait_for(asyncio.gather(*(full(i) for i in range(3, 11))), 60)
            assert len(others) == 8
            plain = await (await session.post("/v1/completions", json={**body, "logprobs": 5})).json()
        # ... while the slow response is still held back by the client's full buffers.
        assert b"[DONE]" not in peek(), "the whole response fit in the buffers: back-pressure was not reached"
        # The reader comes back: every token of every choice arrives, none lost.
        slow.setblocking(False)
        loop = asyncio.get_running_loop()
        raw = b""
        while chunk := await asyncio.wait_for(loop.sock_recv(slow, 65536), 60):
            raw += chunk
        events = [e.removeprefix("data: ") for e in dechunk(raw).decode().split("\n\n") if e]
        assert events[-1] == "[DONE]"
        print(f"slow reader: {len(raw)} bytes held back and then read")
        texts = [""] * 16
        for event in events[:-1]:
            for choice in json.loads(event)["choices"]:
                texts[choice["index"]] += choice["text"]
        assert texts == [plain["choices"][0]["text"]] * 16
        assert len(plain["choices"][0]["text"].split()) == 60
    finally:
        slow.close()
        await runner.cleanup()
        await driver.stop()
        await driver.pool.close()
