"""Issue 26's table: cache-aware routing against least-loaded, one run, and the routing decision's cost.

    python -m bench.routing [--engine transformers|vllm] [--systems 8] [--system-tokens 1000] [--users 64]
                            [--turns 4] [--rate 4] [--output-tokens 32] [--policies cacheAware,leastLoaded]
                            [--kv-blocks 2048] [--rounds 2] [--log-dir DIR]
    python -m bench.routing --micro [--replicas 2] [--open-streams 64]

Workload: `iwg serve` of SmolLM2-135M-Instruct (its converted directory) with 2 replicas, started once per
policy and round (one after the other, each with the machine to itself; ``--rounds`` rounds, every other one
in the reverse order, since the first server of a run was the slowest whichever policy it served). ``--users`` users arrive at a fixed rate
(``--rate`` per second); each user talks to one system prompt (each about ``--system-tokens`` tokens of text
of its own), the same number of users to each, in an order shuffled once (seed 0, the same for every policy and
round: users taken in system order, u mod ``--systems``, alternated between the replicas so that least-loaded
routing put each system's first turns on one replica by accident) and has ``--turns`` turns, each a streamed chat completion of ``--output-tokens``
tokens (greedy, end-of-sequence ignored) whose answer joins the conversation before the next turn.

Each server first answers one short request (not measured). Printed per policy: TTFT p50/p99 (first turns and returning turns apart), output tokens/s over the run, the
engines' prefix-cache hit rate (``vllm:prefix_cache_hits`` / ``queries`` over the run; and over the returning
turns alone: the counts read when every first turn had finished and at the end, which covers only returning
turns when the first turns end before the returning ones start, as at the default rate), the routing decisions
per replica and reason; then the ratios cache-aware / least-loaded (targets: TTFT p50 <= 0.5x, tokens/s >=
1.0x, returning-turn hit rate >= 0.8).

``--micro``: the driver's routing alone, in process: the time to hash a chat prompt of ``--system-tokens``
tokens of text and pick a replica with ``--open-streams`` requests open and a table holding 64 conversations,
as decisions per second, and the memory a replica's table takes at its bound (32,768 blocks).

Figures for docs/benchmarks.md need a quiet machine: nothing else running.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import re
import sys
import tempfile
import time
import tracemalloc
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.engines import ROOT, launch, stop
from bench.generate import pct, sse_chunks
from bench.serve import WORDS
from tests.iwg_worker.driver.conftest import scrape_metrics

REPLICAS = 2


def system_prompt(index: int, tokens: int) -> str:
    """About ``tokens`` tokens (four characters each) of text of its own."""
    words = [f"{WORDS[(index + i) % len(WORDS)]}{i % 7}" for i in range(tokens * 4 // 9)]
    return f"System prompt {index}. " + " ".join(words)


@dataclass
class PolicyRun:
    policy: str
    seconds: float = 0.0
    tokens: int = 0
    ttft_first: list[float] = field(default_factory=list)
    ttft_returning: list[float] = field(default_factory=list)
    hit_rate: float = 0.0
    returning_hit_rate: float = 0.0
    decisions: dict[str, float] = field(default_factory=dict)


def rate(after: dict[str, float], before: dict[str, float]) -> float:
    queries = after.get("vllm:prefix_cache_queries_total", 0.0) - before.get(
        "vllm:prefix_cache_queries_total", 0.0
    )
    hits = after.get("vllm:prefix_cache_hits_total", 0.0) - before.get("vllm:prefix_cache_hits_total", 0.0)
    return hits / queries if queries else float("nan")


async def workload(url: str, args: argparse.Namespace, run: PolicyRun) -> None:
    import aiohttp

    systems = [system_prompt(s, args.system_tokens) for s in range(args.systems)]
    system_of = [u % args.systems for u in range(args.users)]
    random.Random(0).shuffle(system_of)
    first_done = asyncio.Event()
    firsts_left = args.users
    marks: dict[str, dict[str, float]] = {}

    async def turn(session: aiohttp.ClientSession, messages: list[dict[str, str]], returning: bool) -> str:
        body = {
            "model": "smollm2",
            "messages": messages,
            "max_tokens": args.output_tokens,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        started = time.monotonic()
        first = None
        text = []
        async for chunk in sse_chunks(session, f"{url}/v1/chat/completions", body):
            if chunk.get("usage"):
                run.tokens += chunk["usage"]["completion_tokens"]
                continue
            if first is None:
                first = time.monotonic() - started
            text.append(chunk["choices"][0]["delta"].get("content", ""))
        (run.ttft_returning if returning else run.ttft_first).append(first or float("nan"))
        return "".join(text)

    async def user(session: aiohttp.ClientSession, u: int) -> None:
        nonlocal firsts_left
        await asyncio.sleep(u / args.rate)
        messages = [{"role": "system", "content": systems[system_of[u]]}]
        for t in range(args.turns):
            messages.append({"role": "user", "content": f"User {u}, turn {t}: what should I check next?"})
            reply = await turn(session, messages, returning=t > 0)
            messages.append({"role": "assistant", "content": reply})
            if t == 0:
                firsts_left -= 1
                if firsts_left == 0:
                    marks["firsts"] = await scrape_metrics(session, url)
                    first_done.set()

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=3600)) as session:
        warm = {"model": "smollm2", "messages": [{"role": "user", "content": "Warm up."}], "max_tokens": 4}
        async for _chunk in sse_chunks(session, f"{url}/v1/chat/completions", {**warm, "stream": True}):
            pass  # one short request first, as bench.engines does: not measured
        before = await scrape_metrics(session, url)
        started = time.monotonic()
        await asyncio.gather(*(user(session, u) for u in range(args.users)))
        run.seconds = time.monotonic() - started
        await asyncio.sleep(2.5)  # the driver reads the engines' counts every second
        after = await scrape_metrics(session, url)
    run.hit_rate = rate(after, before)
    run.returning_hit_rate = rate(after, marks.get("firsts", before))
    for key, value in after.items():
        match = re.match(r'iwg_routing_decisions_total\{reason="(\w+)",replica="(\d+)"\}', key)
        if match and value - before.get(key, 0.0) > 0:
            run.decisions[f"r{match.group(2)}:{match.group(1)}"] = value - before.get(key, 0.0)


def start(policy: str, args: argparse.Namespace, tmp: Path) -> Any:
    import os

    import yaml

    from tests.models import smollm2_manifest

    manifest = smollm2_manifest(args.kv_blocks, args.engine)
    manifest["spec"]["replicas"] = REPLICAS
    manifest["spec"]["driver"]["routing"] = {"policy": policy}
    path = tmp / f"group-{policy}.yaml"
    path.write_text(yaml.safe_dump(manifest))
    env = {**os.environ, "PYTHONPATH": f"{ROOT / 'operator'}:{ROOT / 'worker_image'}:{ROOT}"}
    env.pop("OMP_NUM_THREADS", None)  # iwg serve shares the cores between the replicas
    argv = [sys.executable, "-m", "iwg_worker.cli", "serve", str(path), "--port", "{port}"]
    return launch(f"iwg-{policy}", argv, env, tmp / f"iwg-{policy}.log", "/readyz", 900.0)


def table_row(run: PolicyRun, round_: str) -> str:
    def ms(values: list[float], q: float) -> str:
        return f"{1000 * pct(values, q):.0f}"

    decisions = ", ".join(f"{k} {v:.0f}" for k, v in sorted(run.decisions.items()))
    return (
        f"| {run.policy} | {round_} | {ms(run.ttft_first, 0.5)} / {ms(run.ttft_first, 0.99)} | "
        f"{ms(run.ttft_returning, 0.5)} / {ms(run.ttft_returning, 0.99)} | {run.tokens / run.seconds:.1f} | "
        f"{run.hit_rate:.2f} | {run.returning_hit_rate:.2f} | {decisions} |"
    )


def pooled(runs: list[PolicyRun]) -> PolicyRun:
    """One policy's rounds as one run: their samples together, rates averaged, decisions summed."""
    out = PolicyRun(runs[0].policy)
    for run in runs:
        out.ttft_first += run.ttft_first
        out.ttft_returning += run.ttft_returning
        out.tokens += run.tokens
        out.seconds += run.seconds
        for key, value in run.decisions.items():
            out.decisions[key] = out.decisions.get(key, 0.0) + value
    out.hit_rate = sum(r.hit_rate for r in runs) / len(runs)
    out.returning_hit_rate = sum(r.returning_hit_rate for r in runs) / len(runs)
    return out


