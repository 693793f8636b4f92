"""Issue 27's table: output tokens/s of grammar-constrained against unconstrained decoding, 8 and 32 streams.

    python -m bench.structured [--engine transformers|vllm] [--streams 8,32] [--output-tokens 128]

`iwg serve` of SmolLM2-135M-Instruct (its converted directory) on the engine named, started once. Per stream
count: that many streamed chat completions at once, unconstrained (greedy, end-of-sequence ignored), then the
same with a JSON schema (`response_format` json_schema: an array of at least 64 short strings, so that every
stream decodes all ``--output-tokens`` tokens under the grammar). Printed: output tokens/s of each and the
ratio constrained / unconstrained (target >= 0.8). The first constrained request, which builds xgrammar's
tokenizer index, is sent before measuring.

Figures need a quiet machine: nothing else running. Not run for figures yet.
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.generate import sse_chunks
from tests.iwg_worker.driver.conftest import start_smollm2, stop, subprocess_env

SCHEMA = {"type": "array", "items": {"type": "string", "maxLength": 16}, "minItems": 64}
FORMAT = {"type": "json_schema", "json_schema": {"name": "words", "schema": SCHEMA}}


async def one(session: Any, url: str, index: int, tokens: int, constrained: bool) -> int:
    body: dict[str, Any] = {
        "model": "smollm2",
        "messages": [{"role": "user", "content": f"List {index + 64} words about the sea."}],
        "max_tokens": tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    body |= {"response_format": FORMAT} if constrained else {"ignore_eos": True}
    count = 0
    async for chunk in sse_chunks(session, f"{url}/v1/chat/completions", body):
        if chunk.get("usage"):
            count = int(chunk["usage"]["completion_tokens"])
    return count


async def rate(url: str, streams: int, tokens: int, constrained: bool) -> float:
    import aiohttp

    async with aiohttp.ClientSession() as session:
        started = time.monotonic()
        counts = await asyncio.gather(*(one(session, url, i, tokens, constrained) for i in range(streams)))
        return sum(counts) / (time.monotonic() - started)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--engine", default="transformers", choices=["transformers", "vllm"])
    parser.add_argument("--streams", default="8,32")
    parser.add_argument("--output-tokens", type=int, default=128)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        served = start_smollm2(Path(tmp), {**subprocess_env(), "OMP_NUM_THREADS": "2"}, engine=args.engine)
        try:
            asyncio.run(rate(served.url, 1, 8, True))  # xgrammar's tokenizer index, built once
            print(f"engine {args.engine}, {args.output_tokens} output tokens per stream")
            print("| streams | unconstrained tok/s | constrained tok/s | ratio |\n|---|---|---|---|")
            for streams in (int(s) for s in args.streams.split(",")):
                plain = asyncio.run(rate(served.url, streams, args.output_tokens, False))
                constrained = asyncio.run(rate(served.url, streams, args.output_tokens, True))
                print(f"| {streams} | {plain:.1f} | {constrained:.1f} | {constrained / plain:.2f}x |")
        finally:
            stop(served.process)


if __name__ == "__main__":
    main()
