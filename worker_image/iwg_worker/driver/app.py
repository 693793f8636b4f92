"""The driver's HTTP front end (aiohttp): OpenAI-compatible inference, probes, metrics and the admin API.

Every error leaves as an OpenAI-shaped body (`{"error": {"message", "type", "param", "code"}}`); bad input is
always a 4xx that names the problem, never a 500.
"""

from __future__ import annotations

import contextlib
import hmac
import json
import logging
import math
import re
import time
from collections.abc import AsyncGenerator, Awaitable, Callable
from typing import Any, TypeVar

import numpy as np
from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError
from pydantic import BaseModel, ConfigDict, Field, StrictInt, ValidationError

from iwg_worker.driver.openai_api import (
    ApiError,
    ChatCompletionRequest,
    CompletionRequest,
    EmbeddingRequest,
    validation_error,
)
from iwg_worker.driver.service import Driver

log = logging.getLogger(__name__)

DRIVER_KEY = web.AppKey("driver", Driver)
ADMIN_TOKEN_KEY = web.AppKey("admin_token", str)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
M = TypeVar("M", bound=BaseModel)
G = TypeVar("G", CompletionRequest, ChatCompletionRequest)

DEFAULT_MAX_BODY_BYTES = 16 * 1024 * 1024
# Request bodies are shallow ({"input": [[ids]]}) but for JSON schemas (response_format, tools), which the
# driver bounds at 64 levels (structured.MAX_SCHEMA_DEPTH) under at most 4 of the body's; anything deeper is
# refused before the parser sees it, so no body can exhaust the parser's recursion.
MAX_JSON_DEPTH = 72
# A string literal, or an unterminated one running to the end: every match succeeds, so the scan is linear.
_JSON_STRING = re.compile(rb'"[^"\\]*+(?:\\.[^"\\]*+)*+(?:"|\\?\Z)', re.DOTALL)
_NOT_BRACKETS = bytes(sorted(set(range(256)) - set(b"[]{}")))
_BRACKET_STEPS = bytes.maketrans(b"[{]}", b"\x01\x01\xff\xff")


