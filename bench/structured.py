"""Issue 27's table: output tokens/s of grammar-constrained against unconstrained decoding, 8 and 32 streams,
per server, vLLM's own server beside iwg's.

    python -m bench.structured [--servers iwg-transformers,iwg-vllm,vllm-serve] [--streams 8,32]
                               [--output-tokens 128] [--dtype float32] [--enforce-eager]

Each server in turn (never two at once), started by bench.engines' helpers (the same environment, cores, KV
cache and vLLM settings as the engines table): `iwg serve` of SmolLM2-135M-Instruct (its converted
directory) on the engine named, and ``vllm-serve``, vLLM's own OpenAI server on the same directory. Per stream
count: that many streamed chat completions at once, unconstrained (greedy, end-of-sequence ignored), then the
same with a JSON schema (`response_format` json_schema: an array of at least 64 short strings, so that every
stream decodes all ``--output-tokens`` tokens under the grammar; ``--unbounded-strings``: the same without the
strings' maxLength). Printed: output tokens/s of each and the
ratio constrained / unconstrained (target >= 0.8; vLLM's own ratio is the peer's). The first constrained
request, which builds xgrammar's tokenizer index, is sent before measuring.

Figures need a quiet machine: nothing else running.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.generate import sse_chunks

SCHEMA: dict[str, Any] = {"type": "array", "items": {"type": "string", "maxLength": 16}, "minItems": 64}
# --unbounded-strings: the same without maxLength, where xgrammar's masks cost next to nothing.
UNBOUNDED: dict[str, Any] = {"type": "array", "items": {"type": "string"}, "minItems": 64}


async def one(session: Any, url: str, index: int, tokens: int, schema: dict[str, Any] | None) -> int:
    """One streamed chat completion's output tokens: constrained to ``schema``, or (None) unconstrained."""
    body: dict[str, Any] = {
        "model": "smollm2",
        "messages": [{"role": "user", "content": f"List {index + 64} words about the sea."}],
        "max_tokens": tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if schema is None:
        body["ignore_eos"] = True
    else:
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": "words", "schema": schema}}
    count = 0
    async for chunk in sse_chunks(session, f"{url}/v1/chat/completions", body):
        if chunk.get("usage"):
            count = int(chunk["usage"]["completion_tokens"])
    return count


async def rate(url: str, streams: int, tokens: int, schema: dict[str, Any] | None) -> float:
    import aiohttp

    async with aiohttp.ClientSession() as session:
        started = time.monotonic()
        counts = await asyncio.gather(*(one(session, url, i, tokens, schema) for i in range(streams)))
        return sum(counts) / (time.monotonic() - started)


def main() -> None:
    from bench import engines

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--servers", default="iwg-transformers,iwg-vllm,vllm-serve")
    parser.add_argument("--streams", default="8,32")
    parser.add_argument("--output-tokens", type=int, default=128)
    parser.add_argument("--dtype", default="float32", choices=("bfloat16", "float16", "float32"))
    parser.add_argument("--enforce-eager", action="store_true", help="both vLLM servers skip torch.compile")
    parser.add_argument("--startup-timeout", type=float, default=900.0)
    parser.add_argument(
        "--unbounded-strings", action="store_true", help="the schema's strings without maxLength"
    )
    args = parser.parse_args()
    args.device = "cpu"
    schema = UNBOUNDED if args.unbounded_strings else SCHEMA
    levels = [int(s) for s in args.streams.split(",")]
    from tests.models import smollm2_dir

    model_dir = smollm2_dir()
    vllm_blocks = engines.vllm_fit(model_dir, engines.VLLM_BLOCK_TOKENS, max(levels), args.output_tokens)
    tf_blocks = max(
        16, max(levels) * engines.blocks_per_stream(engines.TRANSFORMERS_PAGE, args.output_tokens)
    )
    print(
        f"# SmolLM2-135M-Instruct {args.dtype}, {args.output_tokens} output tokens per stream, "
        f"{'eager' if args.enforce_eager else 'compiled'} vLLM, load average {os.getloadavg()[0]:.1f}, "
        f"{time.strftime('%Y-%m-%d %H:%M:%S %Z')}"
    )
    print("| server | streams | unconstrained tok/s | constrained tok/s | ratio |\n|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.servers.split(","):
            if name == "vllm-serve":
                server = engines.start_vllm_serve(args, Path(tmp), model_dir, vllm_blocks)
            else:
                engine = name.removeprefix("iwg-").removesuffix("-inprocess")
                blocks = vllm_blocks if engine == "vllm" else tf_blocks
                server = engines.start_iwg(engine, args, Path(tmp), blocks, name.endswith("-inprocess"))
            try:
                asyncio.run(rate(server.url, 1, 8, schema))  # xgrammar's tokenizer index, built once
                for streams in levels:
                    plain = asyncio.run(rate(server.url, streams, args.output_tokens, None))
                    constrained = asyncio.run(rate(server.url, streams, args.output_tokens, schema))
                    print(
                        f"| {name} | {streams} | {plain:.1f} | {constrained:.1f} | {constrained / plain:.2f}x |",
                        flush=True,
                    )
            finally:
                engines.stop(server)


if __name__ == "__main__":
    main()
