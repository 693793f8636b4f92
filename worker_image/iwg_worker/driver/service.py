"""The driver's request path without HTTP: admit a request, batch its inputs, route, turn results into
OpenAI responses; and the admin operations (batch parameters, drain).

HTTP request -> `Driver.embed` -> `Batcher.enqueue` -> dispatch loop -> `Router.run` -> `ReplicaPool.execute`
-> the replica's workers -> results set on each input's future -> `Driver.embed` builds the response.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncGenerator, Callable, Coroutine, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, TypeVar

import numpy as np

from iwg_worker.driver.activation import Activation
from iwg_worker.driver.batcher import Batcher, BatchKey, BatchParams, QueuedItem, QueueFull
from iwg_worker.driver.logprobs import add_completion_logprobs, chat_logprobs
from iwg_worker.driver.metrics import DriverMetrics
from iwg_worker.driver.openai_api import (
    ApiError,
    ChatCompletionChoice,
    ChatCompletionMessage,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogprobs,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    EmbeddingData,
    EmbeddingRequest,
    EmbeddingResponse,
    EmbeddingUsage,
    ModelCard,
    ModelList,
    ResponseToolCall,
    Usage,
    _GenerationRequest,
    no_replica_error,
    queue_full_error,
)
from iwg_worker.driver.pool import (
    BatchFailure,
    EmbedResult,
    InputRejected,
    ItemResult,
    ReplicaFailure,
    ReplicaPool,
    Task,
)
from iwg_worker.driver.router import NoReplica, Router, RoutingPolicy
from iwg_worker.driver.streams import GenerationService, StreamInterrupted, StreamUsage
from iwg_worker.driver.structured import (
    Constraint,
    ToolReader,
    chat_constraint,
    response_format_constraint,
    tool_reader,
)

log = logging.getLogger(__name__)

_T = TypeVar("_T")
MAX_TOKEN_ID = 2**31 - 1  # token ids travel as int32 at most, whatever the model


@dataclass(frozen=True)
class DriverConfig:
    served_name: str
    task: Task
    max_batch_size: int = 32
    max_wait_ms: float = 5.0
    max_queue: int = 1024
    max_inputs_per_request: int = 2048
    max_input_chars: int = 32_768
    max_input_token_ids: int = 8192
    max_completion_tokens: int = 2048
    request_timeout_s: float = 60.0
    batch_timeout_s: float = 30.0
    no_replica_grace_s: float = 5.0
    # > 0: requests arriving while no replica serves are held this long for one to start (activation.py)
    activation_timeout_s: float = 0.0
    max_inflight_per_replica: int = 2
    generation_timeout_s: float = 600.0  # a generation request's deadline (it is cancelled on the worker)
    max_streams: int = 1024  # generation requests admitted at once before 429
    accepts_token_ids: bool = False
    vocab_size: int | None = None  # token ids must be below it (below 2**31 when the model's is unknown)
    context_length: int | None = None  # a token-id prompt must leave room for one generated token
    routing_policy: RoutingPolicy = "cacheAware"  # generation requests (batches go to the least loaded)
    load_bound: float = 0.25  # cacheAware: no replica above (1 + load_bound) x the mean open requests


class Driver:
    def __init__(self, config: DriverConfig, pool: ReplicaPool, metrics: DriverMetrics | None = None) -> None:
        self.config = config
        self.pool = pool
        self.metrics = metrics or DriverMetrics()
        self.batcher = Batcher(
            BatchParams(config.max_batch_size, config.max_wait_ms / 1000.0), config.max_queue, self.metrics
        )
        self.router = Router(
            pool,
            self.metrics,
            max_inflight_per_replica=config.max_inflight_per_replica,
            batch_timeout_s=config.batch_timeout_s,
            no_replica_grace_s=config.no_replica_grace_s,
            policy=config.routing_policy,
            load_bound=config.load_bound,
        )
        self.activation = Activation(
            self.router, self.metrics, config.activation_timeout_s, config.max_queue, pool.startup
        )
        self.generations = GenerationService(
            pool,
            self.router,
            self.metrics,
            config.generation_timeout_s,
            no_replica_wait_s=max(config.no_replica_grace_s, config.activation_timeout_s),
        )
        self.created = int(time.time())
        self._stats_poller: asyncio.Task[None] | None = None
        self._dispatcher: asyncio.Task[None] | None = None
        self._running: set[asyncio.Task[None]] = set()
        self._embedding_dim: int | None = None

    # -- lifecycle -------------------------------------------------------------------------------------------

    def start(self) -> None:
        if self._dispatcher is None:
            self._dispatcher = asyncio.create_task(self._dispatch(), name="iwg-dispatch")
        if self._stats_poller is None and self.config.task == "generate":
            self._stats_poller = asyncio.create_task(self.generations.poll_stats(), name="iwg-engine-stats")

    @property
    def alive(self) -> bool:
        return self._dispatcher is not None and not self._dispatcher.done()

    @property
    def ready(self) -> bool:
        """Serving through a replica, or (with activation) able to hold requests until one serves."""
        return self.alive and (bool(self.router.serving()) or self.activation.enabled)

    async def stop(self) -> None:
        if self._stats_poller is not None:
            self._stats_poller.cancel()
        if self._dispatcher is not None:
            self._dispatcher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._dispatcher
        self.batcher.fail_all(NoReplica("the driver is shutting down"))
        if self._running:
            await asyncio.wait(self._running, timeout=self.config.batch_timeout_s)

    async def _dispatch(self) -> None:
        while True:
            await self.batcher.wait_nonempty()
            # Inputs queued when the last replica left wait as long as a request arriving now would.
            patience = max(self.router.no_replica_grace_s, self.activation.timeout_s)
            if not await self.router.wait_for_slot(patience):
                if not self.router.serving():
                    failed = self.batcher.fail_all(NoReplica("no serving replica came back in time"))
                    log.warning("no serving replica for %.1f s: failed %d queued inputs", patience, failed)
                continue
            batch, items = await self.batcher.next_batch()
            task = asyncio.create_task(self.router.run(batch, items))
            self._running.add(task)
            task.add_done_callback(self._running.discard)

    # -- inference ---------------------------------------------------------------------------------------------

    def models(self) -> ModelList:
        return ModelList(data=[ModelCard(id=self.config.served_name, created=self.created)])

    async def embed(self, req: EmbeddingRequest) -> EmbeddingResponse:
        self._check_model(req.model, "embed", "/v1/embeddings")
        inputs = self._embedding_inputs(req.input)
        if (
            req.dimensions is not None
            and self._embedding_dim is not None
            and req.dimensions != self._embedding_dim
        ):
            raise self._dimensions_error(req.dimensions, self._embedding_dim)
        names = ["input"] if isinstance(req.input, str) else None
        arrived = await self.activation.hold()
        results = await self._run(inputs, BatchKey("embed"), names)
        self.activation.answered(arrived)
        data: list[EmbeddingData] = []
        tokens = 0
        for index, result in enumerate(results):
            assert isinstance(result, EmbedResult)
            vector = np.asarray(result.embedding, dtype=np.float32).reshape(-1)
            self._embedding_dim = vector.shape[0]
            if req.dimensions is not None and req.dimensions != vector.shape[0]:
                raise self._dimensions_error(req.dimensions, vector.shape[0])
            tokens += result.prompt_tokens
            embedding: list[float] | str
            if req.encoding_format == "base64":
                embedding = base64.b64encode(vector.astype("<f4").tobytes()).decode("ascii")
            else:
                embedding = vector.tolist()
            data.append(EmbeddingData.model_construct(object="embedding", index=index, embedding=embedding))
        usage = EmbeddingUsage(prompt_tokens=tokens, total_tokens=tokens)
        return EmbeddingResponse.model_construct(object="list", data=data, model=req.model, usage=usage)

    async def complete(self, req: CompletionRequest) -> CompletionResponse:
        """A completion: every choice (``n`` per prompt) streamed from an engine, collected into one response."""
        choices = self._completion_choices(req)
        arrived = await self.activation.hold()
        results = await self._collect(choices)
        self.activation.answered(arrived)
        out: list[CompletionChoice] = []
        for choice, items in zip(choices, results, strict=True):
            prefix = choice.prefix()
            logprobs = None
            if req.logprobs is not None:
                logprobs = CompletionLogprobs()
                offset = len(prefix)
                for item in items:
                    offset = add_completion_logprobs(logprobs, item, offset)
            text = prefix + "".join(item["text"] for item in items)
            out.append(
                CompletionChoice(
                    text=text,
                    index=choice.index,
                    logprobs=logprobs,
                    finish_reason="length" if choice.usage.finish_reason == "length" else "stop",
                )
            )
        return CompletionResponse(
            id=f"cmpl-{uuid.uuid4().hex}", model=req.model, choices=out, usage=_usage(choices)
        )

    async def chat(self, req: ChatCompletionRequest) -> ChatCompletionResponse:
        """A chat completion: the messages rendered with the model's chat template by the worker."""
        choices = self._chat_choices(req)
        arrived = await self.activation.hold()
        results = await self._collect(choices)
        self.activation.answered(arrived)
        out = []
        for choice, items in zip(choices, results, strict=True):
            text = "".join(item["text"] for item in items)
            reader = choice.reader()
            message = ChatCompletionMessage(content=text)
            if reader is not None:
                reader.feed(text)
                reader.close()
                calls = [ResponseToolCall.model_validate(c) for c in reader.calls]
                message = ChatCompletionMessage(content=reader.content, tool_calls=calls or None)
            out.append(
                ChatCompletionChoice(
                    index=choice.index,
                    message=message,
                    logprobs=(
                        ChatLogprobs(content=[e for item in items for e in chat_logprobs(item)])
                        if req.logprobs
                        else None
                    ),
                    finish_reason=_finish(choice.usage, reader is not None and reader.finish_as_tool_calls),
                )
            )
        return ChatCompletionResponse(
            id=f"chatcmpl-{uuid.uuid4().hex}", model=req.model, choices=out, usage=_usage(choices)
        )

    def stream_completion(self, req: CompletionRequest) -> AsyncGenerator[dict[str, Any]]:
        """The chunks of a streamed completion (OpenAI's ``text_completion`` chunk bodies)."""
        choices = self._completion_choices(req)
        offsets: dict[int, int] = {}  # per choice: characters sent so far (the next token's text_offset)

        def render(choice: _Choice, item: dict[str, Any]) -> dict[str, Any]:
            text = item["text"]
            if choice.index not in offsets:
                prefix = choice.prefix()  # echo: the prompt comes first, in the choice's first chunk
                text = prefix + text
                offsets[choice.index] = len(prefix)
            logprobs = None
            if req.logprobs is not None:
                part = CompletionLogprobs()
                offsets[choice.index] = add_completion_logprobs(part, item, offsets[choice.index])
                logprobs = part.model_dump()
            return {
                "text": text,
                "index": choice.index,
                "logprobs": logprobs,
                "finish_reason": item["finish_reason"],
            }

        return self._chunks(req, choices, "text_completion", f"cmpl-{uuid.uuid4().hex}", render)

    def stream_chat(self, req: ChatCompletionRequest) -> AsyncGenerator[dict[str, Any]]:
        """The chunks of a streamed chat completion (``chat.completion.chunk``: the role in the first delta)."""
        choices = self._chat_choices(req)
        started: set[int] = set()
        readers: dict[int, ToolReader | None] = {}

        def render(choice: _Choice, item: dict[str, Any]) -> dict[str, Any]:
            delta: dict[str, Any] = {"content": item["text"]}
            if choice.index not in readers:  # after the worker's answer, which names auto's format
                readers[choice.index] = choice.reader()
            reader = readers[choice.index]
            finish = item["finish_reason"]
            if reader is not None:
                content, calls = reader.feed(item["text"])
                if finish is not None:
                    more, last = reader.close()
                    content, calls = content + more, calls + last
                delta = {"content": content} if content else {}
                if calls:
                    delta["tool_calls"] = calls
                if finish is not None and finish != "length" and reader.finish_as_tool_calls:
                    finish = "tool_calls"
            if choice.index not in started:
                started.add(choice.index)
                delta = {"role": "assistant", **delta}
            logprobs = ChatLogprobs(content=chat_logprobs(item)).model_dump() if req.logprobs else None
            return {"index": choice.index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}

        return self._chunks(req, choices, "chat.completion.chunk", f"chatcmpl-{uuid.uuid4().hex}", render)

    async def _collect(self, choices: list[_Choice]) -> list[list[dict[str, Any]]]:
        """Every choice's stream items, all or none (one failing cancels the others)."""

        async def collect(choice: _Choice) -> list[dict[str, Any]]:
            return [item async for item in self._generate(choice.request, choice.usage)]

        if len(choices) == 1:  # no task (see _chunks)
            await asyncio.sleep(0)
            return [await collect(choices[0])]
        return await _all_or_none([collect(c) for c in choices])

    async def _chunks(
        self,
        req: _GenerationRequest,
        choices: list[_Choice],
        kind: str,
        chunk_id: str,
        render: Callable[[_Choice, dict[str, Any]], dict[str, Any]],
    ) -> AsyncGenerator[dict[str, Any]]:
        """Every choice's chunks as they come; a last one with ``usage`` when ``stream_options.include_usage``."""
        arrived = await self.activation.hold()  # before the first chunk: a refusal is a plain error response
        created = int(time.time())
        head = {"id": chunk_id, "object": kind, "created": created, "model": req.model}
        if len(choices) == 1:
            # One choice (n = 1, one prompt: most requests): its items straight from its stream, without the
            # task and queue that interleave several choices (a task switch per token saved). It starts one
            # turn of the loop later, as a task would: requests that leave `hold` together (an activation)
            # reach their replicas in arrival order whatever their n, streamed or not.
            await asyncio.sleep(0)
            choice = choices[0]
            async with contextlib.aclosing(self._generate(choice.request, choice.usage)) as items:
                async for item in items:
                    if arrived is not None:
                        self.activation.answered(arrived)
                        arrived = None
                    yield {**head, "choices": [render(choice, item)]}
        else:
            async with contextlib.aclosing(self._interleaved(choices, head, render, arrived)) as chunks:
                async for chunk in chunks:
                    yield chunk
        if req.stream_options is not None and req.stream_options.include_usage:
            yield {**head, "choices": [], "usage": _usage(choices).model_dump()}

    async def _interleaved(
        self,
        choices: list[_Choice],
        head: dict[str, Any],
        render: Callable[[_Choice, dict[str, Any]], dict[str, Any]],
        arrived: float | None,
    ) -> AsyncGenerator[dict[str, Any]]:
        """Several choices' chunks in the order their items come, each choice's stream read by a task of its own."""
        queue: asyncio.Queue[tuple[_Choice, dict[str, Any] | BaseException | None]] = asyncio.Queue()

        async def pump(choice: _Choice) -> None:
            try:
                async for item in self._generate(choice.request, choice.usage):
                    await queue.put((choice, item))
            except BaseException as exc:  # delivered to the reader, which raises it
                await queue.put((choice, exc))
                return
            await queue.put((choice, None))

        tasks = [asyncio.create_task(pump(c)) for c in choices]
        try:
            remaining = len(tasks)
            first = True
            while remaining:
                choice, item = await queue.get()
                if item is None:
                    remaining -= 1
                    continue
                if isinstance(item, BaseException):
                    raise item
                if first:
                    self.activation.answered(arrived)
                    first = False
                yield {**head, "choices": [render(choice, item)]}
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    def _completion_choices(self, req: CompletionRequest) -> list[_Choice]:
        """``n`` choices per prompt, choice ``i * n + j`` the ``j``-th of prompt ``i`` (as OpenAI numbers them)."""
        self._check_model(req.model, "generate", "/v1/completions")
        prompts = self._prompts(req.prompt)
        if req.best_of is not None and req.best_of != req.n:
            raise ApiError(
                400,
                f"best_of {req.best_of} is not supported: every sample is returned, so best_of may only equal "
                f"n ({req.n}).",
                param="best_of",
                code="unsupported_parameter",
            )
        if req.echo and req.logprobs is not None:
            raise ApiError(
                400,
                "echo with logprobs is not supported (it would need the prompt's logprobs); drop one of them.",
                param="echo",
                code="unsupported_parameter",
            )
        params = self._sampling(req, count=len(prompts) * req.n)
        constraint = response_format_constraint(req.response_format)
        if constraint is not None:
            params |= constraint.engine_fields()
        if req.logprobs is not None:
            params |= {"logprobs": True, "top_logprobs": req.logprobs}
        choices: list[_Choice] = []
        for i, prompt in enumerate(prompts):
            request = self._with_prompt(params, prompt)
            echo = prompt if req.echo and isinstance(prompt, str) else None
            if req.echo and echo is None:
                request["echo"] = True  # token ids: the worker decodes them for the echo
            choices.extend(
                _Choice(
                    i * req.n + j,
                    _nth_sample(request, j),
                    echo=echo,
                    echo_tokens=req.echo and echo is None,
                    counts_prompt=j == 0,
                )
                for j in range(req.n)
            )
        return choices

    def _chat_choices(self, req: ChatCompletionRequest) -> list[_Choice]:
        self._check_model(req.model, "generate", "/v1/chat/completions")
        for i, message in enumerate(req.messages):
            if message.content is None and not message.tool_calls:
                raise ApiError(
                    400,
                    f"'messages[{i}].content' is required (only an assistant message with tool_calls may "
                    "leave it out).",
                    param=f"messages[{i}].content",
                    code="invalid_value",
                )
            if message.tool_calls and message.role != "assistant":
                raise ApiError(
                    400,
                    f"'messages[{i}].tool_calls' belongs to assistant messages.",
                    param=f"messages[{i}].tool_calls",
                    code="invalid_value",
                )
            self._check_text(message.content or "", f"messages[{i}].content", allow_empty=True)
        constraint = chat_constraint(req)
        if req.top_logprobs is not None and not req.logprobs:
            raise ApiError(
                400,
                "top_logprobs needs logprobs set to true.",
                param="top_logprobs",
                code="invalid_value",
            )
        params = self._sampling(req, req.max_completion_tokens or req.max_tokens, count=req.n)
        if req.logprobs:
            params |= {"logprobs": True, "top_logprobs": req.top_logprobs or 0}
        if constraint is not None:
            params |= constraint.engine_fields()
        messages = [
            m.model_dump(exclude_none=True, include={"role", "content", "tool_calls", "tool_call_id", "name"})
            for m in req.messages
        ]
        request = {**params, "messages": messages}
        if req.tools is not None and req.tool_choice != "none":
            request["tools"] = [t.model_dump(exclude_none=True, by_alias=True) for t in req.tools]
        tools = constraint if constraint is not None and constraint.tools else None
        return [_Choice(j, _nth_sample(request, j), counts_prompt=j == 0, tools=tools) for j in range(req.n)]

    def _sampling(
        self, req: _GenerationRequest, max_tokens: int | None = None, count: int = 1
    ) -> dict[str, Any]:
        """The engine parameters of a generation request (``count`` engine requests), checked against this
        server's limits."""
        limit = self.config.max_completion_tokens
        max_tokens = max_tokens if max_tokens is not None else (req.max_tokens or 16)
        if max_tokens > limit:
            param = "max_tokens" if req.max_tokens == max_tokens else "max_completion_tokens"
            raise ApiError(
                400,
                f"{param} is {max_tokens}, above this server's limit of {limit}.",
                param=param,
                code="invalid_value",
            )
        stops = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
        if any(s == "" for s in stops):
            raise ApiError(
                400, "stop sequences must not be empty strings.", param="stop", code="invalid_value"
            )
        if count > self.config.max_streams:
            raise ApiError(
                400,
                f"This request asks for {count} generations (prompts x n), above this server's limit of "
                f"{self.config.max_streams} at once.",
                param="n",
                code="invalid_value",
            )
        if self.generations.active + count > self.config.max_streams:
            self.metrics.rejected.labels(reason="queue_full").inc()
            raise queue_full_error(f"{self.config.max_streams} generation requests running")
        return {
            "max_tokens": max_tokens,
            "temperature": req.temperature,
            "top_p": req.top_p,
            "seed": req.seed,
            "stop": stops,
            "top_k": max(0, req.top_k),
            "stop_token_ids": req.stop_token_ids,
            "ignore_eos": req.ignore_eos,
        }

    @staticmethod
    def _with_prompt(params: dict[str, Any], prompt: str | tuple[int, ...]) -> dict[str, Any]:
        return (
            {**params, "prompt": prompt}
            if isinstance(prompt, str)
            else {**params, "prompt_ids": list(prompt)}
        )

    async def _generate(self, request: dict[str, Any], usage: StreamUsage) -> AsyncGenerator[dict[str, Any]]:
        self.metrics.inflight_requests.inc()
        try:
            async with contextlib.aclosing(self.generations.stream(request, usage)) as items:
                async for item in items:
                    yield item
        except StreamInterrupted as exc:
            raise ApiError(
                503, f"The request failed mid-way: {exc}.", type="service_unavailable", code="replica_failure"
            ) from None
        finally:
            self.metrics.inflight_requests.dec()

    async def _run(
        self, inputs: Sequence[str | tuple[int, ...]], key: BatchKey, names: Sequence[str] | None = None
    ) -> list[ItemResult]:
        """Run every input of one request; `names` are the inputs' fields for errors (default `input[i]`
        for embeddings, `prompt[i]` for completions)."""
        # No replica serves (the last one dropped a moment ago, a missed heartbeat that its next one undoes, or
        # a replica being replaced): wait the grace a generation request waits, then refuse.
        if not self.router.serving() and not await self.router.wait_for_serving(
            self.router.no_replica_grace_s
        ):
            self.metrics.rejected.labels(reason="no_replica").inc()
            raise no_replica_error(self.router.no_replica_grace_s)
        try:
            items = self.batcher.enqueue(list(inputs), key)
        except QueueFull as exc:
            self.metrics.rejected.labels(reason="queue_full").inc()
            retry_after = self.router.retry_after_s(self.batcher.depth, self.batcher.params.max_batch_size)
            raise queue_full_error(str(exc), retry_after) from None
        self.metrics.inflight_requests.inc()
        field = "input" if key.task == "embed" else "prompt"
        try:
            return await self._gather(items, names or [f"{field}[{i}]" for i in range(len(items))])
        finally:
            self.metrics.inflight_requests.dec()

    async def _gather(self, items: list[QueuedItem], names: Sequence[str]) -> list[ItemResult]:
        futures = [item.future for item in items]
        _, pending = await asyncio.wait(futures, timeout=self.config.request_timeout_s)
        try:
            if pending:
                raise ApiError(
                    504,
                    f"The request did not complete within {self.config.request_timeout_s:g} s.",
                    type="timeout",
                    code="timeout",
                )
            for name, future in zip(names, futures, strict=True):
                if isinstance(future.exception(), InputRejected):
                    raise ApiError(
                        400, f"'{name}' was refused: {future.exception()}.", param=name, code="invalid_value"
                    )
            return [f.result() for f in futures]
        except NoReplica as exc:
            raise ApiError(
                503,
                f"No replica could serve this request: {exc}.",
                type="service_unavailable",
                code="no_replica",
                headers={"Retry-After": "1"},
            ) from None
        except ReplicaFailure as exc:
            raise ApiError(
                503,
                f"The request failed on two replicas: {exc}.",
                type="service_unavailable",
                code="replica_failure",
                headers={"Retry-After": "1"},
            ) from None
        except BatchFailure as exc:
            raise ApiError(500, f"The model failed on this batch: {exc}", type="server_error") from None
        finally:
            self.batcher.discard(items)
            for f in pending:
                f.cancel()

    # -- validation beyond the schema ----------------------------------------------------------------------------

    def _check_model(self, model: str, task: Task, endpoint: str) -> None:
        if model != self.config.served_name:
            raise ApiError(
                404,
                f"The model '{model}' does not exist; this server serves '{self.config.served_name}'.",
                type="not_found_error",
                param="model",
                code="model_not_found",
            )
        if task != self.config.task:
            other = "/v1/embeddings" if self.config.task == "embed" else "/v1/completions"
            raise ApiError(
                400,
                f"The model '{model}' serves task '{self.config.task}', not {endpoint}; use {other}.",
                param="model",
                code="wrong_endpoint",
            )

    def _embedding_inputs(
        self, raw: str | list[str] | list[int] | list[list[int]]
    ) -> list[str | tuple[int, ...]]:
        if isinstance(raw, str):
            self._check_text(raw, "input")
            return [raw]
        if not raw:
            raise ApiError(400, "'input' must not be an empty array.", param="input", code="invalid_value")
        if all(isinstance(x, int) for x in raw):
            return [self._token_ids(raw, "input")]  # type: ignore[arg-type]
        self._check_count(raw, "input")
        out: list[str | tuple[int, ...]] = []
        for i, x in enumerate(raw):
            if isinstance(x, str):
                self._check_text(x, f"input[{i}]")
                out.append(x)
            else:
                assert isinstance(x, list)
                out.append(self._token_ids(x, f"input[{i}]"))
        return out

    def _prompts(self, raw: str | list[str] | list[int] | list[list[int]]) -> list[str | tuple[int, ...]]:
        """Text prompts, or token-id prompts (a generate worker takes either; a request holds one kind)."""
        if isinstance(raw, str):
            self._check_text(raw, "prompt")
            return [raw]
        if not raw:
            raise ApiError(400, "'prompt' must not be an empty array.", param="prompt", code="invalid_value")
        if all(isinstance(x, int) for x in raw):
            return [self._token_ids(raw, "prompt", accepted=True)]  # type: ignore[arg-type]
        self._check_count(raw, "prompt")
        kinds = {isinstance(x, str) for x in raw}
        if len(kinds) > 1:
            raise ApiError(
                400,
                "'prompt' mixes strings and token-id arrays; send one kind.",
                param="prompt",
                code="invalid_value",
            )
        out: list[str | tuple[int, ...]] = []
        for i, x in enumerate(raw):
            if isinstance(x, str):
                self._check_text(x, f"prompt[{i}]")
                out.append(x)
            else:
                assert isinstance(x, list)
                out.append(self._token_ids(x, f"prompt[{i}]", accepted=True))
        return out

    def _token_ids(self, ids: list[int], param: str, accepted: bool = False) -> tuple[int, ...]:
        if not (accepted or self.config.accepts_token_ids):
            raise ApiError(
                400,
                f"'{param}' holds token ids; this server accepts text only. Send strings.",
                param=param,
                code="unsupported_input",
            )
        if not ids:
            raise ApiError(400, f"'{param}' must not be an empty array.", param=param, code="invalid_value")
        if len(ids) > self.config.max_input_token_ids:
            raise ApiError(
                400,
                f"'{param}' has {len(ids)} tokens, above the limit of {self.config.max_input_token_ids}.",
                param=param,
                code="input_too_long",
            )
        if any(t < 0 for t in ids):
            raise ApiError(400, f"'{param}' holds a negative token id.", param=param, code="invalid_value")
        vocab = self.config.vocab_size or MAX_TOKEN_ID + 1
        if any(t >= vocab for t in ids):
            raise ApiError(
                400,
                f"'{param}' holds token id {max(ids)}, outside this model's vocabulary of {vocab} ids.",
                param=param,
                code="invalid_value",
            )
        context = self.config.context_length
        if accepted and context is not None and len(ids) >= context:
            raise ApiError(
                400,
                f"'{param}' has {len(ids)} tokens; this model's context holds {context} positions, prompt and "
                "completion together.",
                param=param,
                code="input_too_long",
            )
        return tuple(ids)

    def _check_count(self, inputs: Sequence[object], param: str) -> None:
        if not inputs:
            raise ApiError(400, f"'{param}' must not be an empty array.", param=param, code="invalid_value")
        if len(inputs) > self.config.max_inputs_per_request:
            raise ApiError(
                400,
                f"'{param}' has {len(inputs)} items, above the limit of {self.config.max_inputs_per_request} "
                "per request.",
                param=param,
                code="too_many_inputs",
            )

    def _check_text(self, text: str, param: str, allow_empty: bool = False) -> None:
        if not allow_empty and not text.strip():
            raise ApiError(400, f"'{param}' must not be empty.", param=param, code="invalid_value")
        if len(text) > self.config.max_input_chars:
            raise ApiError(
                400,
                f"'{param}' is {len(text)} characters long, above the limit of {self.config.max_input_chars}.",
                param=param,
                code="input_too_long",
            )

    @staticmethod
    def _dimensions_error(asked: int, native: int) -> ApiError:
        return ApiError(
            400,
            f"This model returns {native}-dimensional embeddings; 'dimensions' {asked} is not supported.",
            param="dimensions",
            code="invalid_value",
        )

    # -- admin -------------------------------------------------------------------------------------------------

    def adjust_batch_params(self, max_batch_size: int | None, max_wait_ms: float | None) -> dict[str, Any]:
        """Set the batcher's limits (either or both); batching happens here, so nothing is sent to workers."""
        current = self.batcher.params
        params = BatchParams(
            max_batch_size if max_batch_size is not None else current.max_batch_size,
            max_wait_ms / 1000.0 if max_wait_ms is not None else current.max_wait_s,
        )
        self.batcher.set_params(params)
        return {"max_batch_size": params.max_batch_size, "max_wait_ms": params.max_wait_s * 1000.0}