class BatchParamsRequest(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")
    max_batch_size: StrictInt | None = Field(default=None, ge=1, le=4096)
    max_wait_ms: float | None = Field(default=None, ge=0.0, le=60_000.0)


def build_app(
    driver: Driver, admin_token: str | None = None, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
) -> web.Application:
    _quiet_client_errors()
    app = web.Application(middlewares=[_errors], client_max_size=max_body_bytes)
    app[DRIVER_KEY] = driver
    app[ADMIN_TOKEN_KEY] = admin_token or ""
    app.router.add_post("/v1/embeddings", _embeddings)
    app.router.add_post("/v1/completions", _completions)
    app.router.add_post("/v1/chat/completions", _chat_completions)
    app.router.add_get("/v1/models", _models)
    app.router.add_get("/v1/models/{model}", _model)
    app.router.add_get("/healthz", _healthz)
    app.router.add_get("/readyz", _readyz)
    app.router.add_get("/metrics", _metrics)
    app.router.add_get("/activation", _activation)
    app.router.add_get("/admin/replicas", _admin_replicas)
    app.router.add_post("/admin/batch-params", _admin_batch_params)
    app.router.add_post("/admin/replicas/{replica}/drain", _admin_drain)
    app.router.add_post("/admin/replicas/{replica}/undrain", _admin_undrain)
    return app


def _json(body: Any, status: int = 200, headers: dict[str, str] | None = None) -> web.Response:
    return web.Response(
        text=json.dumps(body), status=status, content_type="application/json", headers=headers
    )


def _model_json(model: BaseModel) -> web.Response:
    return web.Response(text=model.model_dump_json(), content_type="application/json")


_HTTP_ERRORS: dict[int, tuple[str, str]] = {
    404: ("not_found_error", "Unknown path {path}."),
    405: ("invalid_request_error", "Method {method} is not allowed on {path}."),
    413: ("invalid_request_error", "The request body is larger than this server accepts ({limit} bytes)."),
}


@web.middleware
async def _errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    try:
        return await handler(request)
    except ApiError as exc:
        return _json(exc.body(), status=exc.status, headers=exc.headers)
    except web.HTTPException as exc:
        kind, template = _HTTP_ERRORS.get(exc.status, ("invalid_request_error", exc.reason))
        message = template.format(
            path=request.path, method=request.method, limit=request.app._client_max_size
        )
        return _json(ApiError(exc.status, message, type=kind).body(), status=exc.status)  # type: ignore[arg-type]
    except Exception:
        log.exception("unexpected error serving %s %s", request.method, request.path)
        body = ApiError(500, "The server failed while handling this request.", type="server_error").body()
        return _json(body, status=500)


async def _parse(request: web.Request, model: type[M]) -> M:
    raw = await request.read()  # at most client_max_size bytes: a larger body is a 413
    if not raw:
        raise ApiError(400, "The request body is empty; send a JSON object.", code="invalid_json")
    depth = json_depth(raw)
    if depth > MAX_JSON_DEPTH:
        raise ApiError(
            400,
            f"The request body nests {depth} levels deep, above the limit of {MAX_JSON_DEPTH}.",
            code="invalid_json",
        )
    try:
        body = json.loads(raw, parse_constant=_reject_constant)
    except (ValueError, UnicodeDecodeError, RecursionError) as exc:
        raise ApiError(400, f"The request body is not valid JSON: {exc}.", code="invalid_json") from None
    if not isinstance(body, dict):
        raise ApiError(400, "The request body must be a JSON object.", code="invalid_json")
    if b"\x00" in raw or _SURROGATE_ESCAPE.search(raw):  # else no string of the body can hold one
        _check_strings(body, "")
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        raise validation_error(exc) from None


def json_depth(raw: bytes) -> int:
    """How deep the arrays and objects of a JSON text nest (brackets inside strings do not count), without
    parsing it, in time linear in its length: a bound that holds for malformed text too."""
    opened = raw.count(b"[") + raw.count(b"{")
    if opened <= MAX_JSON_DEPTH:
        return opened  # cannot nest deeper than it has brackets
    brackets = _JSON_STRING.sub(b"", raw).translate(None, _NOT_BRACKETS)
    steps = np.frombuffer(brackets.translate(_BRACKET_STEPS), dtype=np.int8)
    return int(np.cumsum(steps, dtype=np.int32).max(initial=0))


# A lone surrogate can reach a UTF-8 JSON text only as a \u escape (UTF-8 cannot encode one): a body without any
# \uD800-\uDFFF spelling holds none, and its strings need no look (walking a prompt of 4,096 token ids took
# 1.5 ms here, the look 0.01 ms). An escaped backslash before "uD8.." matches too: then the strings are looked
# at and pass. json.loads also takes UTF-16 and UTF-32, whose bytes spell the escape apart: a body with a NUL
# byte (never in UTF-8 JSON) is always looked at.
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89abcdefABCDEF]")


def _check_strings(value: Any, path: str) -> None:
    """Every string of the body (keys too) must be UTF-8 encodable: JSON's \\u escapes can spell a lone
    surrogate, which no tokenizer takes and the wire to the workers cannot carry. A field's path is spelt
    out only for the values that need a look (a prompt of token ids is a list of numbers: skipped at once)."""
    if isinstance(value, str):
        _check_text(value, path)
    elif isinstance(value, dict):
        for key, item in value.items():
            where = f"{path}.{key}" if path else key
            _check_text(key, where)
            if isinstance(item, str | dict | list):
                _check_strings(item, where)
    elif isinstance(value, list):
        for index, item in enumerate(value):
            if isinstance(item, str):
                if not item.isascii():
                    _check_text(item, f"{path}[{index}]")
            elif isinstance(item, dict | list):
                _check_strings(item, f"{path}[{index}]")


