"""Issue 26's last figure: what the driver adds to a request's latency, with 0 and 64 streams open.

    python -m bench.driver_overhead [--streams 0,64] [--seconds 15] [--rounds 2] [--step-ms 20]
                                    [--output-tokens 50] [--prompt-tokens 256] [--replicas 2]

Three servers, the same client, one run:

- **iwg**: the group as the operator wires it: ``iwg-driver`` (`python -m iwg_worker.driver.main`: aiohttp,
  the OpenAI API, cache-aware routing, `ClusterExecutor` over tcp with CURVE on loopback) and ``--replicas``
  ``iwg-worker`` processes (`WorkerProc`, its busy loop and output thread) whose worker class is
  `bench.instant_worker.InstantWorker`: an engine that costs nothing (the first token at once, then one every
  ``--step-ms`` for every open request, one stream message per step, each token's text the
  ``time.monotonic_ns()`` at which it was emitted).
- **iwg leastLoaded**: the same with ``IWG_ROUTING_POLICY=leastLoaded``: iwg minus it is what cache-aware
  routing adds.
- **floor**: a bare aiohttp server in a process of its own with the same engine in its event loop: the first
  token at once, then one every ``--step-ms`` for each open stream, written as the same OpenAI chunks. It has
  no API checks, no routing, no second process and no wire: what any Python HTTP server that streams costs,
  the client's own costs included.

The client keeps N streams open (streamed ``/v1/completions`` of ``--prompt-tokens`` token ids, a prompt of
its own each: cache-aware routing hashes it and picks a replica; ``--output-tokens`` / 2 to 3 / 2 tokens
each, their starts spread over one stream's length so that they do not begin and end together; each read to
the end and followed by the next) and beside them sends one probe at a time (2 tokens) at random moments,
10-50 ms apart, for ``--seconds`` per server and level, the servers alternating (``--rounds`` rounds, every
other one in the reverse order). Per probe: TTFT (sent to its first token read; the engine took no time, so all
of it is the servers' and the client's), and of it the way up (sent to emitted) and down (emitted to read);
per token of the open streams: emitted to read. Printed per level: p50 and p99 of each for every server; iwg
minus floor: **the driver's added latency per request**, whose target (issue 26) is at most 1 ms at 64 open
streams; iwg minus iwg leastLoaded; and the CPU milliseconds each server's processes used per request.

Figures for docs/benchmarks.md need a quiet machine: nothing else running.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

from bench.generate import pct

ROOT = Path(__file__).resolve().parent.parent
SERVED = "instant"
STAMP = re.compile(r"\d+")
TARGET_MS = 1.0
TARGET_STREAMS = 64
STARTUP_TIMEOUT_S = 120.0
PROBE_TOKENS = 2


@dataclass
class Level:
    ttft: list[float] = field(default_factory=list)
    up: list[float] = field(default_factory=list)
    down_first: list[float] = field(default_factory=list)
    down: list[float] = field(default_factory=list)
    requests: int = 0
    tokens: int = 0
    errors: int = 0
    cpu_s: float = 0.0
    seconds: float = 0.0


# -- the floor: a bare streaming server ---------------------------------------------------------------------


def serve_floor(port: int, step_s: float) -> None:
    """The floor server (run in a process of its own by ``--floor PORT``)."""
    from aiohttp import web

    queues: set[asyncio.Queue[int]] = set()

    async def steps(app: web.Application) -> Any:
        async def loop() -> None:
            while True:
                await asyncio.sleep(step_s)
                stamp = time.monotonic_ns()
                for queue in queues:
                    queue.put_nowait(stamp)

        task = asyncio.create_task(loop())
        yield
        task.cancel()

    async def completions(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        remaining = int(body["max_tokens"])
        queue: asyncio.Queue[int] = asyncio.Queue()
        queue.put_nowait(time.monotonic_ns())  # the first token at once
        queues.add(queue)
        response = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
        )
        await response.prepare(request)
        created = int(time.time())
        try:
            while remaining > 0:
                stamp = await queue.get()
                remaining -= 1
                chunk = {
                    "id": "cmpl-floor",
                    "object": "text_completion",
                    "created": created,
                    "model": SERVED,
                    "choices": [
                        {
                            "index": 0,
                            "text": f"{stamp} ",
                            "logprobs": None,
                            "finish_reason": None if remaining else "length",
                        }
                    ],
                }
                await response.write(f"data: {json.dumps(chunk)}\n\n".encode())
        finally:
            queues.discard(queue)
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response

    async def ready(_: web.Request) -> web.Response:
        return web.Response(text="ok")

    app = web.Application()
    app.cleanup_ctx.append(steps)
    app.router.add_post("/v1/completions", completions)
    app.router.add_get("/readyz", ready)
    web.run_app(app, host="127.0.0.1", port=port, print=None, access_log=None)


# -- iwg: a driver and instant workers wired as the operator wires pods ---------------------------------------


def start_iwg(
    tmp: Path, replicas: int, step_ms: float, policy: str
) -> tuple[str, list[subprocess.Popen[bytes]]]:
    from iwg_operator.api import wiring
    from iwg_worker.executor.multiproc import launch_worker, worker_env
    from iwg_worker.security import CurveKeys
    from iwg_worker.worker_base import WorkerConfig

    from tests.iwg_worker.driver.conftest import free_port, subprocess_env

    driver_keys, worker_keys = CurveKeys.generate_pair()
    driver_curve, worker_curve = driver_keys.save(tmp / "curve-driver"), worker_keys.save(tmp / "curve")
    rpc, response, http = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}", free_port()
    base = {
        **subprocess_env(),
        "PYTHONPATH": os.pathsep.join(str(p) for p in (ROOT / "operator", ROOT / "worker_image", ROOT)),
        "IWG_LOG_LEVEL": "WARNING",
    }
    driver_env = {
        **base,
        wiring.GROUP: "overhead",
        wiring.REPLICAS: str(replicas),
        wiring.WORLD_SIZE: "1",
        wiring.RPC_ENDPOINT: rpc,
        wiring.RESPONSE_ENDPOINT: response,
        wiring.POD_IP: "127.0.0.1",
        wiring.CURVE_DIR: str(driver_curve),
        wiring.MODEL_TASK: "generate",
        wiring.SERVED_NAME: SERVED,
        wiring.HTTP_HOST: "127.0.0.1",
        wiring.HTTP_PORT: str(http),
        wiring.ROUTING_POLICY: policy,
    }
    processes = []
    tmp = tmp / policy
    tmp.mkdir()
    with open(tmp / "driver.log", "wb") as log:
        processes.append(
            subprocess.Popen(
                [sys.executable, "-m", "iwg_worker.driver.main"],
                env=driver_env,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        )
    for replica in range(replicas):
        config = WorkerConfig(
            task="generate",
            model_path="none",
            served_name=SERVED,
            device="cpu",
            group="overhead",
            replica=replica,
        )
        env = worker_env(
            config,
            rpc,
            response,
            curve_dir=str(worker_curve),
            worker_cls="bench.instant_worker.InstantWorker",
        )
        env["IWG_BENCH_STEP_MS"] = str(step_ms)
        processes.append(launch_worker({**base, **env}, tmp / f"worker-{replica}.log"))
    return f"http://127.0.0.1:{http}", processes


def start_floor(tmp: Path, step_ms: float) -> tuple[str, subprocess.Popen[bytes]]:
    from tests.iwg_worker.driver.conftest import free_port

    port = free_port()
    with open(tmp / "floor.log", "wb") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "bench.driver_overhead", "--floor", str(port), "--step-ms", str(step_ms)],
            cwd=ROOT,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    return f"http://127.0.0.1:{port}", process


async def wait_ready(url: str, processes: list[subprocess.Popen[bytes]]) -> None:
    import aiohttp

    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    async with aiohttp.ClientSession() as session:
        while time.monotonic() < deadline:
            if any(p.poll() is not None for p in processes):
                raise RuntimeError(f"a process of {url} exited while starting")
            try:
                async with session.get(f"{url}/readyz") as resp:
                    if resp.status == 200:
                        return
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(0.5)
    raise RuntimeError(f"{url} was not ready within {STARTUP_TIMEOUT_S} s")


# -- the client ------------------------------------------------------------------------------------------------


async def run_level(
    url: str, streams: int, args: argparse.Namespace, seconds: float, seed: int, level: Level
) -> None:
    """``streams`` open streams (their lengths and starts spread, so that they do not begin and end
    together) for ``seconds``, and beside them one probe request at a time, at random moments."""
    import aiohttp

    rng = random.Random(seed)
    stop_at = time.monotonic() + seconds
    counter = iter(range(1 << 30))

    def prompt() -> list[int]:
        n = next(counter)
        return [1 + (seed * 7919 + n * 104729 + i * 31) % 49000 for i in range(args.prompt_tokens)]

    async def one(session: aiohttp.ClientSession, max_tokens: int, probe: bool) -> None:
        body = {"model": SERVED, "prompt": prompt(), "max_tokens": max_tokens, "stream": True}
        first = True
        sent = time.monotonic_ns()
        try:
            async with session.post(f"{url}/v1/completions", json=body) as resp:
                if resp.status != 200:
                    level.errors += 1
                    await resp.read()
                    return
                async for raw in resp.content:
                    received = time.monotonic_ns()
                    line = raw.strip()
                    if not line.startswith(b"data: {"):
                        continue
                    text = json.loads(line[6:])["choices"][0]["text"]
                    for stamp in (int(s) for s in STAMP.findall(text)):
                        level.tokens += 1
                        if not probe:
                            level.down.append((received - stamp) * 1e-6)
                        elif first:
                            first = False
                            level.ttft.append((received - sent) * 1e-6)
                            level.up.append((stamp - sent) * 1e-6)
                            level.down_first.append((received - stamp) * 1e-6)
            level.requests += 1
        except aiohttp.ClientError:
            level.errors += 1

    async def background(session: aiohttp.ClientSession, index: int) -> None:
        await asyncio.sleep(rng.uniform(0, args.output_tokens * args.step_ms / 1000.0))
        while time.monotonic() < stop_at:
            await one(session, rng.randint(args.output_tokens // 2, args.output_tokens * 3 // 2), False)

    async def probes(session: aiohttp.ClientSession) -> None:
        await asyncio.sleep(min(1.0, args.output_tokens * args.step_ms / 1000.0))  # the streams are open
        while time.monotonic() < stop_at:
            await asyncio.sleep(rng.uniform(0.01, 0.05))  # at random moments between steps
            await one(session, PROBE_TOKENS, True)

    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as session:
        await asyncio.gather(probes(session), *(background(session, i) for i in range(streams)))


def cpu_seconds(processes: list[psutil.Process]) -> float:
    total = 0.0
    for process in processes:
        times = process.cpu_times()
        total += times.user + times.system
    return total


async def measure(args: argparse.Namespace) -> dict[str, dict[int, Level]]:
    levels = [int(s) for s in args.streams.split(",")]
    with tempfile.TemporaryDirectory(prefix="iwg-overhead-") as name:
        tmp = Path(name)
        servers = {
            "iwg": start_iwg(tmp, args.replicas, args.step_ms, "cacheAware"),
            "iwg leastLoaded": start_iwg(tmp, args.replicas, args.step_ms, "leastLoaded"),
        }
        floor_url, floor_process = start_floor(tmp, args.step_ms)
        servers["floor"] = (floor_url, [floor_process])
        results: dict[str, dict[int, Level]] = {name: {n: Level() for n in levels} for name in servers}
        try:
            for url, processes in servers.values():
                await wait_ready(url, processes)
            await asyncio.sleep(2.0)  # the driver's first stats poll of every replica
            for url, _ in servers.values():  # warm both (not measured)
                await run_level(url, 4, args, 2.0, 0, Level())
            for round_ in range(args.rounds):
                order = list(servers) if round_ % 2 == 0 else list(reversed(servers))
                for streams in levels:
                    for name in order:
                        url, processes = servers[name]
                        watched = [psutil.Process(p.pid) for p in processes]
                        level = results[name][streams]
                        before, started = cpu_seconds(watched), time.monotonic()
                        await run_level(url, streams, args, args.seconds, round_ + 1, level)
                        level.cpu_s += cpu_seconds(watched) - before
                        level.seconds += time.monotonic() - started
                        print(
                            f"  round {round_ + 1}, {streams} streams, {name}: {level.requests} requests so far",
                            file=sys.stderr,
                        )
        finally:
            everything = [p for _, processes in servers.values() for p in processes]
            for process in everything:
                process.terminate()
            for process in everything:
                try:
                    process.wait(timeout=15)
                except subprocess.TimeoutExpired:
                    process.kill()
    return results


def report(results: dict[str, dict[int, Level]], args: argparse.Namespace) -> None:
    def p(values: list[float], q: float) -> str:
        return f"{pct(values, q):.2f}"

    print(
        f"\nDriver overhead: {args.replicas} instant replicas, a step every {args.step_ms:g} ms, "
        f"{args.prompt_tokens}-token prompts, {args.output_tokens} tokens each, {args.seconds:g} s x "
        f"{args.rounds} rounds per server and level; milliseconds\n"
    )
    print(
        "| open streams | server | requests | tokens/s | probe TTFT p50 | probe TTFT p99 | up p50 | down (first) p50 | "
        "token down p50 | token down p99 | errors | CPU ms/request |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for streams in results["iwg"]:
        for name in results:
            level = results[name][streams]
            print(
                f"| {streams} | {name} | {level.requests} | {level.tokens / level.seconds:.0f} | "
                f"{p(level.ttft, 0.5)} | {p(level.ttft, 0.99)} | {p(level.up, 0.5)} | "
                f"{p(level.down_first, 0.5)} | {p(level.down, 0.5)} | {p(level.down, 0.99)} | {level.errors} | "
                f"{1000 * level.cpu_s / max(1, level.requests):.2f} |"
            )
    for title, ours, base in (
        ("the driver's added latency: iwg minus floor", "iwg", "floor"),
        ("what cache-aware routing adds: iwg minus iwg leastLoaded", "iwg", "iwg leastLoaded"),
    ):
        print(f"\n{title}, milliseconds:\n")
        print(
            "| open streams | probe TTFT p50 | probe TTFT p99 | token down p50 | token down p99 | p50 <= 1 ms |"
        )
        print("|---|---|---|---|---|---|")
        for streams in results[ours]:
            a, b = results[ours][streams], results[base][streams]
            added = pct(a.ttft, 0.5) - pct(b.ttft, 0.5)
            verdict = ("met" if added <= TARGET_MS else "NOT met") if streams == TARGET_STREAMS else "-"
            print(
                f"| {streams} | {added:.2f} | {pct(a.ttft, 0.99) - pct(b.ttft, 0.99):.2f} | "
                f"{pct(a.down, 0.5) - pct(b.down, 0.5):.2f} | {pct(a.down, 0.99) - pct(b.down, 0.99):.2f} | "
                f"{verdict} |"
            )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--streams", default="0,64")
    parser.add_argument("--seconds", type=float, default=15.0)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--step-ms", type=float, default=20.0)
    parser.add_argument("--output-tokens", type=int, default=50)
    parser.add_argument("--prompt-tokens", type=int, default=256)
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--floor", type=int, help=argparse.SUPPRESS)  # run the floor server on this port
    args = parser.parse_args(argv)
    if args.floor:
        serve_floor(args.floor, args.step_ms / 1000.0)
        return 0
    results = asyncio.run(measure(args))
    report(results, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