def _finish(usage: StreamUsage, tool_calls: bool = False) -> Literal["stop", "length", "tool_calls"]:
    if usage.finish_reason == "length":
        return "length"
    return "tool_calls" if tool_calls else "stop"


def _usage(choices: list[_Choice]) -> Usage:
    """Tokens returned by every choice; a prompt's tokens counted once, however many choices it has."""
    prompt = sum(c.usage.prompt_tokens for c in choices if c.counts_prompt)
    completion = sum(c.usage.completion_tokens for c in choices)
    return Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)


@dataclass(slots=True)
class _Choice:
    """One choice of a response: its engine request, its counts, and the prompt echoed before its text."""

    index: int
    request: dict[str, Any]
    echo: str | None = None  # a text prompt echoed
    echo_tokens: bool = False  # a token-id prompt echoed: its text comes with the engine's answer
    counts_prompt: bool = True  # the first choice of its prompt: usage counts the prompt's tokens once
    usage: StreamUsage = field(default_factory=StreamUsage)
    tools: Constraint | None = (
        None  # tool calls: the text is read as tool calls (forced) or may hold them (auto)
    )

    def reader(self) -> ToolReader | None:
        """The reader of this choice's text (once the worker has answered: auto's format is in its answer)."""
        if self.tools is None:
            return None
        return tool_reader(self.tools, self.usage.tool_call_format)

    def prefix(self) -> str:
        if self.echo is not None:
            return self.echo
        return (self.usage.prompt_text or "") if self.echo_tokens else ""


def _nth_sample(request: dict[str, Any], j: int) -> dict[str, Any]:
    """The ``j``-th of ``n`` samples of a request: a seeded request's samples draw with seeds seed + j (so
    they differ from each other, and each is reproducible)."""
    if j == 0:
        return request
    seed = request.get("seed")
    if seed is not None:
        seed = (seed + j + 2**63) % 2**64 - 2**63
    return {**request, "seed": seed}


async def _all_or_none(calls: list[Coroutine[Any, Any, _T]]) -> list[_T]:
    """Every call's result in order; when one fails, the others are cancelled (their generation requests
    with them) and its error is raised."""
    tasks = [asyncio.create_task(call) for call in calls]
    try:
        done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        for task in tasks:
            if task in done and task.exception() is not None:
                raise task.exception()  # type: ignore[misc]
        return [task.result() for task in tasks]
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
