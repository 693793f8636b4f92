"""Requests must not hurt other requests. A real driver (aiohttp over loopback) in front of a real MiniLM worker
process (MultiprocExecutor, ZMQ) is sent generated bodies next to well-formed ones that share their batches:
every well-formed request succeeds, every generated one gets a 2xx or a 4xx, never a 5xx, and the server logs
no client mistake above INFO."""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import pytest
from aiohttp import web
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from iwg_worker.driver.app import MAX_JSON_DEPTH, build_app
from iwg_worker.driver.executor_pool import ExecutorPool
from iwg_worker.driver.pool import Batch, EmbedResult, InputRejected
from iwg_worker.driver.service import Driver, DriverConfig
from iwg_worker.executor.multiproc import MultiprocExecutor
from iwg_worker.worker_base import WorkerConfig

from tests.iwg_worker.driver.conftest import STARTUP_TIMEOUT_S, free_port, minilm_path

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

MODEL = "minilm"
GOOD = {"model": MODEL, "input": ["a well-formed request", "that shares a batch"]}


class Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@dataclass
class Server:
    url: str
    loop: asyncio.AbstractEventLoop
    pool: ExecutorPool
    log: Records

    def run(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout=120)


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    """The driver's app on a loop in a thread; batches wait 30 ms so concurrent requests share them."""
    executor = MultiprocExecutor(
        WorkerConfig(task="embed", model_path=minilm_path(), served_name=MODEL, device="cpu"),
        startup_timeout_s=STARTUP_TIMEOUT_S,
        extra_env={"OMP_NUM_THREADS": "1"},
    )
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    port = free_port()
    records = Records()
    logging.getLogger().addHandler(records)
    # What the server logs at INFO and above is what a deployment shows; the test reads all of it.
    levels = {name: logging.getLogger(name).level for name in ("aiohttp", "iwg_worker")}
    for name in levels:
        logging.getLogger(name).setLevel(logging.INFO)

    async def start() -> tuple[Driver, ExecutorPool, web.AppRunner]:
        pool = ExecutorPool(executor)
        driver = Driver(DriverConfig(MODEL, "embed", max_batch_size=8, max_wait_ms=30), pool)
        driver.start()
        runner = web.AppRunner(build_app(driver), access_log=None)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        return driver, pool, runner

    driver, pool, runner = asyncio.run_coroutine_threadsafe(start(), loop).result(timeout=60)
    try:
        yield Server(f"http://127.0.0.1:{port}", loop, pool, records)
    finally:
        logging.getLogger().removeHandler(records)
        for name, level in levels.items():
            logging.getLogger(name).setLevel(level)

        async def close() -> None:
            await runner.cleanup()
            await driver.stop()
            await driver.pool.close()

        asyncio.run_coroutine_threadsafe(close(), loop).result(timeout=60)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=10)


# -- generated bodies ----------------------------------------------------------------------------------------

# Text as JSON can spell it: any code point, lone surrogates included (json.dumps writes them as \ud800).
text = st.text(st.characters(codec=None, exclude_categories=()), max_size=40) | st.sampled_from(
    ["", " ", "\x00", "\ud800", "a\udfff", "x" * 40_000, "\u200b", "[" * 100, "\\"]
)
numbers = st.integers(min_value=-(2**70), max_value=2**70) | st.sampled_from(
    [0, -1, 2**31, 2**63, 2**64, -(2**63) - 1, 10**400]
)
json_values = st.recursive(
    st.none() | st.booleans() | numbers | st.floats(allow_nan=False) | text,
    lambda children: st.lists(children, max_size=5) | st.dictionaries(text, children, max_size=4),
    max_leaves=12,
)
token_ids = st.lists(numbers, max_size=6)
fields = {
    "model": st.just(MODEL) | json_values,
    "input": text | st.lists(text, max_size=6) | token_ids | st.lists(token_ids, max_size=3) | json_values,
    "encoding_format": st.sampled_from(["float", "base64"]) | json_values,
    "dimensions": st.sampled_from([384, 1, 0]) | numbers | json_values,
    "user": text | json_values,
    "prompt": text | token_ids,
    "max_tokens": numbers,
    "seed": numbers,
    "stop": text | st.lists(text, max_size=6),
    "temperature": st.floats() | numbers,
}
# Mostly bodies close to a real request (so they get past the schema into the batcher), some anything at all.
near_valid = st.fixed_dictionaries(
    {"model": fields["model"], "input": fields["input"]},
    optional={k: v for k, v in fields.items() if k not in ("model", "input")},
)


def encode(body: Any) -> bytes:
    return json.dumps(body).encode()


raw_bodies = (
    near_valid.map(encode)
    | json_values.map(encode)
    | st.binary(max_size=64)
    | st.integers(MAX_JSON_DEPTH - 2, 100_000).map(lambda n: b'{"input": ' + b"[" * n + b"]" * n + b"}")
    | st.integers(MAX_JSON_DEPTH - 2, 100_000).map(lambda n: b"[" * n)  # unclosed
)
paths = st.sampled_from(["/v1/embeddings"] * 4 + ["/v1/completions"])


@dataclass
class Response:
    status_code: int
    text: str

    def json(self) -> Any:
        return json.loads(self.text)


def _post(url: str, body: bytes) -> Response:
    request = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=120) as reply:
            return Response(reply.status, reply.read().decode())
    except urllib.error.HTTPError as exc:
        return Response(exc.code, exc.read().decode())


