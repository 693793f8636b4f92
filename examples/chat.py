"""The demos' chat part: one question to a generation group with the official `openai` client
(`chat.completions.create(stream=True)`), its answer printed token by token as it streams in."""

from __future__ import annotations

import time

from openai import OpenAI

QUESTION = "What is the capital of France?"


def stream_chat(api: OpenAI, model: str, question: str = QUESTION, max_tokens: int = 48) -> str:
    """Prints the answer as it arrives, then the time to the first token and the usage; returns the answer."""
    print(f"POST /v1/chat/completions (stream=True, greedy): {question!r}")
    started = time.perf_counter()
    first: float | None = None
    completion_tokens = 0
    answer = ""
    stream = api.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": question}],
        max_tokens=max_tokens,
        temperature=0.0,
        stream=True,
        stream_options={"include_usage": True},
    )
    print("  ", end="", flush=True)
    for chunk in stream:
        if chunk.usage is not None:
            completion_tokens = chunk.usage.completion_tokens
        for choice in chunk.choices:
            piece = choice.delta.content or ""
            if piece and first is None:
                first = time.perf_counter() - started
            answer += piece
            print(piece, end="", flush=True)
    elapsed = time.perf_counter() - started
    print()
    first_ms = f"{first * 1000:.0f} ms" if first is not None else "never"
    print(f"  first token after {first_ms}; {completion_tokens} tokens in {elapsed:.2f} s")
    return answer
