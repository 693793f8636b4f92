"""One generation request as the engine takes it: prompt, sampling parameters, limits and stop rules.

Requests arrive from the driver as msgpack maps (`parse_request`). Everything a client could get wrong is
checked here, against this model's limits, before the request reaches a batch: a bad request is refused alone
(`RequestRejected`, which names the field), and nothing in it can fail another request or the engine.
"""

from __future__ import annotations

import math
import secrets
from dataclasses import dataclass, field
from typing import Any

MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 256
MAX_STOP_TOKEN_IDS = 64
MAX_TOP_LOGPROBS = 20
SEED_LIMIT = 2**63


class RequestRejected(ValueError):
    """A request this engine will not run; ``param`` names the offending field."""

    def __init__(self, param: str, message: str, code: str = "invalid_value") -> None:
        super().__init__(message)
        self.param = param
        self.code = code

    def as_dict(self) -> dict[str, str]:
        return {"param": self.param, "message": str(self), "code": self.code}


@dataclass(frozen=True, slots=True)
class ModelLimits:
    """What the loaded model accepts: its context length and vocabulary size."""

    context_length: int
    vocab_size: int


@dataclass(frozen=True, slots=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0  # 0 is greedy
    top_p: float = 1.0
    top_k: int = 0  # 0: no limit
    seed: int = 0  # always set: requests without one get a random seed at entry
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: bool = False
    top_logprobs: int = 0
    json_schema: str | None = None  # the output must be JSON valid under this schema (compiled by xgrammar)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass(frozen=True, slots=True)
class GenerationRequest:
    request_id: str
    prompt_ids: tuple[int, ...]
    params: SamplingParams = field(default_factory=SamplingParams)
    echo: bool = False  # the admission answer carries the prompt's text (a token-id prompt echoed back)
    json_param: str = "response_format"  # the client's field the schema came from (what a refusal names)
    grammar: Any = field(default=None, compare=False)  # the schema compiled (xgrammar), set at admission
    tools_auto: bool = False  # tool_choice auto: the model may call the request's tools in its own format
    keep_token_ids: frozenset[int] = frozenset()  # special tokens its text keeps (auto's tool-call tags)
    # The driver's hashes of the prompt's leading blocks (driver.prefix), which the engine reports as stored
    # or evicted with its own blocks at the same positions (engine.kv_events).
    prefix_blocks: tuple[int, ...] = ()


_KEYS = frozenset(
    {
        "id",
        "prompt",
        "prompt_ids",
        "messages",
        "max_tokens",
        "temperature",
        "top_p",
        "top_k",
        "seed",
        "stop",
        "stop_token_ids",
        "ignore_eos",
        "logprobs",
        "top_logprobs",
        "echo",
        "json_schema",
        "json_param",
        "tools",
        "tool_choice",
        "prefix_blocks",
    }
)
MAX_SCHEMA_CHARS = 65_536
_U64 = (1 << 64) - 1


def _chat_prompt(messages: Any, tools: Any, render_chat: Any) -> tuple[int, ...]:
    if not isinstance(messages, list) or not 0 < len(messages) <= MAX_MESSAGES:
        raise RequestRejected("messages", f"'messages' must be a list of 1 to {MAX_MESSAGES} messages")
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or message.get("role") not in CHAT_ROLES:
            raise RequestRejected(
                f"messages[{i}].role", f"'messages[{i}].role' must be one of {list(CHAT_ROLES)}"
            )
        calls = message.get("tool_calls")
        if calls is not None and (message["role"] != "assistant" or not isinstance(calls, list)):
            raise RequestRejected(
                f"messages[{i}].tool_calls", f"'messages[{i}].tool_calls' is a list on assistant messages"
            )
        if not isinstance(message.get("content"), str) and not (calls and message.get("content") is None):
            raise RequestRejected(f"messages[{i}].content", f"'messages[{i}].content' must be a string")
    if tools is not None and not isinstance(tools, list):
        raise RequestRejected("tools", "'tools' must be a list")
    if render_chat is None:
        raise RequestRejected(
            "messages",
            "this model has no chat template: send a prompt to /v1/completions",
            "unsupported_input",
        )
    return tuple(render_chat(messages, tools))


def _int(raw: dict[str, Any], key: str, default: int, low: int, high: int) -> int:
    value = raw.get(key, default)
    if value is None:
        return default
    if type(value) is not int:
        raise RequestRejected(key, f"'{key}' must be an integer, got {type(value).__name__}")
    if not low <= value <= high:
        raise RequestRejected(key, f"'{key}' must be within [{low}, {high}], got {value}")
    return value


def _float(raw: dict[str, Any], key: str, default: float, low: float, high: float) -> float:
    value = raw.get(key, default)
    if value is None:
        return default
    if type(value) not in (int, float) or not math.isfinite(value):
        raise RequestRejected(key, f"'{key}' must be a finite number, got {value!r}")
    if not low <= value <= high:
        raise RequestRejected(key, f"'{key}' must be within [{low}, {high}], got {value}")
    return float(value)


def _token_ids(value: Any, key: str, limits: ModelLimits, max_len: int) -> tuple[int, ...]:
    if not isinstance(value, list | tuple):
        raise RequestRejected(key, f"'{key}' must be a list of token ids")
    if len(value) > max_len:
        raise RequestRejected(
            key, f"'{key}' has {len(value)} tokens, above the limit of {max_len}", "too_long"
        )
    for i, token in enumerate(value):
        if type(token) is not int or not 0 <= token < limits.vocab_size:
            raise RequestRejected(
                key,
                f"'{key}[{i}]' is {token!r}, not a token id of this model's vocabulary [0, {limits.vocab_size})",
            )
    return tuple(value)


CHAT_ROLES = ("system", "user", "assistant", "tool")
MAX_MESSAGES = 256


def parse_request(raw: Any, limits: ModelLimits, tokenize: Any, render_chat: Any = None) -> GenerationRequest:
    """A request map from the driver -> a checked `GenerationRequest`; `RequestRejected` naming the field.

    ``tokenize(text) -> list[int]`` turns a text prompt into token ids (None: this model has no tokenizer);
    ``render_chat(messages, tools) -> list[int]`` renders chat messages with the model's template (None: it has none)."""
    if not isinstance(raw, dict):
        raise RequestRejected("request", f"a generation request must be a map, got {type(raw).__name__}")
    unknown = sorted(str(k) for k in raw.keys() - _KEYS)
    if unknown:
        raise RequestRejected(unknown[0], f"unknown request field(s) {unknown}")
    request_id = raw.get("id")
    if not isinstance(request_id, str) or not 0 < len(request_id) <= 128:
        raise RequestRejected("id", "'id' must be a string of 1 to 128 characters")
    context = limits.context_length
    if raw.get("messages") is not None:
        prompt_ids = _chat_prompt(raw["messages"], raw.get("tools"), render_chat)
    elif raw.get("prompt_ids") is not None:
        prompt_ids = _token_ids(raw["prompt_ids"], "prompt", limits, context)
    elif isinstance(raw.get("prompt"), str):
        if tokenize is None:
            raise RequestRejected(
                "prompt", "this model has no tokenizer: send token ids", "unsupported_input"
            )
        prompt_ids = tuple(tokenize(raw["prompt"]))
    else:
        raise RequestRejected("prompt", "a request needs 'prompt' (text) or 'prompt_ids' (token ids)")
    prompt_param = "messages" if raw.get("messages") is not None else "prompt"
    if not prompt_ids:
        raise RequestRejected(prompt_param, "the prompt is empty (no tokens)")
    if len(prompt_ids) >= context:
        raise RequestRejected(
            prompt_param,
            f"the prompt has {len(prompt_ids)} tokens; this model's context is {context} tokens, which must "
            "hold the prompt and at least one generated token",
            "context_length_exceeded",
        )
    max_tokens = _int(raw, "max_tokens", 16, 1, context)
    if len(prompt_ids) + max_tokens > context:
        raise RequestRejected(
            "max_tokens",
            f"max_tokens is {max_tokens} and the prompt has {len(prompt_ids)} tokens: together above this "
            f"model's context of {context} tokens (at most {context - len(prompt_ids)} new tokens fit)",
            "context_length_exceeded",
        )
    stop = raw.get("stop") or []
    if not isinstance(stop, list | tuple) or not all(isinstance(s, str) and s for s in stop):
        raise RequestRejected("stop", "'stop' must be a list of non-empty strings")
    if len(stop) > MAX_STOP_STRINGS or any(len(s) > MAX_STOP_CHARS for s in stop):
        raise RequestRejected(
            "stop", f"at most {MAX_STOP_STRINGS} stop strings of at most {MAX_STOP_CHARS} characters each"
        )
    stop_ids = _token_ids(raw.get("stop_token_ids") or [], "stop_token_ids", limits, MAX_STOP_TOKEN_IDS)
    seed = raw.get("seed")
    if seed is None:
        seed = secrets.randbelow(SEED_LIMIT)
    elif type(seed) is not int or not -SEED_LIMIT <= seed < SEED_LIMIT:
        raise RequestRejected("seed", f"'seed' must be an integer within [-2^63, 2^63), got {seed!r}")
    for flag in ("ignore_eos", "logprobs", "echo"):
        if type(raw.get(flag, False)) is not bool:
            raise RequestRejected(flag, f"'{flag}' must be a boolean")
    json_schema = raw.get("json_schema")
    json_param = raw.get("json_param") or "response_format"
    if not isinstance(json_param, str) or len(json_param) > 128:
        raise RequestRejected("json_param", "'json_param' must be a field name")
    if json_schema is not None and (not isinstance(json_schema, str) or len(json_schema) > MAX_SCHEMA_CHARS):
        raise RequestRejected(
            json_param, f"the schema must be JSON text of at most {MAX_SCHEMA_CHARS} characters"
        )
    tools_auto = raw.get("tool_choice") is not None
    if tools_auto and (
        raw.get("tool_choice") != "auto" or not raw.get("tools") or raw.get("messages") is None
    ):
        raise RequestRejected(
            "tool_choice", "'tool_choice' is 'auto' or absent, and 'auto' goes with chat messages and 'tools'"
        )
    if tools_auto and json_schema is not None:
        raise RequestRejected("tool_choice", "tool_choice 'auto' and a JSON schema cannot both hold")
    params = SamplingParams(
        max_tokens=max_tokens,
        temperature=_float(raw, "temperature", 1.0, 0.0, 2.0),
        top_p=_float(raw, "top_p", 1.0, 1e-6, 1.0),
        top_k=_int(raw, "top_k", 0, 0, limits.vocab_size),
        seed=seed,
        stop=tuple(stop),
        stop_token_ids=stop_ids,
        ignore_eos=bool(raw.get("ignore_eos", False)),
        logprobs=bool(raw.get("logprobs", False)),
        top_logprobs=_int(raw, "top_logprobs", 0, 0, MAX_TOP_LOGPROBS),
        json_schema=json_schema,
    )
    return GenerationRequest(
        request_id,
        prompt_ids,
        params,
        echo=bool(raw.get("echo", False)),
        json_param=json_param,
        tools_auto=tools_auto,
        prefix_blocks=_prefix_blocks(raw.get("prefix_blocks"), len(prompt_ids)),
    )


def _prefix_blocks(value: Any, prompt_tokens: int) -> tuple[int, ...]:
    """The driver's block hashes: unsigned 64-bit integers, at most one per prompt token (the driver's blocks
    are several tokens long), or none."""
    if value is None:
        return ()
    if (
        not isinstance(value, list)
        or len(value) > prompt_tokens
        or not all(type(h) is int and 0 <= h <= _U64 for h in value)
    ):
        raise RequestRejected(
            "prefix_blocks",
            "'prefix_blocks' must be a list of unsigned 64-bit integers, at most one per token",
        )
    return tuple(value)
