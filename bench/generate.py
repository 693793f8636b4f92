"""Generation throughput and latency of `iwg serve` (SmolLM2-135M-Instruct, CPU, float32), beside
transformers' continuous batching called directly in this process and the old one-prompt-at-a-time path,
all measured in one run on the same prompts.

    python -m bench.generate [--streams 1,8,32,64] [--output-tokens 128] [--serial-prompts 4]
    python -m bench.generate --executors-only [--executor-streams 32] [--executor-rounds 2]

- direct: transformers' `ContinuousBatchingManager` on the same weights with the same cache settings as the
  worker, the requests added at once, tokens streamed back;
- iwg serve: N concurrent streamed `/v1/completions` requests over HTTP (driver + one worker process + ZMQ);
- iwg serve, chat: the same prompts' text as N streamed `/v1/chat/completions` requests (rendered with the
  model's chat template by the worker: a few more prompt tokens each), against its own baseline "direct, chat
  prompts": transformers' engine on the very tokens the worker renders for those chats;
- one at a time: `model.generate` on one prompt after another (what `generate` did before the engine), on
  ``--serial-prompts`` prompts: its rate does not depend on how many streams wait;
- per-step overhead of the Multiproc executor: the same engine (the worker's own `GenerationEngine`, same
  weights and cache size) behind `UniProcExecutor` in this process and behind `MultiprocExecutor` (one
  ``iwg-worker`` process, calls through the shared-memory ring, each step's stream message back over ipc),
  ``--executor-streams`` requests (the prompts' last ``--executor-prompt-tokens`` tokens, so that decode
  steps, not prefill, make most of the time) opened at once through `Executor.open_stream` and read to the
  end. The two alternate for ``--executor-rounds`` rounds; a step is one stream message (every running request's new
  tokens), counted where the executor hands it to its `StreamHub`. Reported: seconds per step and tokens/s
  of each, and Multiproc / UniProc per-step time.

``--tp-streams N`` adds a row: `iwg serve` with worldSize 3 (SmolLM2 sharded three ways over gloo, three
worker processes) against worldSize 1, both at N streams in the same run, one after the other. On a quiet
machine of few cores sharding is no speed-up and the ratio is what the per-step all-reduces and request
broadcast cost; `iwg serve` gives each worker cores / (replicas x worldSize) torch threads, so the two rows
also differ in threads per process. ``--only-tp`` runs just those two.

Prompts are 32 to 512 tokens; every request generates exactly ``--output-tokens`` tokens (greedy,
end-of-sequence ignored). Reported per concurrency: output tokens/s, time to first token and inter-token
latency (p50, p99), and the ratios iwg/direct and iwg/one-at-a-time.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import tempfile
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
PROMPT_TOKENS = (32, 64, 128, 256, 512)
PAGE_SIZE = 64
KV_BLOCKS = 704  # 64 streams of up to 512 + 128 tokens fit at once
MAX_BATCH_TOKENS = 1024  # the engine's CPU default


@dataclass
class Run:
    tokens: int = 0
    seconds: float = 0.0
    ttft: list[float] = field(default_factory=list)
    itl: list[float] = field(default_factory=list)

    @property
    def rate(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def make_prompts(tokenizer: Any, count: int) -> list[list[int]]:
    base = tokenizer("The operator schedules inference workers onto nodes with free accelerators. ")[
        "input_ids"
    ]
    prompts = []
    for i in range(count):
        size = PROMPT_TOKENS[i % len(PROMPT_TOKENS)]
        ids = (base * (size // len(base) + 1))[: size - 1]
        prompts.append([*ids, 100 + i])  # distinct prompts
    return prompts


def run_direct(model: Any, prompts: list[list[int]], output_tokens: int) -> Run:
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    cb = ContinuousBatchingConfig(
        page_size=PAGE_SIZE,
        num_blocks=KV_BLOCKS,
        max_batch_tokens=MAX_BATCH_TOKENS,
        use_async_batching=False,
        auto_switch_to_flash=False,
        allow_block_sharing=False,
    )
    manager = model.init_continuous_batching(
        generation_config=GenerationConfig(do_sample=False, max_new_tokens=output_tokens, eos_token_id=-1),
        continuous_batching_config=cb,
    )
    manager.start()
    while manager.batch_processor is None:  # the cache is allocated on the engine's thread: not timed
        time.sleep(0.01)
    run = Run()
    seen: dict[str, int] = {}
    last: dict[str, float] = {}
    try:
        started = time.monotonic()
        ids = [
            manager.add_request(p, max_new_tokens=output_tokens, streaming=True, eos_token_id=-1)
            for p in prompts
        ]
        done = 0
        while done < len(ids):
            out = manager.get_result(timeout=600)
            if out is None:
                raise RuntimeError("the direct engine stopped")
            now = time.monotonic()
            count = len(out.generated_tokens)
            new = count - seen.get(out.request_id, 0)
            if new > 0:
                if out.request_id not in seen:
                    run.ttft.append(now - started)
                else:
                    run.itl.append((now - last[out.request_id]) / new)
                seen[out.request_id] = count
                last[out.request_id] = now
            if out.is_finished():
                done += 1
        run.seconds = time.monotonic() - started
        run.tokens = sum(seen.values())
    finally:
        manager.stop(block=True, timeout=30)
    return run


def run_serial(model: Any, prompts: list[list[int]], output_tokens: int) -> Run:
    import torch

    run = Run()
    started = time.monotonic()
    with torch.no_grad():
        for prompt in prompts:
            out = model.generate(
                torch.tensor([prompt]),
                attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                max_new_tokens=output_tokens,
                min_new_tokens=output_tokens,
                do_sample=False,
                pad_token_id=0,
            )
            run.tokens += out.shape[1] - len(prompt)
    run.seconds = time.monotonic() - started
    return run


async def sse_chunks(session: Any, url: str, body: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
    """The chunks of a streamed completion (server-sent events), as they come."""
    async with session.post(url, json=body) as resp:
        assert resp.status == 200, await resp.text()
        async for raw in resp.content:
            line = raw.decode().strip()
            if line.startswith("data: {"):
                yield json.loads(line[6:])


async def run_serve(
    url: str, prompts: list[list[int]], output_tokens: int, chat: list[str] | None = None
) -> Run:
    """Streamed completions of ``prompts``; or, given ``chat``, streamed chat completions of those texts."""
    import aiohttp

    run = Run()
    path = "/v1/chat/completions" if chat is not None else "/v1/completions"

    async def one(session: aiohttp.ClientSession, index: int, started: float) -> int:
        request: dict[str, Any] = (
            {"messages": [{"role": "user", "content": chat[index]}]}
            if chat is not None
            else {"prompt": prompts[index]}
        )
        body = {
            "model": "smollm2",
            **request,
            "max_tokens": output_tokens,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        last = None
        tokens = 0
        async for chunk in sse_chunks(session, f"{url}{path}", body):
            now = time.monotonic()
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
                continue
            if last is None:
                run.ttft.append(now - started)
            else:
                run.itl.append(now - last)
            last = now
        return tokens

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=1800)) as session:
        started = time.monotonic()
        counts = await asyncio.gather(*(one(session, i, started) for i in range(len(prompts))))
        run.seconds = time.monotonic() - started
    run.tokens = sum(counts)
    return run


@dataclass
class StepRun:
    steps: int = 0
    tokens: int = 0
    seconds: float = 0.0

    @property
    def step_s(self) -> float:
        return self.seconds / self.steps if self.steps else float("nan")

    def add(self, other: StepRun) -> None:
        self.steps += other.steps
        self.tokens += other.tokens
        self.seconds += other.seconds


async def run_executor(executor: Any, prompts: list[list[int]], output_tokens: int, tag: str) -> StepRun:
    """Open every prompt's stream through ``executor`` at once and read them to the end; steps are the
    stream messages the executor's hub receives meanwhile."""
    hub = executor.streams
    steps = 0
    deliver = hub.deliver

    def counting(replica: int, items: list[dict[str, Any]]) -> None:
        nonlocal steps
        steps += 1
        deliver(replica, items)

    hub.deliver = counting  # an instance attribute: this run only
    tokens = 0

    async def one(i: int, prompt: list[int]) -> None:
        nonlocal tokens
        request = {
            "id": f"{tag}-{i}",
            "prompt_ids": prompt,
            "max_tokens": output_tokens,
            "temperature": 0,
            "ignore_eos": True,
        }
        stream, answer = await executor.open_stream(request, replica=0, timeout=60)
        assert answer["ok"], answer
        async for item in stream:
            tokens += len(item["tokens"])

    try:
        started = time.monotonic()
        await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
        seconds = time.monotonic() - started
    finally:
        del hub.deliver
    return StepRun(steps, tokens, seconds)