def _check_good(response: Response) -> None:
    assert response.status_code == 200, response.text
    data = response.json()["data"]
    assert [len(d["embedding"]) for d in data] == [384, 384]


@settings(
    max_examples=60,
    deadline=timedelta(seconds=30),
    suppress_health_check=[
        HealthCheck.function_scoped_fixture,
        HealthCheck.too_slow,
        HealthCheck.data_too_large,
    ],
    database=None,
)
@given(body=raw_bodies, path=paths)
def test_generated_bodies_never_get_a_5xx_and_never_hurt_well_formed_neighbours(
    server: Server, body: bytes, path: str
) -> None:
    with ThreadPoolExecutor(3) as threads:
        good = [threads.submit(_post, f"{server.url}/v1/embeddings", encode(GOOD)) for _ in range(2)]
        generated = threads.submit(_post, f"{server.url}{path}", body).result()
        for future in good:
            _check_good(future.result())
    assert generated.status_code < 500, (body[:300], generated.text[:500])
    if generated.status_code >= 400:
        assert set(generated.json()["error"]) == {"message", "type", "param", "code"}
    loud = [r for r in server.log.records if r.levelno > logging.INFO]
    assert not loud, [r.getMessage() for r in loud]


def test_a_lone_surrogate_is_a_400_naming_the_input_and_its_batch_neighbours_succeed(server: Server) -> None:
    bad = {"model": MODEL, "input": ["fine", "broken \ud800 text"]}
    with ThreadPoolExecutor(3) as threads:
        good = [threads.submit(_post, f"{server.url}/v1/embeddings", encode(GOOD)) for _ in range(2)]
        response = threads.submit(_post, f"{server.url}/v1/embeddings", encode(bad)).result()
        for future in good:
            _check_good(future.result())
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "input[1]" and "surrogate" in error["message"], error
    # A key with a lone surrogate is named with it escaped: the error body itself is valid UTF-8.
    response = _post(f"{server.url}/v1/embeddings", encode({"model": MODEL, "input": "x", "us\udc00r": 1}))
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "us\\udc00r" and "surrogate" in error["message"], error
    error["message"].encode("utf-8")


@pytest.mark.parametrize(
    ("body", "param", "words"),
    [
        ({"model": MODEL, "input": "x", "dimensions": 2**64}, "dimensions", ["less than"]),
        ({"model": MODEL, "input": "x", "user": "u" * 300}, "user", ["256"]),
        ({"model": MODEL * 100, "input": "x"}, "model", ["256"]),
        ({"model": MODEL, "prompt": "x", "seed": 2**64}, "seed", ["less than"]),
        ({"model": MODEL, "prompt": "x", "stop": ["a"] * 5}, "stop", ["at most 4"]),
        ({"model": MODEL, "prompt": "x", "max_tokens": 2**40}, "max_tokens", ["less than"]),
    ],
    ids=[
        "dimensions overflow",
        "long user",
        "long model",
        "seed overflow",
        "five stops",
        "max_tokens overflow",
    ],
)
def test_numbers_and_strings_past_their_limits_are_a_400_naming_the_field(
    server: Server, body: dict[str, Any], param: str, words: list[str]
) -> None:
    path = "/v1/completions" if "prompt" in body else "/v1/embeddings"
    response = _post(f"{server.url}{path}", encode(body))
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param, error
    for word in words:
        assert word in error["message"], error


def test_deep_nesting_is_refused_before_parsing(server: Server) -> None:
    deep = b'{"model": "minilm", "input": ' + b"[" * 200_000 + b"]" * 200_000 + b"}"
    response = _post(f"{server.url}/v1/embeddings", deep)
    assert response.status_code == 400, response.text
    assert "200001 levels deep" in response.json()["error"]["message"]
    # Brackets inside strings are text, not nesting.
    text = {"model": MODEL, "input": ["[" * 5000 + "{" * 5000, "\\" + "]" * 100]}
    _check_good(_post(f"{server.url}/v1/embeddings", encode(text)))


def test_an_over_long_request_line_is_a_400_logged_at_info_without_a_traceback(server: Server) -> None:
    before = len(server.log.records)
    port = int(server.url.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        sock.sendall(b"GET /" + b"a" * 20_000 + b" HTTP/1.1\r\nHost: x\r\n\r\n")
        reply = sock.recv(4096)
    assert reply.split(b"\r\n", 1)[0].endswith(b" 400 Bad Request"), reply[:200]
    new = server.log.records[before:]
    assert any("Error handling request" in r.getMessage() for r in new), [r.getMessage() for r in new]
    assert all(r.levelno <= logging.INFO and r.exc_info is None for r in new), [
        (r.levelname, r.getMessage()) for r in new
    ]


def test_an_input_that_cannot_be_encoded_fails_alone_in_its_batch(server: Server) -> None:
    # Below the HTTP checks: the pool sends the batch without the input the wire cannot carry.
    batch = Batch("embed", ("first", "bad \udc80", "third"))
    outcomes = server.run(server.pool.execute(0, batch, timeout=60))
    assert isinstance(outcomes[0], EmbedResult) and isinstance(outcomes[2], EmbedResult)
    assert isinstance(outcomes[1], InputRejected) and "surrogates" in str(outcomes[1])
    assert outcomes[0].embedding.shape == (384,)
