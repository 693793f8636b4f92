"""Request and response bodies of the OpenAI-compatible HTTP API, as pydantic models.

Requests are strict (no silent coercion of "3" to 3) and reject unknown fields, as OpenAI's own API does, so a
misspelt parameter is an error that names it rather than a setting that is silently ignored.
"""

from __future__ import annotations

import time
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr, ValidationError


class _Request(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")


TokenIds = list[StrictInt]  # ranges are checked by the driver, which knows the model's vocabulary
INT32_MAX = 2**31 - 1
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
# Names and tags are short; a longer one is a mistake (and would be echoed back in errors).
ShortStr = Annotated[StrictStr, Field(max_length=256)]
MAX_N = 16  # choices per prompt (each is its own engine request)
MAX_LOGPROBS = 20  # top logprobs per token (OpenAI allows 5 for completions, 20 for chat)


class EmbeddingRequest(_Request):
    model: ShortStr
    input: StrictStr | list[StrictStr] | TokenIds | list[TokenIds]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Annotated[StrictInt, Field(ge=1, le=INT32_MAX)] | None = None
    user: ShortStr | None = None


class StreamOptions(_Request):
    include_usage: StrictBool = False


class _GenerationRequest(_Request):
    """What completions and chat completions share."""

    model: ShortStr
    max_tokens: Annotated[StrictInt, Field(ge=1, le=INT32_MAX)] | None = None
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] = 1.0
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] = 1.0
    n: Annotated[StrictInt, Field(ge=1, le=MAX_N)] = 1
    seed: Annotated[StrictInt, Field(ge=INT64_MIN, le=INT64_MAX)] | None = None
    stop: StrictStr | Annotated[list[StrictStr], Field(max_length=4)] | None = None
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    # vLLM's extensions: top-k sampling (0 or -1: off), more tokens that end generation, and max_tokens even
    # past end-of-sequence.
    top_k: Annotated[StrictInt, Field(ge=-1, le=INT32_MAX)] = 0
    stop_token_ids: Annotated[
        list[Annotated[StrictInt, Field(ge=0, le=INT32_MAX)]], Field(max_length=64)
    ] = []
    ignore_eos: StrictBool = False
    user: ShortStr | None = None


JsonObject = dict[str, Any]
FunctionName = Annotated[StrictStr, Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")]


class JsonSchemaFormat(_Request):
    name: FunctionName
    description: Annotated[StrictStr, Field(max_length=4096)] | None = None
    schema_: Annotated[JsonObject | None, Field(alias="schema")] = None
    strict: StrictBool | None = None


class ResponseFormat(_Request):
    """``text``, ``json_object`` (any JSON object) or ``json_schema`` (JSON valid under ``json_schema.schema``)."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class CompletionRequest(_GenerationRequest):
    prompt: StrictStr | list[StrictStr] | TokenIds | list[TokenIds]
    max_tokens: Annotated[StrictInt, Field(ge=1, le=INT32_MAX)] = 16
    echo: StrictBool = False
    logprobs: Annotated[StrictInt, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    best_of: Annotated[StrictInt, Field(ge=1, le=MAX_N)] | None = None
    response_format: ResponseFormat | None = None


class FunctionCall(_Request):
    name: FunctionName
    arguments: Annotated[StrictStr, Field(max_length=65_536)]


class ToolCall(_Request):
    id: ShortStr
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Request):
    role: Literal["system", "user", "assistant", "tool"]
    content: Annotated[StrictStr, Field(max_length=32_768)] | None = None
    name: ShortStr | None = None
    tool_calls: Annotated[list[ToolCall], Field(min_length=1, max_length=64)] | None = None
    tool_call_id: ShortStr | None = None


class FunctionDefinition(_Request):
    name: FunctionName
    description: Annotated[StrictStr, Field(max_length=4096)] | None = None
    parameters: JsonObject | None = None
    strict: StrictBool | None = None


class Tool(_Request):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Request):
    name: FunctionName


class NamedToolChoice(_Request):
    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(_GenerationRequest):
    messages: Annotated[list[ChatMessage], Field(min_length=1, max_length=256)]
    max_completion_tokens: Annotated[StrictInt, Field(ge=1, le=INT32_MAX)] | None = None
    logprobs: StrictBool = False
    top_logprobs: Annotated[StrictInt, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    response_format: ResponseFormat | None = None
    tools: Annotated[list[Tool], Field(min_length=1, max_length=128)] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: StrictBool = True


class EmbeddingData(BaseModel):
    object: Literal["embedding"] = "embedding"
    index: int
    embedding: list[float] | str


class EmbeddingUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class EmbeddingResponse(BaseModel):
    object: Literal["list"] = "list"
    data: list[EmbeddingData]
    model: str
    usage: EmbeddingUsage


class CompletionLogprobs(BaseModel):
    """The legacy completions shape: per token its text, logprob, the top tokens' logprobs, its text offset."""

    tokens: list[str] = []
    token_logprobs: list[float] = []
    top_logprobs: list[dict[str, float]] = []
    text_offset: list[int] = []


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob]
    refusal: None = None


