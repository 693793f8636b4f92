"""Serving throughput and latency of `iwg serve`, beside the same model called directly in this process.

    python -m bench.serve [--clients 32] [--seconds 10] [--threads 1] [--replicas 1]

Measured in one run, on the same sentences:

- direct: the worker's own model code (`iwg_worker.models.embed.EmbeddingModel`) called in a loop in this
  process, at batch sizes 1, 8 and 32, with the worker's thread count;
- serving, batch 32: `--clients` concurrent HTTP clients, each request carrying 32 inputs;
- serving, dynamic batching: `--clients` concurrent clients sending one input per request, batched by the
  driver up to 32.

Throughput is inputs per second; the ratio compares serving with direct at the batch size the replica ran.
Clients ask for base64 embeddings (the `openai` client's default).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
WORDS = [
    "the",
    "operator",
    "schedules",
    "inference",
    "workers",
    "onto",
    "nodes",
    "with",
    "free",
    "accelerators",
    "and",
    "wires",
    "every",
    "rank",
    "to",
    "its",
    "driver",
    "over",
    "an",
    "authenticated",
    "channel",
    "so",
    "that",
    "requests",
    "are",
    "batched",
    "routed",
    "and",
    "answered",
    "quickly",
]


def sentences(n: int) -> list[str]:
    """Distinct sentences of 10 to 20 words, the same in every run."""
    return [" ".join(WORDS[(i * 7 + j) % len(WORDS)] for j in range(10 + i % 11)) for i in range(n)]


@dataclass
class Result:
    name: str
    inputs: int
    seconds: float
    latencies: list[float]
    mean_batch: float | None = None

    @property
    def throughput(self) -> float:
        return self.inputs / self.seconds

    def percentile(self, q: float) -> float:
        ordered = sorted(self.latencies)
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1000 if ordered else float("nan")


def load_model(threads: int) -> Any:
    """The worker's own embedding code and weights, in this process, with the worker's thread count."""
    import torch
    from iwg_operator.api.v1alpha1 import load_manifest
    from iwg_worker.models.embed import EmbeddingModel

    torch.set_num_threads(threads)
    path = load_manifest(ROOT / "examples" / "minilm.yaml").spec.model.resolved_path()
    return EmbeddingModel(str(path), torch.device("cpu"), torch.float32)


def direct(model: Any, batch: int, seconds: float) -> Result:
    texts = sentences(512)
    model.embed(texts[:batch])  # warm-up
    latencies: list[float] = []
    done = 0
    start = time.perf_counter()
    while time.perf_counter() - start < seconds:
        chunk = [texts[(done + k) % len(texts)] for k in range(batch)]
        t = time.perf_counter()
        model.embed(chunk)
        latencies.append(time.perf_counter() - t)
        done += batch
    return Result(f"direct, batch {batch}", done, time.perf_counter() - start, latencies, float(batch))


async def load(url: str, clients: int, per_request: int, seconds: float) -> Result:
    import aiohttp

    texts = sentences(512)
    latencies: list[float] = []
    done = 0
    failures = 0
    deadline = time.perf_counter() + seconds

    async def client(index: int, session: aiohttp.ClientSession) -> None:
        nonlocal done, failures
        n = index * 17
        while time.perf_counter() < deadline:
            body = {
                "model": "all-MiniLM-L6-v2",
                "input": [texts[(n + k) % len(texts)] for k in range(per_request)],
                "encoding_format": "base64",
            }
            n += per_request
            t = time.perf_counter()
            async with session.post(f"{url}/v1/embeddings", json=body) as resp:
                await resp.read()
                if resp.status != 200:
                    failures += 1
                    continue
            latencies.append(time.perf_counter() - t)
            done += per_request

    connector = aiohttp.TCPConnector(limit=clients)
    async with aiohttp.ClientSession(
        connector=connector, timeout=aiohttp.ClientTimeout(total=120)
    ) as session:
        start = time.perf_counter()
        await asyncio.gather(*(client(i, session) for i in range(clients)))
        elapsed = time.perf_counter() - start
    if failures:
        print(f"  ({failures} requests failed)", file=sys.stderr)
    return Result(f"serving, {clients} clients x {per_request} input(s)", done, elapsed, latencies)


def batch_stats(url: str) -> tuple[float, float]:
    """(sum, count) of the driver's iwg_batch_size histogram."""
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    values = {}
    for line in text.splitlines():
        for name in ("iwg_batch_size_sum", "iwg_batch_size_count"):
            if line.startswith(name + " "):
                values[name] = float(line.split()[1])
    return values.get("iwg_batch_size_sum", 0.0), values.get("iwg_batch_size_count", 0.0)


