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
  (at most one with ``parallel_tool_calls`` false); ``none``: text, no tool call.
- ``tool_choice`` ``auto`` (the default with tools): nothing is enforced; the model's chat template is given the
  tools and the model decides. The worker refuses it (a 400 naming ``tool_choice``) unless the template renders
  tools in a tool-call format it knows, and names the format in its admission answer; the text is then read
  in that format (`HermesToolReader`: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks are
  calls, the text around them content).
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any, Protocol

import jsonschema

from iwg_worker.driver.openai_api import ApiError, ChatCompletionRequest, NamedToolChoice, ResponseFormat
from iwg_worker.protocol import HERMES, HERMES_TAGS

MAX_SCHEMA_CHARS = 65_536
MAX_SCHEMA_DEPTH = 64  # objects and arrays nested in a schema (vLLM's own bound)


@dataclass(frozen=True, slots=True)
class Constraint:
    """What the engine enforces (``schema``, JSON text) and how the answer is read back (``tools``: None for
    plain content, else ``named`` or ``required``)."""

    schema: str | None
    param: str
    tools: str | None = None  # None (content), "named", "required" (forced by the schema) or "auto"
    function: str | None = None  # the named function
    function_names: tuple[str, ...] = ()  # auto: the request's tools, the only calls read back

    def engine_fields(self) -> dict[str, Any]:
        if self.tools == "auto":
            return {"tool_choice": "auto"}
        return {"json_schema": self.schema, "json_param": self.param}

    @property
    def forced(self) -> bool:
        """Whether the whole text is tool calls (a named or required tool_choice)."""
        return self.tools in ("named", "required")


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
    if req.response_format is not None and req.response_format.type != "text":
        if choice is None or choice == "auto":
            raise _bad(
                "response_format",
                "a JSON response_format leaves the model no way to call a tool: with tools, send it with "
                "tool_choice 'none'",
            )
        raise _bad("response_format", "a forced tool call and a JSON response_format cannot both be enforced")
    if choice is None or choice == "auto":
        return Constraint(None, "tool_choice", "auto", function_names=tuple(names))
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


ToolDelta = tuple[str, list[dict[str, Any]]]  # content text, tool-call deltas (OpenAI's delta ``tool_calls``)


class ToolReader(Protocol):
    """Reads a choice's text as it streams into content and tool calls."""

    calls: list[dict[str, Any]]  # the calls read so far, whole

    def feed(self, new_text: str) -> ToolDelta:
        """The content and the tool-call deltas the new text adds."""

    def close(self) -> ToolDelta:
        """What the text held back comes to once the choice has ended."""

    @property
    def content(self) -> str | None:
        """The choice's content, as a non-streamed response carries it (None: only tool calls)."""

    @property
    def finish_as_tool_calls(self) -> bool:
        """Whether the choice, ended other than by its length, ends with ``finish_reason: tool_calls``."""


def tool_reader(constraint: Constraint, tool_format: str | None) -> ToolReader:
    """The reader of a choice's text: the forced modes' JSON, or ``auto``'s text in the worker's format."""
    if constraint.tools != "auto":
        return ToolCallReader(constraint)
    if tool_format != HERMES:  # a worker newer than this driver: its calls come back as the text they are
        return HermesToolReader(frozenset())
    return HermesToolReader(frozenset(constraint.function_names))


@dataclass(slots=True)
class ToolCallReader:
    """The tool calls in a choice's constrained text, as it streams.

    - ``named``: the text is the arguments; the first delta names the call (id, function name), each later
      one carries the arguments' next characters.
    - ``required``: the text is a JSON array of calls; a call is sent whole, in one delta, once its element is
      complete (read with the standard library's JSON decoder)."""

    constraint: Constraint
    text: str = ""
    calls: list[dict[str, Any]] = field(default_factory=list)
    _pos: int = 0
    _decoder: json.JSONDecoder = field(default_factory=json.JSONDecoder)

    content = None
    finish_as_tool_calls = True

    def close(self) -> ToolDelta:
        return "", []

    def feed(self, new_text: str) -> ToolDelta:
        self.text += new_text
        if self.constraint.tools == "named":
            if not self.calls:
                call = _call(self.constraint.function or "", new_text)
                self.calls.append(call)
                return "", [{"index": 0, **call, "function": dict(call["function"])}]
            self.calls[0]["function"]["arguments"] += new_text
            return "", [{"index": 0, "function": {"arguments": new_text}}] if new_text else []
        out: list[dict[str, Any]] = []
        while True:
            pos = self._skip(self._pos)
            if pos >= len(self.text):
                return "", out
            try:
                element, end = self._decoder.raw_decode(self.text, pos)
            except ValueError:
                return "", out
            self._pos = end
            call = _call(str(element["name"]), json.dumps(element["parameters"]))
            out.append({"index": len(self.calls), **call})
            self.calls.append(call)

    def _skip(self, pos: int) -> int:
        while pos < len(self.text) and self.text[pos] in "[, \n\t\r":
            pos += 1
        return pos


