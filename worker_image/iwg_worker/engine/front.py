"""`RequestFront`: what both generation engines do with requests before their engine sees them.

A request map from the driver is checked and tokenized by `parse_request` (the same 400s naming the field on
either engine), its chat messages rendered with the model's chat template, and the engine's `_admit` takes
the checked request or refuses it; `add` answers each request in order. Stream items decode tokens with the
same helpers, so both engines spell text and logprob tokens alike.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

from iwg_worker.engine.requests import GenerationRequest, ModelLimits, RequestRejected, parse_request


def render_chat(tokenizer: Any, messages: list[dict[str, str]]) -> list[int]:
    """A chat's prompt tokens: the model's own chat template, with the assistant's turn opened."""
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


class RequestFront(ABC):
    tokenizer: Any
    limits: ModelLimits

    @property
    @abstractmethod
    def is_driver(self) -> bool:
        """Whether this rank admits requests (always with one rank; rank 0 of a sharded replica)."""

    @abstractmethod
    def _admit(self, request: GenerationRequest) -> None:
        """Hand a checked request to the engine, or raise RequestRejected."""

    def _tokenize(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=True)["input_ids"])

    def _render_chat(self, messages: list[dict[str, str]]) -> list[int]:
        return render_chat(self.tokenizer, messages)

    def _decode(self, ids: list[int]) -> str:
        if self.tokenizer is None:
            return ""  # a model without a tokenizer streams token ids only
        return str(self.tokenizer.decode(ids, skip_special_tokens=True))

    def _token_text(self, token: int) -> str:
        """One token's own text, special tokens spelt out (what logprobs name a token by)."""
        if self.tokenizer is None:
            return str(token)
        return str(self.tokenizer.decode([token], skip_special_tokens=False))

    def add(self, raw_requests: Any) -> list[dict[str, Any]]:
        """Admit requests; one answer each, in order: ``{id, ok: true, prompt_tokens}`` (and ``prompt_text``,
        the prompt decoded, when the request asks for ``echo``) or ``{id, ok: false, error: {param, message,
        code}}``. A refused request never reaches the engine. On a rank other than a sharded replica's rank 0:
        nothing (the requests reach this rank from rank 0 at the next step)."""
        if not isinstance(raw_requests, list):
            raise TypeError("engine_add takes a list of request maps")
        if not self.is_driver:
            return []
        answers: list[dict[str, Any]] = []
        tokenize = self._tokenize if self.tokenizer is not None else None
        chat = self._render_chat if getattr(self.tokenizer, "chat_template", None) else None
        for raw in raw_requests:
            request_id = raw.get("id") if isinstance(raw, dict) else None
            try:
                request = parse_request(raw, self.limits, tokenize, chat)
                self._admit(request)
            except RequestRejected as exc:
                answers.append({"id": request_id, "ok": False, "error": exc.as_dict()})
                continue
            answer: dict[str, Any] = {
                "id": request.request_id,
                "ok": True,
                "prompt_tokens": len(request.prompt_ids),
            }
            if request.echo:
                answer["prompt_text"] = self._decode(list(request.prompt_ids))
            answers.append(answer)
        return answers