async def measured_load(url: str, clients: int, per_request: int, seconds: float) -> Result:
    s0, c0 = batch_stats(url)
    result = await load(url, clients, per_request, seconds)
    s1, c1 = batch_stats(url)
    result.mean_batch = (s1 - s0) / (c1 - c0) if c1 > c0 else None
    return result


def start_server(port: int, replicas: int, threads: int) -> subprocess.Popen[bytes]:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": str(threads)}
    command = [
        sys.executable, "-m", "iwg_worker.cli", "serve", str(ROOT / "examples" / "minilm.yaml"),
        "--port", str(port), "--replicas", str(replicas),
    ]  # fmt: skip
    return subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def wait_ready(url: str, server: subprocess.Popen[bytes], timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise RuntimeError(f"iwg serve exited with {server.returncode}")
        try:
            with urllib.request.urlopen(f"{url}/readyz", timeout=2):
                return
        except (urllib.error.URLError, OSError):
            time.sleep(0.5)
    raise TimeoutError("iwg serve did not become ready")


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--clients", type=int, default=32, help="clients of the one-input-per-request run")
    parser.add_argument(
        "--clients-b32",
        type=int,
        default=4,
        help="clients of the 32-inputs-per-request run (4 keep 1 replica busy)",
    )
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument(
        "--threads", type=int, default=1, help="torch threads per worker and for direct calls"
    )
    parser.add_argument("--replicas", type=int, default=1)
    parser.add_argument("--port", type=int, default=18931)
    args = parser.parse_args()

    url = f"http://127.0.0.1:{args.port}"
    server = start_server(args.port, args.replicas, args.threads)
    try:
        wait_ready(url, server)
        asyncio.run(load(url, 4, 8, 2.0))  # warm-up
        model = load_model(args.threads)
        direct_results = {b: direct(model, b, args.seconds / 2) for b in (1, 8, 32)}
        served_32 = asyncio.run(measured_load(url, args.clients_b32, 32, args.seconds))
        served_dyn = asyncio.run(measured_load(url, args.clients, 1, args.seconds))
        # Other load on the machine drifts: measure direct batch 32 again and keep both halves.
        again = direct(model, 32, args.seconds / 2)
        first = direct_results[32]
        direct_results[32] = Result(
            "direct, batch 32", first.inputs + again.inputs, first.seconds + again.seconds,
            first.latencies + again.latencies, 32.0,
        )  # fmt: skip
    finally:
        server.send_signal(signal.SIGTERM)
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            server.kill()

    rows = [*direct_results.values(), served_32, served_dyn]
    print(
        f"\nall-MiniLM-L6-v2 on CPU ({os.cpu_count()} cores), {args.threads} torch thread(s) per worker and for "
        f"direct calls, {args.replicas} replica(s), max batch 32, max wait 5 ms\n"
    )
    print(
        f"| {'run':<38} | {'inputs/s':>9} | {'p50 ms':>8} | {'p99 ms':>8} | {'mean batch':>10} | {'vs direct':>9} |"
    )
    print(f"|{'-' * 40}|{'-' * 11}|{'-' * 10}|{'-' * 10}|{'-' * 12}|{'-' * 11}|")
    for row in rows:
        ratio = ""
        if row.name.startswith("serving") and row.mean_batch:
            nearest = min(direct_results, key=lambda b: abs(b - (row.mean_batch or 0)))
            ratio = f"{row.throughput / direct_results[nearest].throughput:.2f}x b{nearest}"
        batch = f"{row.mean_batch:.1f}" if row.mean_batch else ""
        print(
            f"| {row.name:<38} | {row.throughput:>9.1f} | {row.percentile(0.5):>8.1f} | {row.percentile(0.99):>8.1f} "
            f"| {batch:>10} | {ratio:>9} |"
        )
    ratio_32 = served_32.throughput / direct_results[32].throughput
    print(f"\nserving / direct at batch 32: {ratio_32:.2f}x (target >= 0.9x)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
