"""Structured outputs and tool calls at the driver: what a request's ``response_format``, ``tools`` and
``tool_choice`` ask of the engine, and how the engine's constrained text becomes ``tool_calls``.

The engine is given one JSON schema (``json_schema``) and the request field it came from (``json_param``, what a
refusal names); it compiles the schema with xgrammar before the request reaches a batch and constrains every
token to it (`iwg_worker.engine.structured`). Here the schema is checked first as a JSON Schema (the
`jsonschema` package's meta-schema check, a size and a nesting bound): a 400 naming the field, before any
replica sees it.

- ``response_format``: ``text`` (no constraint), ``json_object`` (any JSON object), ``json_schema`` (its
  ``schema``; ``strict`` true or not, the output follows the schema).
- ``tool_choice`` a named function: the output is that function's arguments, a JSON object valid under its
  ``parameters``; ``required``: a JSON array of ``{"name": ..., "parameters": {...}}``, one of the tools each
  (at most one with ``parallel_tool_calls`` false); ``none``: text, no tool call. ``auto`` needs a model whose
  tool-call format the server knows: none is known here, so it is a 400 naming ``tool_choice``.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any

import jsonschema

from iwg_worker.driver.openai_api import ApiError, ChatCompletionRequest, NamedToolChoice, ResponseFormat

MAX_SCHEMA_CHARS = 65_536
MAX_SCHEMA_DEPTH = 64  # objects and arrays nested in a schema (vLLM's own bound)


@dataclass(frozen=True, slots=True)
class Constraint:
    """What the engine enforces (``schema``, JSON text) and how the answer is read back (``tools``: None for
    plain content, else ``named`` or ``required``)."""

    schema: str
    param: str
    tools: str | None = None
    function: str | None = None  # the named function

    def engine_fields(self) -> dict[str, Any]:
        return {"json_schema": self.schema, "json_param": self.param}


def response_format_constraint(fmt: ResponseFormat | None) -> Constraint | None:
    if fmt is None or fmt.type == "text":
        if fmt is not None and fmt.json_schema is not None:
            raise _bad("response_format.json_schema", "'json_schema' goes with type 'json_schema'")
        return None
    if fmt.type == "json_object":
        return Constraint(json.dumps({"type": "object"}), "response_format")
    if fmt.json_schema is None:
        raise _bad("response_format.json_schema", "type 'json_schema' needs 'json_schema'")
    schema = fmt.json_schema.schema_
    if schema is None:  # OpenAI's API takes a missing schema as any JSON
        schema = {}
    return Constraint(
        checked_schema(schema, "response_format.json_schema.schema"), "response_format.json_schema.schema"
    )


def chat_constraint(req: ChatCompletionRequest) -> Constraint | None:
    """The constraint of a chat request: a forced tool call, else its response_format."""
    choice = req.tool_choice
    if req.tools is None:
        if choice is not None and choice != "none":
            raise _bad("tool_choice", "'tool_choice' needs 'tools'")
        return response_format_constraint(req.response_format)
    names = [t.function.name for t in req.tools]
    if len(set(names)) != len(names):
        raise _bad("tools", "tools must have distinct function names")
    params = {}
    for i, tool in enumerate(req.tools):
        params[tool.function.name] = json.loads(
            checked_schema(tool.function.parameters or {"type": "object"}, f"tools[{i}].function.parameters")
        )
    if choice == "none":
        return response_format_constraint(req.response_format)
    if choice is None or choice == "auto":
        raise _bad(
            "tool_choice",
            "tool_choice 'auto' (the default with tools) needs a model whose tool-call format this server "
            "knows, and this model's is not known; send tool_choice 'required', 'none' or a named function",
            "unsupported_value",
        )
    if req.response_format is not None and req.response_format.type != "text":
        raise _bad("response_format", "a forced tool call and a JSON response_format cannot both be enforced")
    if isinstance(choice, NamedToolChoice):
        name = choice.function.name
        if name not in params:
            raise _bad("tool_choice.function.name", f"no tool is named {name!r}")
        index = names.index(name)
        return Constraint(json.dumps(params[name]), f"tools[{index}].function.parameters", "named", name)
    calls: dict[str, Any] = {
        "type": "array",
        "minItems": 1,
        "items": {
            "anyOf": [
                {
                    "type": "object",
                    "properties": {"name": {"const": name}, "parameters": schema},
                    "required": ["name", "parameters"],
                    "additionalProperties": False,
                }
                for name, schema in params.items()
            ]
        },
    }
    if not req.parallel_tool_calls:
        calls["maxItems"] = 1
    return Constraint(json.dumps(calls), "tools", "required")


def checked_schema(schema: dict[str, Any], param: str) -> str:
    """The schema as JSON text, if it is a JSON Schema within the bounds; else a 400 naming ``param``."""
    text = json.dumps(schema)
    if len(text) > MAX_SCHEMA_CHARS:
        raise _bad(
            param, f"the schema is {len(text)} characters of JSON, above the limit of {MAX_SCHEMA_CHARS}"
        )
    if _depth(schema) > MAX_SCHEMA_DEPTH:
        raise _bad(param, f"the schema nests objects and arrays more than {MAX_SCHEMA_DEPTH} levels deep")
    try:
        jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator).check_schema(
            schema
        )
    except jsonschema.SchemaError as exc:
        where = "/".join(str(p) for p in exc.absolute_path)
        raise _bad(
            param, f"not a valid JSON Schema{f' at {where}' if where else ''}: {exc.message}"
        ) from None
    return text


def _depth(value: Any) -> int:
    depth, level = 0, [value]
    while level:
        depth += 1
        nxt: list[Any] = []
        for v in level:
            if isinstance(v, dict):
                nxt.extend(v.values())
            elif isinstance(v, list):
                nxt.extend(v)
        level = nxt
    return depth - 1


def _bad(param: str, message: str, code: str = "invalid_value") -> ApiError:
    return ApiError(400, f"Invalid '{param}': {message}.", param=param, code=code)


@dataclass(slots=True)
class ToolCallReader:
    """The tool calls in a choice's constrained text, as it streams: `feed` returns the calls (as OpenAI's
    delta ``tool_calls`` entries) that the new text adds.

    - ``named``: the text is the arguments; the first delta names the call (id, function name), each later
      one carries the arguments' next characters.
    - ``required``: the text is a JSON array of calls; a call is sent whole, in one delta, once its element is
      complete (read with the standard library's JSON decoder)."""

    constraint: Constraint
    text: str = ""
    calls: list[dict[str, Any]] = field(default_factory=list)
    _pos: int = 0
    _decoder: json.JSONDecoder = field(default_factory=json.JSONDecoder)

    def feed(self, new_text: str) -> list[dict[str, Any]]:
        self.text += new_text
        if self.constraint.tools == "named":
            if not self.calls:
                call = _call(self.constraint.function or "", new_text)
                self.calls.append(call)
                return [{"index": 0, **call, "function": dict(call["function"])}]
            self.calls[0]["function"]["arguments"] += new_text
            return [{"index": 0, "function": {"arguments": new_text}}] if new_text else []
        out: list[dict[str, Any]] = []
        while True:
            pos = self._skip(self._pos)
            if pos >= len(self.text):
                return out
            try:
                element, end = self._decoder.raw_decode(self.text, pos)
            except ValueError:
                return out
            self._pos = end
            call = _call(str(element["name"]), json.dumps(element["parameters"]))
            out.append({"index": len(self.calls), **call})
            self.calls.append(call)

    def _skip(self, pos: int) -> int:
        while pos < len(self.text) and self.text[pos] in "[, \n\t\r":
            pos += 1
        return pos


def _call(name: str, arguments: str) -> dict[str, Any]:
    return {
        "id": f"call_{uuid.uuid4().hex[:24]}",
        "type": "function",
        "function": {"name": name, "arguments": arguments},
    }
