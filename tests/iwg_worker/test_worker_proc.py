"""`WorkerProc` in real `iwg-worker` processes, over real ZMQ: cancelled generation requests leave nothing
behind."""

from __future__ import annotations

import asyncio
import re
import time
import urllib.request
from pathlib import Path

import pytest
import torch
from iwg_worker.executor.multiproc import MultiprocExecutor
from iwg_worker.worker_base import WorkerConfig

from tests.iwg_worker.driver.conftest import STARTUP_TIMEOUT_S

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


def worker_metric(port: int, name: str) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
        for line in resp.read().decode().splitlines():
            if line.startswith(name + " "):
                return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"no {name} on the worker's /metrics")


def health_port(worker_log: Path) -> int:
    """The worker's health port, from its start line."""
    deadline = time.monotonic() + 30
    while not (found := re.findall(r"health on :(\d+)", worker_log.read_text(errors="replace"))):
        assert time.monotonic() < deadline, worker_log.read_text(errors="replace")[-2000:]
        time.sleep(0.1)
    return int(found[0])


# -- cancelled streams -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_gpt2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(vocab_size=97, n_positions=64, n_embd=32, n_layer=2, n_head=2, eos_token_id=96)
    path = tmp_path_factory.mktemp("gpt2")
    GPT2LMHeadModel(config).save_pretrained(path)
    return path


async def test_1000_cancelled_streams_leave_no_entries_and_no_engine_streams(tiny_gpt2: Path) -> None:
    """Each request is cancelled after its first token, as a driver does when its client goes away: the
    worker forgets which driver it streamed to, and the engine holds no stream, request or cache block."""
    executor = MultiprocExecutor(
        WorkerConfig(task="generate", model_path=str(tiny_gpt2), device="cpu", engine="transformers"),
        heartbeat_interval_s=0.5,
        startup_timeout_s=STARTUP_TIMEOUT_S,
        extra_env={"OMP_NUM_THREADS": "1"},
    )
    try:
        (member,) = executor.members()
        port = int(member.capabilities["health_port"])
        started = time.monotonic()

        async def one(i: int) -> None:
            request = {"id": f"c{i}", "prompt_ids": [5, 17, 42], "max_tokens": 50, "ignore_eos": True}
            stream, answer = await executor.open_stream(request, replica=0, timeout=60)
            assert answer["ok"], answer
            item = await anext(aiter(stream))
            assert item["tokens"] and item["finish_reason"] is None
            await executor.cancel_streams([f"c{i}"], replica=0, timeout=60)

        for first in range(0, 1000, 50):
            await asyncio.gather(*(one(i) for i in range(first, first + 50)))
        elapsed = time.monotonic() - started
        deadline = time.monotonic() + 10
        while True:  # the engine frees a cancelled request's blocks at its next step
            (stats,) = executor.collective_rpc("engine_stats", timeout=30, replica=0)
            if stats["kv_cache_blocks_used"] == 0 or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.1)
        tracked = worker_metric(port, "iwg_worker_streams")
        print(
            f"1000 streams cancelled after one token in {elapsed:.1f} s; worker entries {tracked:.0f}, engine {stats}"
        )
        assert tracked == 0
        assert stats["streams"] == 0 and stats["requests_running"] == 0 and stats["requests_waiting"] == 0
        assert stats["kv_cache_blocks_used"] == 0
    finally:
        executor.shutdown()
