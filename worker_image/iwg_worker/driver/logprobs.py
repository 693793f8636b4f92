"""Token logprobs from the engine's stream items, in the two shapes OpenAI's API returns them.

A stream item that asked for logprobs carries, per returned token, its logprob (``logprobs``), its own text
(``token_texts``) and, when top logprobs were asked for, ``top_logprobs`` rows of ``[token id, logprob, text]``
(`iwg_worker.engine.streams`). Completions take the legacy shape (`CompletionLogprobs`: tokens, token_logprobs,
top_logprobs as ``{text: logprob}`` holding the chosen token too, text_offset); chat the newer one (a
`ChatTokenLogprob` per token with its UTF-8 bytes and its top alternatives).
"""

from __future__ import annotations

import math
from typing import Any

from iwg_worker.driver.openai_api import ChatTokenLogprob, CompletionLogprobs, TopLogprob

# JSON has no -inf: a token the model gives no chance is reported at this floor (as vLLM does).
LOGPROB_FLOOR = -9999.0


def _finite(value: float) -> float:
    return value if math.isfinite(value) else LOGPROB_FLOOR


def _rows(item: dict[str, Any]) -> list[tuple[str, float, list[tuple[str, float]]]]:
    """(text, logprob, [(top text, top logprob), ...]) of each token of an item."""
    texts = item.get("token_texts") or []
    values = item.get("logprobs") or []
    tops = item.get("top_logprobs") or [[] for _ in texts]
    return [
        (text, _finite(value), [(t, _finite(v)) for _, v, t in top])
        for text, value, top in zip(texts, values, tops, strict=False)
    ]


def add_completion_logprobs(out: CompletionLogprobs, item: dict[str, Any], offset: int) -> int:
    """Append an item's tokens to ``out`` with text offsets from ``offset``; the offset after them."""
    for text, value, top in _rows(item):
        out.tokens.append(text)
        out.token_logprobs.append(value)
        alternatives = dict(top)
        alternatives.setdefault(text, value)  # OpenAI: the chosen token is always among them
        out.top_logprobs.append(alternatives)
        out.text_offset.append(offset)
        offset += len(text)
    return offset


def chat_logprobs(item: dict[str, Any]) -> list[ChatTokenLogprob]:
    return [
        ChatTokenLogprob(
            token=text,
            logprob=value,
            bytes=list(text.encode("utf-8")),
            top_logprobs=[TopLogprob(token=t, logprob=v, bytes=list(t.encode("utf-8"))) for t, v in top],
        )
        for text, value, top in _rows(item)
    ]
