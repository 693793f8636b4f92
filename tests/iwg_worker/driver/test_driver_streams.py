"""Streaming generation through `iwg serve` (driver + a worker process + ZMQ + SmolLM2's real weights):
64 concurrent streams, first tokens long before the last stream ends, and streams dropped by their clients
cancelled on the worker with their KV cache freed."""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import aiohttp
import pytest
import yaml

from tests.iwg_worker.driver.conftest import ROOT, Served, free_port, stop, subprocess_env, wait_http
from tests.models import smollm2_dir

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

MODEL = "smollm2"


@pytest.fixture(scope="module")
def served_smollm2(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    tmp = tmp_path_factory.mktemp("serve-lm")
    manifest = yaml.safe_load((ROOT / "examples" / "smollm2.yaml").read_text())
    manifest["spec"]["model"]["path"] = str(smollm2_dir())  # the converted directory loads in a second
    (tmp / "group.yaml").write_text(yaml.safe_dump(manifest))
    port = free_port()
    log = tmp / "serve.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "iwg_worker.cli", "serve", str(tmp / "group.yaml"), "--port", str(port)],
            cwd=ROOT,
            env={
                **subprocess_env(),
                "OMP_NUM_THREADS": "2",
                "PYTHONPATH": f"{ROOT / 'operator'}:{ROOT / 'worker_image'}:{ROOT}",
            },
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_http(f"{url}/readyz", proc, 300, log)
        yield Served(url, proc, log)
    finally:
        code = stop(proc)
        assert code == 0, log.read_text(errors="replace")[-3000:]


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