def executor_overhead(
    model_dir: Path, prompts: list[list[int]], output_tokens: int, rounds: int
) -> tuple[StepRun, StepRun]:
    """(UniProc, Multiproc) totals over ``rounds`` alternating rounds, the same engine behind each."""
    from iwg_worker.executor.multiproc import MultiprocExecutor
    from iwg_worker.executor.uniproc import UniProcExecutor
    from iwg_worker.worker_base import WorkerConfig

    blocks = len(prompts) * -(-(max(map(len, prompts)) + output_tokens) // PAGE_SIZE)
    config = WorkerConfig(
        task="generate",
        model_path=str(model_dir),
        served_name="smollm2",
        device="cpu",
        dtype="float32",
        group="bench",
        kv_cache_blocks=blocks,
    )
    uni = UniProcExecutor(config)
    multi = None
    try:
        multi = MultiprocExecutor(config, extra_env={"HF_HUB_OFFLINE": "1"})
        totals = {"uni": StepRun(), "multi": StepRun()}
        for executor in (uni, multi):  # warm-up, not counted
            asyncio.run(run_executor(executor, prompts[:2], 4, "warm"))
        for r in range(rounds):
            for name, executor in (("uni", uni), ("multi", multi)):
                run = asyncio.run(run_executor(executor, prompts, output_tokens, f"{name}{r}"))
                print(
                    f"# round {r} {name}: {run.steps} steps, {run.tokens} tokens in {run.seconds:.1f} s "
                    f"({run.step_s * 1e3:.1f} ms/step)",
                    flush=True,
                )
                totals[name].add(run)
    finally:
        uni.shutdown()
        if multi is not None:
            multi.shutdown()
    return totals["uni"], totals["multi"]


def row(name: str, streams: int, run: Run, ratios: str) -> str:
    ms = 1000.0
    return (
        f"| {name} | {streams} | {run.rate:.1f} | {pct(run.ttft, 0.5) * ms:.0f} | {pct(run.ttft, 0.99) * ms:.0f} "
        f"| {pct(run.itl, 0.5) * ms:.1f} | {pct(run.itl, 0.99) * ms:.1f} | {ratios} |"
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--streams", default="1,8,32,64")
    parser.add_argument("--output-tokens", type=int, default=128)
    parser.add_argument("--serial-prompts", type=int, default=4)
    parser.add_argument("--tp-streams", type=int, default=8, help="streams of the worldSize 3 row (0: none)")
    parser.add_argument("--only-tp", action="store_true", help="only worldSize 3 against worldSize 1")
    parser.add_argument("--executor-streams", type=int, default=32)
    parser.add_argument("--executor-prompt-tokens", type=int, default=64)
    parser.add_argument("--executor-output-tokens", type=int, default=32)
    parser.add_argument("--executor-rounds", type=int, default=2, help="0: no executor rows")
    parser.add_argument(
        "--executors-only",
        action="store_true",
        help="only the Multiproc / UniProc per-step comparison",
    )
    args = parser.parse_args()
    if args.only_tp:
        tensor_parallel_rows(args.tp_streams, args.output_tokens)
        return
    levels = [int(x) for x in args.streams.split(",")]

    import torch
    from iwg_worker.engine.front import render_chat
    from iwg_worker.models.loading import load_causal_lm, load_tokenizer, model_source

    from tests.iwg_worker.driver import conftest
    from tests.iwg_worker.driver.conftest import start_smollm2
    from tests.models import smollm2_dir

    torch.set_num_threads(os.cpu_count() or 1)
    model_dir = smollm2_dir()
    source = model_source(model_dir)
    tokenizer = load_tokenizer(source)
    prompts = make_prompts(tokenizer, max(*levels, args.executor_streams))
    print(
        f"# SmolLM2-135M-Instruct float32 on CPU ({os.cpu_count()} cores), load average {os.getloadavg()[0]:.1f}"
    )
    print(f"# prompts {PROMPT_TOKENS} tokens (cycled), greedy\n")
    if args.executor_rounds > 0:  # 0: no executor rows
        uni, multi = executor_overhead(
            model_dir,
            [p[-args.executor_prompt_tokens :] for p in prompts[: args.executor_streams]],
            args.executor_output_tokens,
            args.executor_rounds,
        )
        print("\n| executor | streams | steps | output tokens/s | ms per step | per-step vs UniProc |")
        print("|---|---|---|---|---|---|")
        for name, run in (("UniProc (in-process)", uni), ("Multiproc (1 worker process)", multi)):
            print(
                f"| {name} | {args.executor_streams} | {run.steps} | {run.tokens / run.seconds:.1f} "
                f"| {run.step_s * 1e3:.1f} | {run.step_s / uni.step_s:.3f}x |"
            )
        print(
            f"\nMultiproc / UniProc per-step time at {args.executor_streams} streams: "
            f"{multi.step_s / uni.step_s:.3f}x (target <= 1.05x); load average {os.getloadavg()[0]:.1f}\n"
        )
    if args.executors_only:
        return
    print(f"# {args.output_tokens} output tokens each\n")
    model = load_causal_lm(source, torch.float32, attn_implementation="sdpa").eval()
    serial = run_serial(model, prompts[: args.serial_prompts], args.output_tokens)
    direct = {n: run_direct(model, prompts[:n], args.output_tokens) for n in levels}
    # The chat rows' own baseline: the engine on the very prompt tokens the worker renders for those chats.
    texts = [tokenizer.decode(p) for p in prompts]
    chat_prompts = [render_chat(tokenizer, [{"role": "user", "content": t}]) for t in texts]
    direct_chat = {n: run_direct(model, chat_prompts[:n], args.output_tokens) for n in levels}
    del model
    conftest.STARTUP_TIMEOUT_S = 900.0  # a loaded machine starts the group slowly; the bench waits
    with tempfile.TemporaryDirectory() as tmp:
        served = start_smollm2(Path(tmp), dict(os.environ), kv_blocks=KV_BLOCKS)
        proc, url = served.process, served.url
        try:
            asyncio.run(run_serve(url, prompts[:2], 8))  # warm-up
            served = {n: asyncio.run(run_serve(url, prompts[:n], args.output_tokens)) for n in levels}
            chats = {
                n: asyncio.run(run_serve(url, prompts[:n], args.output_tokens, chat=texts[:n]))
                for n in levels
            }
        finally:
            proc.terminate()
            proc.wait(60)
    print(
        "| path | streams | output tokens/s | TTFT p50 ms | TTFT p99 ms | ITL p50 ms | ITL p99 ms | ratio |"
    )
    print("|---|---|---|---|---|---|---|---|")
    print(row("one prompt at a time", 1, serial, "1.00x (baseline)"))
    for n in levels:
        print(
            row(
                "transformers CB, direct",
                n,
                direct[n],
                f"{direct[n].rate / serial.rate:.2f}x of one-at-a-time",
            )
        )
        print(
            row(
                "iwg serve (HTTP, SSE)",
                n,
                served[n],
                f"{served[n].rate / direct[n].rate:.2f}x of direct; {served[n].rate / serial.rate:.2f}x of one-at-a-time",
            )
        )
        print(
            row(
                "transformers CB, direct, chat prompts",
                n,
                direct_chat[n],
                f"{direct_chat[n].rate / serial.rate:.2f}x of one-at-a-time",
            )
        )
        print(
            row(
                "iwg serve, chat (HTTP, SSE)",
                n,
                chats[n],
                f"{chats[n].rate / direct_chat[n].rate:.2f}x of direct on chat prompts; "
                f"{chats[n].rate / serial.rate:.2f}x of one-at-a-time",
            )
        )
    print(f"\n# load average at the end {os.getloadavg()[0]:.1f}")
    if args.tp_streams:
        print()
        tensor_parallel_rows(args.tp_streams, args.output_tokens)


def serve_rate(world_size: int, prompts: list[list[int]], output_tokens: int) -> Run:
    from tests.iwg_worker.driver.conftest import start_smollm2

    with tempfile.TemporaryDirectory() as tmp:
        served = start_smollm2(Path(tmp), dict(os.environ), kv_blocks=KV_BLOCKS, world_size=world_size)
        try:
            asyncio.run(run_serve(served.url, prompts[:2], 8))  # warm-up
            return asyncio.run(run_serve(served.url, prompts, output_tokens))
        finally:
            served.process.terminate()
            served.process.wait(60)


def tensor_parallel_rows(streams: int, output_tokens: int) -> None:
    """worldSize 3 against worldSize 1 through `iwg serve`, same prompts, one after the other."""
    from iwg_worker.models.loading import load_tokenizer, model_source

    from tests.models import smollm2_dir

    prompts = make_prompts(load_tokenizer(model_source(smollm2_dir())), streams)
    print(
        f"# worldSize 3 against 1: {streams} streams, {output_tokens} output tokens, {os.cpu_count()} cores"
    )
    print(
        "| path | streams | output tokens/s | TTFT p50 ms | TTFT p99 ms | ITL p50 ms | ITL p99 ms | ratio |"
    )
    print("|---|---|---|---|---|---|---|---|")
    one = serve_rate(1, prompts, output_tokens)
    three = serve_rate(3, prompts, output_tokens)
    print(row("iwg serve, worldSize 1", streams, one, "1.00x (baseline)"))
    print(
        row(
            "iwg serve, worldSize 3 (sharded)",
            streams,
            three,
            f"{three.rate / one.rate:.2f}x of worldSize 1",
        )
    )
    print(f"\n# load average at the end {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