def _check_text(text: str, path: str) -> None:
    if text.isascii():
        return  # no surrogate is ASCII
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        # The field's name itself may hold the surrogate (a key): named with it escaped, so the answer is UTF-8.
        where = path.encode("utf-8", "backslashreplace").decode("utf-8")
        raise ApiError(
            400,
            f"'{where}' is not valid Unicode text: it holds a lone surrogate (U+{ord(text[exc.start]):04X}) "
            f"at position {exc.start}.",
            param=where,
            code="invalid_value",
        ) from None


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


class _ClientErrorsAtInfo(logging.Filter):
    """aiohttp logs a request it cannot parse (an over-long request line, a malformed header) at ERROR with
    a traceback; that is the client's mistake, answered with a 400, so it is logged at INFO without one."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if isinstance(exc, HttpProcessingError) and record.levelno > logging.INFO:
            record.msg = f"{record.msg}: %s"
            record.args = (*(record.args if isinstance(record.args, tuple) else ()), exc)
            record.levelno, record.levelname = logging.INFO, "INFO"
            record.exc_info, record.exc_text = None, None
        return True


def _quiet_client_errors() -> None:
    server_log = logging.getLogger("aiohttp.server")
    if not any(isinstance(f, _ClientErrorsAtInfo) for f in server_log.filters):
        server_log.addFilter(_ClientErrorsAtInfo())


async def _timed(
    request: web.Request, endpoint: str, call: Callable[[], Awaitable[web.StreamResponse]]
) -> web.StreamResponse:
    driver = request.app[DRIVER_KEY]
    started = time.monotonic()
    status = 200
    try:
        return await call()
    except (ApiError, web.HTTPException) as exc:
        status = exc.status
        raise
    except Exception:
        status = 500
        raise
    finally:
        driver.metrics.requests.labels(endpoint=endpoint, status=str(status)).inc()
        driver.metrics.request_latency.labels(endpoint=endpoint).observe(time.monotonic() - started)


async def _embeddings(request: web.Request) -> web.StreamResponse:
    driver = request.app[DRIVER_KEY]

    async def call() -> web.StreamResponse:
        return _model_json(await driver.embed(await _parse(request, EmbeddingRequest)))

    return await _timed(request, "embeddings", call)


def _generation(
    endpoint: str,
    model: type[G],
    plain: Callable[[Driver, G], Awaitable[BaseModel]],
    streamed: Callable[[Driver, G], AsyncGenerator[dict[str, Any]]],
) -> Handler:
    """A generation endpoint: one JSON body, or server-sent events when the request says `stream`."""

    async def handler(request: web.Request) -> web.StreamResponse:
        driver = request.app[DRIVER_KEY]

        async def call() -> web.StreamResponse:
            req = await _parse(request, model)
            if req.stream:
                return await _server_sent_events(request, streamed(driver, req))
            return _model_json(await plain(driver, req))

        return await _timed(request, endpoint, call)

    return handler


_completions = _generation("completions", CompletionRequest, Driver.complete, Driver.stream_completion)
_chat_completions = _generation("chat_completions", ChatCompletionRequest, Driver.chat, Driver.stream_chat)


async def _server_sent_events(
    request: web.Request, chunks: AsyncGenerator[dict[str, Any]]
) -> web.StreamResponse:
    """Chunks as OpenAI streams them: ``data: {json}`` events, then ``data: [DONE]``. An error before the
    first chunk is an ordinary error response; one after it is a last ``data: {"error": ...}`` event."""
    async with contextlib.aclosing(chunks):
        try:
            first: dict[str, Any] | None = await anext(chunks)
        except StopAsyncIteration:
            first = None
        response = web.StreamResponse(
            headers={
                "Content-Type": "text/event-stream",
                "Cache-Control": "no-cache",
                "X-Accel-Buffering": "no",
            }
        )
        await response.prepare(request)
        try:
            if first is not None:
                await response.write(_event(first))
                async for chunk in chunks:
                    await response.write(_event(chunk))
        except ApiError as exc:
            await response.write(_event(exc.body()))
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response


def _event(body: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(body, ensure_ascii=False).encode() + b"\n\n"


async def _models(request: web.Request) -> web.Response:
    return _model_json(request.app[DRIVER_KEY].models())


async def _model(request: web.Request) -> web.Response:
    models = request.app[DRIVER_KEY].models()
    for card in models.data:
        if card.id == request.match_info["model"]:
            return _model_json(card)
    raise ApiError(
        404,
        f"The model '{request.match_info['model']}' does not exist.",
        type="not_found_error",
        param="model",
        code="model_not_found",
    )


async def _healthz(request: web.Request) -> web.Response:
    driver = request.app[DRIVER_KEY]
    status = 200 if driver.alive else 503
    return _json({"alive": driver.alive}, status=status)


async def _readyz(request: web.Request) -> web.Response:
    driver = request.app[DRIVER_KEY]
    serving = driver.router.serving()
    return _json({"ready": driver.ready, "serving_replicas": serving}, status=200 if driver.ready else 503)


async def _metrics(request: web.Request) -> web.Response:
    body = request.app[DRIVER_KEY].metrics.render()
    return web.Response(body=body, headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"})


async def _activation(request: web.Request) -> web.Response:
    """The operator's long-poll at zero replicas: `{"waiting": n}` as soon as a request is held (activation.py)."""
    try:
        wait_s = float(request.query.get("wait", "30"))
        if not math.isfinite(wait_s):
            raise ValueError(wait_s)
    except ValueError:
        raise ApiError(400, "'wait' must be a number of seconds.", param="wait") from None
    waiting = await request.app[DRIVER_KEY].activation.watch(wait_s)
    return _json({"waiting": waiting})


