"""A replica of worldSize 3 holds SmolLM2 sharded three ways (tensor parallel over gloo, real weights, three
worker processes) and answers as one rank would: greedy tokens equal worldSize 1's, log-probabilities within a
stated tolerance, and each rank holds about a third of the weights. On each engine: transformers' tensor
parallelism, and vLLM's (`external_launcher`: every rank runs the engine, rank 0 sends each step's commands)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from iwg_worker.engine.vllm_engine import VllmEngine
from iwg_worker.executor.base import ReplicaLostError
from iwg_worker.executor.multiproc import MultiprocExecutor
from iwg_worker.executor.streams import StreamFailed
from iwg_worker.worker_base import WorkerConfig

from tests.iwg_worker.engine.conftest import Collector, Engine, chat_ids
from tests.iwg_worker.engine.test_engine import QUESTIONS

pytestmark = [pytest.mark.timeout(900), pytest.mark.slow]

WORLD = 3
MAX_TOKENS = 6
TOP = 3
# float32 on CPU: the sharded matmuls sum their three partial products in another order than the whole one.
LOGPROB_TOLERANCE = 1e-3
# A rank that dies is noticed by its process's exit (the executor's tick), well within the heartbeat timeout (three
# heartbeats of HEARTBEAT_S: 6 s, past a 2-3 s stall of a loaded CI machine).
HEARTBEAT_S = 2.0


@pytest.fixture(scope="module")
def sharded(smollm2: Path, engine: tuple[Engine, Collector]) -> Iterator[MultiprocExecutor]:
    """Three ranks on the engine of the worldSize-1 `engine` they are compared with."""
    executor = MultiprocExecutor(
        WorkerConfig(
            task="generate",
            model_path=str(smollm2),
            device="cpu",
            dtype="float32",
            engine="vllm" if isinstance(engine[0], VllmEngine) else "transformers",
            enforce_eager=True,
            group="tp3",
            kv_cache_blocks=64,
        ),
        replicas=1,
        world_size=WORLD,
        heartbeat_interval_s=HEARTBEAT_S,
        startup_timeout_s=600,
        extra_env={"OMP_NUM_THREADS": "1"},
    )
    yield executor
    executor.shutdown()


def requests(tokenizer: Any) -> list[dict[str, Any]]:
    return [
        {
            "id": f"tp-{i}",
            "prompt_ids": chat_ids(tokenizer, q),
            "max_tokens": MAX_TOKENS,
            "temperature": 0.0,
            "logprobs": True,
            "top_logprobs": TOP,
        }
        for i, q in enumerate(QUESTIONS)
    ]


async def run_sharded(executor: MultiprocExecutor, batch: list[dict[str, Any]]) -> dict[str, list[Any]]:
    async def one(request: dict[str, Any]) -> list[Any]:
        stream, answer = await executor.open_stream(request, replica=0, timeout=60)
        assert answer["ok"], answer
        return [item async for item in stream]

    results = await asyncio.gather(*(one(r) for r in batch))
    return {r["id"]: items for r, items in zip(batch, results, strict=True)}


def test_world_size_3_answers_as_world_size_1(
    sharded: MultiprocExecutor, engine: tuple[Engine, Collector], reference: tuple[Any, Any]
) -> None:
    batch = requests(reference[1])
    assert len(batch) == 16
    got = asyncio.run(run_sharded(sharded, batch))
    eng, collector = engine
    assert all(a["ok"] for a in eng.add(batch))
    collector.wait([r["id"] for r in batch])
    worst = 0.0
    for request in batch:
        items = got[request["id"]]
        tokens = [t for item in items for t in item["tokens"]]
        assert tokens == collector.tokens(request["id"]), request["id"]
        assert len(tokens) >= 1
        logprobs = [v for item in items for v in item["logprobs"]]
        top = [row for item in items for row in item["top_logprobs"]]
        one = collector.items[request["id"]]
        one_logprobs = [v for item in one for v in item["logprobs"]]
        one_top = [row for item in one for row in item["top_logprobs"]]
        assert len(logprobs) == len(one_logprobs) == len(tokens)
        for value, expected in zip(logprobs, one_logprobs, strict=True):
            worst = max(worst, abs(value - expected))
        for row, expected_row in zip(top, one_top, strict=True):  # [[token, logprob, text], ...]
            assert [entry[0] for entry in row] == [entry[0] for entry in expected_row]
            worst = max(worst, *(abs(a[1] - b[1]) for a, b in zip(row, expected_row, strict=True)))
    print(
        f"worldSize {WORLD} vs 1: largest log-probability difference {worst:.2e} (tolerance {LOGPROB_TOLERANCE})"
    )
    assert worst <= LOGPROB_TOLERANCE


def test_each_rank_holds_about_a_third_of_the_weights(
    sharded: MultiprocExecutor, engine: tuple[Engine, Collector]
) -> None:
    whole = engine[0].parameter_bytes()
    ranks = [d["parameter_bytes"] for d in sharded.collective_rpc("describe", timeout=60)]
    print(f"parameter bytes: whole model {whole / 1e6:.0f} MB, ranks {[f'{b / 1e6:.0f} MB' for b in ranks]}")
    assert len(ranks) == WORLD
    for held in ranks:
        assert whole / WORLD * 0.95 <= held <= whole / WORLD * 1.1, (held, whole)


def test_a_rank_killed_mid_stream_fails_the_request_with_a_clear_error_and_the_replica_restarts(
    sharded: MultiprocExecutor, reference: tuple[Any, Any]
) -> None:
    """Last in this module: it kills a rank of the shared executor."""
    request = {
        "id": "tp-killed",
        "prompt_ids": chat_ids(reference[1], QUESTIONS[0]),
        "max_tokens": 2000,
        "ignore_eos": True,
    }

    async def run() -> tuple[BaseException, float, int]:
        stream, answer = await sharded.open_stream(request, replica=0, timeout=60)
        assert answer["ok"], answer
        received = 0
        killed = 0.0
        try:
            async for item in stream:
                received += len(item["tokens"])
                if not killed:
                    sharded.worker_process(0, 1).process.kill()  # SIGKILL: no goodbye
                    killed = time.monotonic()
        except Exception as error:
            return error, time.monotonic() - killed, received
        raise AssertionError(f"the stream ended normally after {received} tokens with rank 1 killed")

    error, after, received = asyncio.run(run())
    print(f"rank 1 SIGKILLed: the request failed {after:.2f} s later, after {received} tokens: {error}")
    # Two clear errors race: the executor sees rank 1's process exit (ReplicaLostError naming the rank), or
    # rank 0's all-reduce sees the closed connection first and the engine fails the request with it.
    if isinstance(error, ReplicaLostError):
        assert error.replica == 0 and error.ranks == [1], str(error)
    else:
        assert isinstance(error, StreamFailed) and "by peer" in str(error), repr(error)
    assert after < sharded.heartbeat_timeout_s
    assert received < request["max_tokens"]
    # Its peers cannot take a new member into their torch.distributed group: the whole replica restarts.
    deadline = time.monotonic() + 60
    while sharded.restarts(0) < 1:
        assert time.monotonic() < deadline, "the replica was not restarted"
        time.sleep(0.2)