_OPEN, _CLOSE = HERMES_TAGS


@dataclass(slots=True)
class HermesToolReader:
    """Tool calls in the Hermes format (Hermes 2 Pro and 3, Qwen 2.5 and 3, SmolLM3 and the templates written
    after them): each call a block ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` in the text,
    the text around the blocks content.

    A block is sent as one whole call once its closing tag has come (or the text ended inside it); a block
    that is not a JSON object with a string ``name`` of one of the request's tools and object ``arguments``
    stays content, tags and all, as the model wrote it. Text that may be the start of an opening tag is held
    back until the next text decides it, and whitespace until text that is not whitespace follows: the
    whitespace next to a call is nobody's content, and text without calls reads back exactly as written."""

    tools: frozenset[str]
    calls: list[dict[str, Any]] = field(default_factory=list)
    _text: list[str] = field(default_factory=list)  # the content, as sent
    _pending: str = ""  # text not yet read
    _blank: str = ""  # whitespace held back until content follows it
    _inside: bool = False
    _after_call: bool = False  # the whitespace after a call is nobody's content

    @property
    def finish_as_tool_calls(self) -> bool:
        return bool(self.calls)

    @property
    def content(self) -> str | None:
        return "".join(self._text) or None

    def feed(self, new_text: str) -> ToolDelta:
        self._pending += new_text
        content: list[str] = []
        calls: list[dict[str, Any]] = []
        while True:
            if self._inside:
                end = self._pending.find(_CLOSE)
                if end < 0:
                    break
                body, self._pending = self._pending[:end], self._pending[end + len(_CLOSE) :]
                self._inside = False
                self._block(body, _CLOSE, content, calls)
                continue
            start = self._pending.find(_OPEN)
            if start < 0:
                keep = _partial_tag(self._pending)
                self._content(self._pending[: len(self._pending) - keep], content)
                self._pending = self._pending[len(self._pending) - keep :]
                break
            self._content(self._pending[:start], content)
            self._pending = self._pending[start + len(_OPEN) :]
            self._inside = True
        return "".join(content), calls

    def close(self) -> ToolDelta:
        content: list[str] = []
        calls: list[dict[str, Any]] = []
        if (
            self._inside
        ):  # the text ended inside a block (a stop at the tag, or cut): a call if it reads as one
            self._block(self._pending, "", content, calls)
        else:
            self._content(self._pending, content)
        self._pending, self._inside = "", False
        if not self.calls and self._blank:  # trailing whitespace of plain content is content
            content.append(self._blank)
            self._text.append(self._blank)
        self._blank = ""
        return "".join(content), calls

    def _block(self, body: str, close: str, content: list[str], calls: list[dict[str, Any]]) -> None:
        call = self._read_call(body)
        if call is None:
            self._content(_OPEN + body + close, content)
            return
        calls.append({"index": len(self.calls), **call})
        self.calls.append(call)
        self._blank, self._after_call = "", True

    def _read_call(self, body: str) -> dict[str, Any] | None:
        try:
            value = json.loads(body)
        except ValueError:
            return None
        if not isinstance(value, dict):
            return None
        name, arguments = value.get("name"), value.get("arguments", {})
        if not isinstance(name, str) or name not in self.tools or not isinstance(arguments, dict):
            return None
        return _call(name, json.dumps(arguments))

    def _content(self, text: str, out: list[str]) -> None:
        core = text.rstrip()
        if not core:
            self._blank += text
            return
        lead = "" if self._after_call else self._blank
        if self._after_call:
            core = core.lstrip()
        self._blank, self._after_call = text[len(text.rstrip()) :], False
        out.append(lead + core)
        self._text.append(lead + core)


def _partial_tag(text: str) -> int:
    """How many characters at the end of ``text`` could be the start of an opening tag."""
    for n in range(min(len(_OPEN) - 1, len(text)), 0, -1):
        if text.endswith(_OPEN[:n]):
            return n
    return 0


def _call(name: str, arguments: str) -> dict[str, Any]:
    return {
        "id": f"call_{uuid.uuid4().hex[:24]}",
        "type": "function",
        "function": {"name": name, "arguments": arguments},
    }
