"""A running request's output on the worker: new tokens -> text deltas, stop strings, the finish reason.

Each engine step the engine hands every request that produced a token to its `RequestStream`, which turns the
tokens so far into the next stream item (a msgpack map, the wire's ``stream`` item):

``{id, tokens, text, logprobs, token_texts, top_logprobs, finish_reason, error}``

- ``tokens``/``text``: what is new since the last item. Text that could still turn out to start a stop string,
  or that ends inside a multi-byte character, is held back until the next token decides it.
- a stop string found while decoding ends the request there (``finish_reason`` ``stop``): the text before it is
  returned, and only the tokens that text came from are returned and counted.
- ``logprobs``: per returned token its logprob, ``token_texts`` its own text (special tokens spelt out, as the
  client's logprobs name them) and, when asked, ``top_logprobs`` ``[[id, logprob, text], ...]``; all three nil
  unless the request asked for logprobs.
- a failed request's last item carries ``error`` (the reason) and ``error_code``: ``replica_failure`` when the
  engine failed as a whole (its step raised, e.g. a collective whose peer rank died, or it is stopping), so
  the driver may run the request again on another replica; nil when this request alone failed.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from iwg_worker.engine.requests import GenerationRequest
from iwg_worker.engine.sampler import TokenLogprobs

Decode = Callable[[list[int]], str]
TokenText = Callable[[int], str]
_REPLACEMENT = "\ufffd"
# Tokens decoded again before the new ones each step: the context a tokenizer's decode of a piece may depend
# on (a leading space, a character split over tokens). Decoding only this window keeps a step's cost
# independent of how long the output already is.
DECODE_WINDOW = 6


class RequestStream:
    def __init__(
        self,
        request: GenerationRequest,
        decode: Decode,
        eos_token_ids: frozenset[int],
        token_text: TokenText = str,
    ) -> None:
        self.request = request
        self._decode = decode
        self._token_text = token_text
        self._eos = eos_token_ids
        self.sent_tokens = 0  # tokens returned so far
        self.sent_chars = 0  # characters of text returned so far
        self.finished = False
        self._settled_tokens = 0  # the text of the first this many tokens is `_settled_text`
        self._settled_text = ""

    def update(
        self,
        generated: list[int],
        engine_finished: bool,
        take_logprobs: Callable[[int], list[TokenLogprobs]] | None,
    ) -> tuple[dict[str, Any] | None, bool]:
        """The item for this step (None: nothing to send yet) and whether the request must stop now."""
        params = self.request.params
        text = self._text(generated)
        stop_at = _find_stop(text, params.stop, self.sent_chars)
        finish: str | None = None
        if stop_at is not None:
            text, finish = text[:stop_at], "stop"
            generated = generated[: self._tokens_for(generated, stop_at)]
        elif engine_finished:
            last = generated[-1] if generated else None
            # An end-of-sequence token ends a request only when it does not ignore them: one that does and
            # was cut at max_tokens on an EOS finished by length (as vLLM reports it).
            eos = frozenset() if params.ignore_eos else self._eos
            hit_stop_token = last is not None and (last in params.stop_token_ids or last in eos)
            finish = "stop" if hit_stop_token else "length"
        if finish is None:
            ready = len(text) - _held_back(text, params.stop)
            new_text = text[self.sent_chars : max(self.sent_chars, ready)]
            new_tokens = generated[self.sent_tokens :] if new_text or not params.stop else []
        else:
            new_text = text[self.sent_chars :]
            new_tokens = generated[self.sent_tokens :]
        if finish is None and not new_tokens and not new_text:
            return None, False
        item: dict[str, Any] = {
            "id": self.request.request_id,
            "tokens": new_tokens,
            "text": new_text,
            "logprobs": None,
            "token_texts": None,
            "top_logprobs": None,
            "finish_reason": finish,
            "error": None,
        }
        if take_logprobs is not None:
            entries = take_logprobs(len(new_tokens))
            item["logprobs"] = [e.logprob for e in entries]
            item["token_texts"] = [self._token_text(t) for t in new_tokens[: len(entries)]]
            if params.top_logprobs:
                item["top_logprobs"] = [[[t, lp, self._token_text(t)] for t, lp in e.top] for e in entries]
        self.sent_tokens += len(new_tokens)
        self.sent_chars += len(new_text)
        self.finished = finish is not None
        return item, finish is not None and not engine_finished

    def _text(self, generated: list[int]) -> str:
        """The text of ``generated``: the settled text of the tokens seen before, and the new tokens decoded
        with a few tokens before them (the text those few make is taken off again)."""
        settled = min(self._settled_tokens, len(generated))
        start = max(0, settled - DECODE_WINDOW)
        before = self._decode(generated[start:settled])
        window = self._decode(generated[start:])
        if (
            settled == self._settled_tokens
            and window.startswith(before)
            and not before.endswith(_REPLACEMENT)
        ):
            text = self._settled_text + window[len(before) :]
        else:  # the window's text does not extend the settled text: decode it all (exact)
            text = self._text(generated)
        if not text.endswith(_REPLACEMENT):  # a character still split over tokens is decided next time
            self._settled_tokens, self._settled_text = len(generated), text
        return text

    def failed(self, message: str, code: str | None = None) -> dict[str, Any]:
        self.finished = True
        return self.failed_item(self.request.request_id, message, code)

    @staticmethod
    def failed_item(request_id: str, message: str, code: str | None = None) -> dict[str, Any]:
        """The last item of a request that failed: no tokens, the reason in ``error``, ``error_code``
        ``replica_failure`` when the replica failed rather than the request."""
        return {
            "id": request_id,
            "tokens": [],
            "text": "",
            "logprobs": None,
            "token_texts": None,
            "top_logprobs": None,
            "finish_reason": None,
            "error": message,
            "error_code": code,
        }

    def _tokens_for(self, generated: list[int], chars: int) -> int:
        """The fewest leading tokens whose text covers the first ``chars`` characters."""
        for count in range(self.sent_tokens, len(generated) + 1):
            if len(self._decode(generated[:count])) >= chars:
                return count
        return len(generated)


def _find_stop(text: str, stops: tuple[str, ...], sent_chars: int) -> int | None:
    """Where the first stop string starts in ``text`` (only new matches: returned text had none)."""
    if not stops:
        return None
    start = max(0, sent_chars - max(len(s) for s in stops))
    found = [p for p in (text.find(s, start) for s in stops) if p >= 0]
    return min(found) if found else None


def _held_back(text: str, stops: tuple[str, ...]) -> int:
    """Characters at the end of ``text`` to keep back: an incomplete character, or a prefix of a stop string."""
    hold = len(text) - len(text.rstrip(_REPLACEMENT))
    for stop in stops:
        for size in range(min(len(stop) - 1, len(text)), 0, -1):
            if text.endswith(stop[:size]):
                hold = max(hold, size)
                break
    return hold