def serve_bench(args: argparse.Namespace) -> None:
    rounds: list[list[PolicyRun]] = []
    policies = args.policies.split(",")
    with tempfile.TemporaryDirectory() as scratch:
        tmp = args.log_dir or Path(scratch)
        tmp.mkdir(parents=True, exist_ok=True)
        for number in range(args.rounds):
            # Every other round in the reverse order: the first server of a run here was the slowest
            # whichever policy it had (the machine's memory first touched), so one order favours the second.
            order = policies if number % 2 == 0 else policies[::-1]
            rounds.append([])
            for policy in order:
                server = start(policy, args, tmp)
                try:
                    print(f"round {number + 1}, {policy}: started in {server.startup_s:.1f} s", flush=True)
                    run = PolicyRun(policy)
                    asyncio.run(workload(server.url, args, run))
                    rounds[-1].append(run)
                finally:
                    stop(server)
    print(
        f"\n{args.users} users x {args.turns} turns, {args.systems} system prompts of ~{args.system_tokens} tokens, "
        f"{args.rate}/s arrivals, {args.output_tokens} output tokens, {REPLICAS} replicas, {args.engine}, "
        f"{args.kv_blocks} KV blocks a replica, {args.rounds} rounds (every other one in the reverse order)\n"
    )
    print(
        "| policy | round | TTFT p50 / p99 first turns (ms) | returning turns (ms) | output tok/s | hit rate | "
        "returning hit rate | routed (replica:reason) |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for number, runs in enumerate(rounds):
        for run in runs:
            print(table_row(run, f"{number + 1} ({runs.index(run) + 1}. of {len(runs)})"))
    by = {p: pooled([run for runs in rounds for run in runs if run.policy == p]) for p in policies}
    if len(rounds) > 1:
        for run in by.values():
            print(table_row(run, "all"))
    if "cacheAware" in by and "leastLoaded" in by:
        ca, ll = by["cacheAware"], by["leastLoaded"]
        all_ttft = ca.ttft_first + ca.ttft_returning, ll.ttft_first + ll.ttft_returning
        ttft = pct(all_ttft[0], 0.5) / pct(all_ttft[1], 0.5)
        tps = (ca.tokens / ca.seconds) / (ll.tokens / ll.seconds)
        print(
            f"\ncache-aware / least-loaded: TTFT p50 {ttft:.2f}x (target <= 0.5x: {'met' if ttft <= 0.5 else 'NOT met'}), "
            f"tokens/s {tps:.2f}x (target >= 1.0x: {'met' if tps >= 1.0 else 'NOT met'}), returning-turn hit rate "
            f"{ca.returning_hit_rate:.2f} (target >= 0.8: {'met' if ca.returning_hit_rate >= 0.8 else 'NOT met'})"
        )


def micro(args: argparse.Namespace) -> None:
    """Decisions per second of `Router.pick_generation` (prompt hashing included), in process."""
    from iwg_worker.driver.metrics import DriverMetrics
    from iwg_worker.driver.pool import ReplicaState
    from iwg_worker.driver.prefix import DEFAULT_MAX_BLOCKS, PrefixTable, prompt_blocks
    from iwg_worker.driver.router import Router

    class Pool:
        def states(self) -> dict[int, ReplicaState]:
            return dict.fromkeys(range(args.replicas), ReplicaState.SERVING)

        def add_listener(self, listener: Any) -> None:
            pass

    router = Router(Pool(), DriverMetrics())  # type: ignore[arg-type]  # routing needs only these two
    router.block_size = 64
    system = system_prompt(0, args.system_tokens)

    def request(u: int, turn: int) -> dict[str, Any]:
        messages = [{"role": "system", "content": system}]
        for t in range(turn + 1):
            messages += [{"role": "user", "content": f"User {u}, turn {t}: what next?"}]
            messages += [{"role": "assistant", "content": "Check the nodes. " * 8}] if t < turn else []
        return {"messages": messages}

    requests = [request(u, t) for u in range(64) for t in range(4)]
    for r in requests:
        router.pick_generation(prompt_blocks(r, router.block_size))
    claims = [router.claim(u % args.replicas) for u in range(args.open_streams)]
    for c in claims:
        c.__enter__()
    count = 0
    started = time.perf_counter()
    while time.perf_counter() - started < args.seconds:
        for r in requests:
            router.pick_generation(prompt_blocks(r, router.block_size))
        count += len(requests)
    elapsed = time.perf_counter() - started
    tracemalloc.start()
    table = PrefixTable()
    table.record(0, tuple(range(10**9, 10**9 + DEFAULT_MAX_BLOCKS)))
    held, _ = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    print(
        f"{count / elapsed:,.0f} routing decisions/s ({1e6 * elapsed / count:.1f} us each: hashing a chat prompt of "
        f"~{args.system_tokens} tokens of text and choosing among {args.replicas} replicas with "
        f"{args.open_streams} requests open); a replica's table at its bound ({DEFAULT_MAX_BLOCKS} blocks): "
        f"{held / 2**20:.1f} MiB",
    )
    del table


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--micro", action="store_true", help="the routing decision's cost alone, in process")
    parser.add_argument("--engine", default="transformers", choices=("transformers", "vllm"))
    parser.add_argument("--systems", type=int, default=8)
    parser.add_argument("--system-tokens", type=int, default=1000)
    parser.add_argument("--users", type=int, default=64)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--rate", type=float, default=4.0, help="users arriving per second")
    parser.add_argument("--output-tokens", type=int, default=32)
    parser.add_argument("--policies", default="cacheAware,leastLoaded")
    parser.add_argument("--kv-blocks", type=int, default=2048)
    parser.add_argument("--log-dir", type=Path, default=None)
    parser.add_argument(
        "--rounds", type=int, default=2, help="runs of every policy, every other one reversed"
    )
    parser.add_argument("--replicas", type=int, default=2, help="--micro: replicas to choose among")
    parser.add_argument("--open-streams", type=int, default=64, help="--micro: requests open meanwhile")
    parser.add_argument("--seconds", type=float, default=3.0, help="--micro: how long to measure")
    args = parser.parse_args()
    if args.micro:
        micro(args)
    else:
        serve_bench(args)


if __name__ == "__main__":
    main()
