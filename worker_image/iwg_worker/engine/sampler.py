"""Per-request sampling inside transformers' continuous batching: temperature, top-k, top-p, a seed, logprobs.

transformers' engine samples every row of a step with one global setting and the process's global random
generator, so a seeded request would draw different tokens depending on what it was batched with. This
logits processor decides each row's token itself and hands the engine a one-hot score row, which the engine's
greedy pick (``do_sample=False``) takes as is. A row's random draw comes from a generator seeded by the
request's seed and the token's position, so the same seeded request gives the same tokens whatever shares its
step. The log-probabilities of the chosen and the top tokens (of the model's own distribution, before
temperature and filtering, as OpenAI reports them) are kept per request for the engine's output path.

A request with a JSON schema (structured outputs) has an xgrammar `GrammarMatcher`: its row's logits are
masked by the matcher's token bitmask before the choice (xgrammar fills and applies the masks of a step's
constrained rows together), and the chosen token advances the matcher. Unconstrained rows are not touched.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

import torch
from transformers.generation.continuous_batching.cb_logits_processors import (
    ContinuousBatchingLogitsProcessor,
    ContinuousBatchingLogitsProcessorList,
)
from transformers.generation.logits_process import LogitsProcessorList

from iwg_worker.engine.requests import SamplingParams

PARAMS_KEY = "iwg_sampling"
_MIX = 0x9E3779B97F4A7C15
_MASK63 = (1 << 63) - 1


@dataclass(slots=True)
class TokenLogprobs:
    logprob: float
    top: list[tuple[int, float]]


class RequestSampler(ContinuousBatchingLogitsProcessor):
    """Chooses every row's token; the request's `SamplingParams` travel in its logit-processor kwargs."""

    supported_kwargs: dict[str, type] = {PARAMS_KEY: SamplingParams}  # noqa: RUF012 - the engine's own API
    ignored_kwargs: tuple[str, ...] = ()

    def __init__(self) -> None:
        self._rows: list[tuple[str, SamplingParams, int]] = []
        self._lock = threading.Lock()
        self.logprobs: dict[str, list[TokenLogprobs]] = {}
        self.keep_logprobs = True
        self._matchers: dict[str, Any] = {}  # request id -> its grammar's matcher (constrained requests)
        self._bitmask: torch.Tensor | None = None

    def constrain(self, request_id: str, matcher: Any) -> None:
        """Constrain a request's tokens by an xgrammar matcher (before the request enters the engine)."""
        with self._lock:
            self._matchers[request_id] = matcher

    def fill_defaults(self, int32_tensor: torch.Tensor) -> None:
        int32_tensor.zero_()

    def prepare_tensor_args(self, requests_with_new_token: list[Any]) -> torch.Tensor:
        # Rows of the coming step, in the order the engine lays out their logits.
        self._rows = [
            (
                r.state.request_id,
                r.state.logit_processor_kwargs.get(PARAMS_KEY) or SamplingParams(temperature=0.0),
                r.state.generated_len(),
            )
            for r in requests_with_new_token
        ]
        return torch.zeros(len(self._rows), dtype=torch.int32)

    def __call__(self, scores: torch.Tensor, tensor_arg: torch.Tensor) -> torch.Tensor:
        rows = self._rows
        n = min(len(rows), scores.size(0))
        logits = scores[:n].float()
        log_probs: torch.Tensor | None = None
        if self.keep_logprobs and any(p.logprobs or p.top_logprobs for _, p, _ in rows[:n]):
            log_probs = torch.log_softmax(logits, dim=-1)
        with self._lock:
            matchers = [self._matchers.get(request_id) for request_id, _, _ in rows[:n]]
        if any(m is not None for m in matchers):
            logits = self._mask(logits, matchers)
        chosen = torch.argmax(logits, dim=-1)
        for i, (_request_id, params, position) in enumerate(rows[:n]):
            if not params.greedy:
                chosen[i] = _sample(logits[i], params, position)
        if log_probs is not None:
            with self._lock:
                for i, (request_id, params, _) in enumerate(rows[:n]):
                    if params.logprobs or params.top_logprobs:
                        self.logprobs.setdefault(request_id, []).append(
                            _token_logprobs(log_probs[i], int(chosen[i]), params.top_logprobs)
                        )
        for i, m in enumerate(matchers):
            if m is not None and not m.is_terminated():
                m.accept_token(int(chosen[i]))
        out = torch.full_like(scores, float("-inf"))
        out[torch.arange(n), chosen] = 0.0
        return out

    def _mask(self, logits: torch.Tensor, matchers: list[Any]) -> torch.Tensor:
        """The logits with each constrained row's disallowed tokens at -inf (xgrammar's bitmask)."""
        import xgrammar as xgr

        vocab = logits.size(-1)
        if self._bitmask is None or self._bitmask.size(0) < len(matchers):
            self._bitmask = xgr.allocate_token_bitmask(max(len(matchers), 64), vocab)
        bitmask = self._bitmask[: len(matchers)]
        rows = []
        for i, m in enumerate(matchers):
            if m is not None and not m.is_terminated():
                m.fill_next_token_bitmask(bitmask, i)
                rows.append(i)
        if rows:
            logits = logits.clone()
            xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=vocab, indices=rows)
        return logits

    def take_logprobs(self, request_id: str, count: int) -> list[TokenLogprobs]:
        """The first ``count`` recorded entries of a request (removed), in token order."""
        with self._lock:
            entries = self.logprobs.get(request_id, [])
            taken, self.logprobs[request_id] = entries[:count], entries[count:]
            return taken

    def forget(self, request_id: str) -> None:
        with self._lock:
            self.logprobs.pop(request_id, None)
            self._matchers.pop(request_id, None)


def _sample(logits: torch.Tensor, params: SamplingParams, position: int) -> torch.Tensor:
    scores = logits / params.temperature
    if 0 < params.top_k < scores.size(-1):
        threshold = torch.topk(scores, params.top_k).values[-1]
        scores = scores.masked_fill(scores < threshold, float("-inf"))
    if params.top_p < 1.0:
        ordered, order = torch.sort(scores, descending=True)
        cumulative = torch.softmax(ordered, dim=-1).cumsum(dim=-1)
        drop = (
            cumulative - torch.softmax(ordered, dim=-1) >= params.top_p
        )  # keeps the token that crosses top_p
        scores = scores.masked_fill(drop.scatter(0, order, drop), float("-inf"))
    generator = torch.Generator(device=scores.device)
    generator.manual_seed(((params.seed & _MASK63) * _MIX + position) & _MASK63)
    return torch.multinomial(torch.softmax(scores, dim=-1), 1, generator=generator)[0]


def _token_logprobs(log_probs: torch.Tensor, token: int, top: int) -> TokenLogprobs:
    pairs: list[tuple[int, float]] = []
    if top:
        values, ids = torch.topk(log_probs, top)
        pairs = [(int(t), float(v)) for t, v in zip(ids.tolist(), values.tolist(), strict=True)]
    return TokenLogprobs(float(log_probs[token]), pairs)


def sampler_list(sampler: RequestSampler) -> ContinuousBatchingLogitsProcessorList:
    """The engine's processor list holding only `sampler`, with the one argument row it reserves."""
    processors = ContinuousBatchingLogitsProcessorList(LogitsProcessorList([sampler]))
    processors.tensors_required = 1
    return processors