# -- admin --------------------------------------------------------------------------------------------------------


def _authorize(request: web.Request) -> Driver:
    token = request.app[ADMIN_TOKEN_KEY]
    if not token:
        raise ApiError(
            403,
            "The admin API is disabled: the driver was started without an admin token (IWG_ADMIN_TOKEN_FILE).",
            type="permission_error",
        )
    header = request.headers.get("Authorization", "")
    scheme, _, given = header.partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(), token.encode()):
        raise ApiError(
            401, "Missing or wrong admin token (Authorization: Bearer <token>).", type="authentication_error"
        )
    return request.app[DRIVER_KEY]


def _replica_param(request: web.Request, driver: Driver) -> int:
    text = request.match_info["replica"]
    if not text.isdigit() or not driver.router.known(int(text)):
        raise ApiError(404, f"Unknown replica '{text}'.", type="not_found_error", param="replica")
    return int(text)


async def _admin_replicas(request: web.Request) -> web.Response:
    driver = _authorize(request)
    return _json({"replicas": driver.router.snapshot(), "queue_depth": driver.batcher.depth})


async def _admin_batch_params(request: web.Request) -> web.Response:
    driver = _authorize(request)
    body = await _parse(request, BatchParamsRequest)
    result = driver.adjust_batch_params(body.max_batch_size, body.max_wait_ms)
    return _json(result)


async def _admin_drain(request: web.Request) -> web.Response:
    driver = _authorize(request)
    replica = _replica_param(request, driver)
    try:
        timeout = float(request.query.get("timeout", "60"))
    except ValueError:
        raise ApiError(400, "'timeout' must be a number of seconds.", param="timeout") from None
    drained = await driver.router.drain(replica, timeout=max(0.0, min(timeout, 600.0)))
    return _json(
        {
            "replica": replica,
            "draining": True,
            "drained": drained,
            "inflight_batches": driver.router.inflight(replica),
        }
    )


async def _admin_undrain(request: web.Request) -> web.Response:
    driver = _authorize(request)
    replica = _replica_param(request, driver)
    driver.router.undrain(replica)
    return _json({"replica": replica, "draining": False})
