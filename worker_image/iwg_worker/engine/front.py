"""`RequestFront`: what both generation engines do with requests before their engine sees them.

A request map from the driver is checked and tokenized by `parse_request` (the same 400s naming the field on
either engine), its chat messages rendered with the model's chat template, and the engine's `_admit` takes
the checked request or refuses it; `add` answers each request in order. Stream items decode tokens with the
same helpers, so both engines spell text and logprob tokens alike.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
from abc import ABC, abstractmethod
from typing import Any

from iwg_worker.engine.requests import GenerationRequest, ModelLimits, RequestRejected, parse_request
from iwg_worker.engine.streams import RequestStream
from iwg_worker.engine.structured import SchemaCompiler
from iwg_worker.protocol import HERMES, HERMES_TAGS


def tool_call_format(chat_template: str | None) -> str | None:
    """The tool-call format a chat template teaches its model, if this server reads it: ``hermes`` where the
    template renders the tools and writes calls as ``<tool_call>`` blocks (Hermes 2 Pro and 3, Qwen 2.5 and
    3, SmolLM3). None: tool_choice ``auto`` is refused."""
    template = chat_template or ""
    return HERMES if HERMES_TAGS[0] in template and "tools" in template else None


def render_chat(tokenizer: Any, messages: list[dict[str, Any]], tools: list[Any] | None = None) -> list[int]:
    """A chat's prompt tokens: the model's own chat template, with the assistant's turn opened.

    Tools and the tool calls of assistant messages go to the template as transformers passes them (``tools=``,
    ``tool_calls`` with their arguments as objects) when the template reads them; a template that does not
    (SmolLM2's) gets each assistant message's calls as its content, the JSON the model answered them with."""
    template = str(tokenizer.chat_template or "")
    if "tool_calls" in template:
        messages = [_calls_as_objects(m) for m in messages]
    else:
        messages = [_calls_as_content(m) for m in messages]
    extra = {"tools": tools} if tools and "tools" in template else {}
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False, **extra)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def _calls_as_objects(message: dict[str, Any]) -> dict[str, Any]:
    calls = message.get("tool_calls")
    if not calls:
        return message
    out = []
    for call in calls:
        function = dict(call.get("function") or {})
        with contextlib.suppress(TypeError, ValueError):
            function["arguments"] = json.loads(function.get("arguments") or "{}")
        out.append({**call, "function": function})
    return {**message, "tool_calls": out}


def _calls_as_content(message: dict[str, Any]) -> dict[str, Any]:
    calls = message.get("tool_calls")
    if not calls:
        return {k: v for k, v in message.items() if k in ("role", "content")}
    answered = [
        {
            "name": (c.get("function") or {}).get("name"),
            "arguments": (c.get("function") or {}).get("arguments"),
        }
        for c in calls
    ]
    return {"role": message["role"], "content": message.get("content") or json.dumps(answered)}


class RequestFront(ABC):
    tokenizer: Any
    limits: ModelLimits
    eos_token_ids: frozenset[int]
    _schemas: SchemaCompiler | None = None

    @property
    @abstractmethod
    def is_driver(self) -> bool:
        """Whether this rank admits requests (always with one rank; rank 0 of a sharded replica)."""

    @abstractmethod
    def _admit(self, request: GenerationRequest) -> None:
        """Hand a checked request to the engine, or raise RequestRejected."""

    def _tokenize(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=True)["input_ids"])

    def _render_chat(self, messages: list[dict[str, Any]], tools: list[Any] | None) -> list[int]:
        return render_chat(self.tokenizer, messages, tools)

    def _compile(self, request: GenerationRequest) -> GenerationRequest:
        """The request with its JSON schema compiled (xgrammar), or `RequestRejected` naming its field."""
        schema = request.params.json_schema
        if schema is None:
            return request
        if self.tokenizer is None:
            raise RequestRejected(
                request.json_param, "this model has no tokenizer to constrain", "unsupported"
            )
        if self._schemas is None:
            self._schemas = SchemaCompiler(self.tokenizer, self.limits.vocab_size, self.eos_token_ids)
        return dataclasses.replace(request, grammar=self._schemas.compile(schema, request.json_param))

    def _decode(self, ids: list[int]) -> str:
        if self.tokenizer is None:
            return ""  # a model without a tokenizer streams token ids only
        return str(self.tokenizer.decode(ids, skip_special_tokens=True))

    def _stream(self, request: GenerationRequest) -> RequestStream:
        """The stream that turns a request's tokens into its text (special tokens left out, but those it keeps)."""
        decode = self._decode
        if request.keep_token_ids:
            special = frozenset(self.tokenizer.all_special_ids) - request.keep_token_ids

            def decode(ids: list[int]) -> str:
                kept = [i for i in ids if i not in special]
                return str(self.tokenizer.decode(kept, skip_special_tokens=False))

        return RequestStream(request, decode, self.eos_token_ids, self._token_text)

    def tool_call_format(self) -> str | None:
        """The tool-call format of this model's chat template, if read here (None: tool_choice auto is refused)."""
        return tool_call_format(getattr(self.tokenizer, "chat_template", None))

    def _with_tools(self, request: GenerationRequest) -> GenerationRequest:
        """A tool_choice auto request, if this model's chat template calls tools in a format read here; else
        `RequestRejected` naming ``tool_choice``."""
        if not request.tools_auto:
            return request
        if self.tool_call_format() is None:
            raise RequestRejected(
                "tool_choice",
                "tool_choice 'auto' (the default with tools) needs a chat template that renders the tools and "
                "a tool-call format this server reads (hermes: <tool_call> blocks), and this model's template "
                "has none; set spec.model.chatTemplate, or send tool_choice 'required', 'none' or a named "
                "function",
                "unsupported_value",
            )
        tags = [self.tokenizer.convert_tokens_to_ids(tag) for tag in HERMES_TAGS]
        special = frozenset(self.tokenizer.all_special_ids)
        return dataclasses.replace(request, keep_token_ids=frozenset(t for t in tags if t in special))

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
                request = self._compile(self._with_tools(parse_request(raw, self.limits, tokenize, chat)))
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
            if request.tools_auto:
                answer["tool_call_format"] = HERMES
            answers.append(answer)
        return answers