class CompletionChoice(BaseModel):
    text: str
    index: int
    logprobs: CompletionLogprobs | None = None
    finish_reason: Literal["stop", "length"]


class ResponseFunctionCall(BaseModel):
    name: str
    arguments: str


class ResponseToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: ResponseFunctionCall


class ChatCompletionMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[ResponseToolCall] | None = None


class ChatCompletionChoice(BaseModel):
    index: int
    message: ChatCompletionMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: Literal["stop", "length", "tool_calls"]


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatCompletionChoice]
    usage: Usage


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: Usage


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "iwg"


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


ErrorType = Literal[
    "invalid_request_error",
    "authentication_error",
    "permission_error",
    "not_found_error",
    "rate_limit_error",
    "server_error",
    "service_unavailable",
    "timeout",
]


class ErrorDetail(BaseModel):
    message: str
    type: ErrorType
    param: str | None = None
    code: str | None = None


class ErrorBody(BaseModel):
    error: ErrorDetail


class ApiError(Exception):
    """An error the HTTP layer turns into an OpenAI-shaped body with this status."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: ErrorType = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.detail = ErrorDetail(message=message, type=type, param=param, code=code)
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return ErrorBody(error=self.detail).model_dump()


def _location(loc: tuple[int | str, ...]) -> str:
    """`('input', 2)` -> `input[2]`; pydantic's union branch names (`list[str]`) are left out."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif (
            "[" in part
            or part in {"str", "int", "float", "bool", "none"}
            or part.startswith(("function-", "constrained-"))
        ):
            continue
        else:
            out += f".{part}" if out else part
    return out


def validation_error(exc: ValidationError) -> ApiError:
    """The first problem pydantic found, phrased for a client: which field, what is wrong with it."""
    errors = exc.errors(include_url=False)
    first = errors[0]
    param = _location(tuple(first["loc"]))
    same_field = len({_location(tuple(e["loc"])) for e in errors}) == 1 and len(errors) > 1
    # A union whose branches all failed: a branch of the right type that broke a limit says the most.
    constraint = next((e for e in errors if not e["type"].endswith("_type")), None) if same_field else None
    if first["type"] == "extra_forbidden":
        message = f"Unrecognized request argument supplied: {param}"
    elif first["type"] == "missing":
        message = f"Missing required parameter: '{param}'."
    elif constraint is not None:
        message = f"Invalid value for '{param}': {constraint['msg']}."
    elif same_field:
        # A union (e.g. `input`) failed in every branch on type: the per-branch messages confuse more.
        message = f"Invalid type for '{param}': got {_describe(first.get('input'))}."
    else:
        message = f"Invalid value for '{param}': {first['msg']}."
    return ApiError(400, message, param=param or None, code="invalid_value")


def _describe(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int | float):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "an array with an element of another type" if value else "an empty array"
    if isinstance(value, dict):
        return "an object"
    return type(value).__name__


def no_replica_error(retry_after_s: float) -> ApiError:
    """503: no replica of the model serves now."""
    return ApiError(
        503,
        "No replica of this model is serving right now; retry shortly.",
        type="service_unavailable",
        code="no_replica",
        headers={"Retry-After": str(max(1, int(retry_after_s)))},
    )


def queue_full_error(why: str, retry_after_s: int = 1) -> ApiError:
    """429 with ``Retry-After``: the server is at capacity (`why` says which limit)."""
    return ApiError(
        429,
        f"The server is at capacity ({why}); retry after {retry_after_s} s.",
        type="rate_limit_error",
        code="queue_full",
        headers={"Retry-After": str(retry_after_s)},
    )
