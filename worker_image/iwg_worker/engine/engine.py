"""`GenerationEngine`: transformers' continuous-batching engine with per-request streams, as a worker runs it.

transformers' `ContinuousBatchingManager` runs the steps on a thread of its own: requests join and leave the
running batch at every step, prefill of new requests is batched with the decodes, and the KV cache is paged
and bounded (``num_blocks`` or a fraction of free memory); when it is full, requests wait, or running ones are
offloaded and resumed later. This class adds what serving needs around it:

- requests are checked before they enter (`parse_request`): one bad request is refused alone;
- sampling is per request and seeded (`RequestSampler`), logprobs are kept per token; a request with a JSON
  schema has its logits masked by xgrammar (structured outputs, `structured.py`) in the same step as the others;
- every step's new tokens of every running request leave as ONE list of stream items handed to the sink (the
  worker's output path sends it as one ``stream`` message), with stop strings found while decoding;
- cancelling a request frees its cache blocks at the next step;
- prefix caching (transformers' block sharing): a prompt's full blocks already in the cache, from a request
  running or finished, are shared instead of computed again (finished requests' blocks stay cached until the
  cache needs the room); the prompt tokens looked up and found are counted as vLLM counts them;
- the counts a scheduler and an autoscaler read: running, waiting, KV-cache usage, prefix-cache queries and
  hits.

Sharded over a replica's ranks (tensor parallel), the engine runs on every rank and every step runs on all of
them together: transformers' engine makes the replica's rank 0 its driver, which alone admits and cancels
requests; at each step it sends the new requests and cancellations to the other ranks (over a gloo group of
the replica), and all ranks schedule the same batch. Only rank 0 has streams: the other ranks' `add` and
`cancel` do nothing, and their outputs go nowhere.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from transformers import GenerationConfig
from transformers.generation.configuration_utils import ContinuousBatchingConfig
from transformers.generation.continuous_batching.continuous_api import BackgroundThreadStatus, OutputRouter

from iwg_worker.engine.front import RequestFront
from iwg_worker.engine.requests import GenerationRequest, ModelLimits, RequestRejected
from iwg_worker.engine.sampler import PARAMS_KEY, RequestSampler, TokenLogprobs, sampler_list
from iwg_worker.engine.streams import RequestStream
from iwg_worker.engine.structured import BACKEND, matcher
from iwg_worker.protocol import REPLICA_FAILURE

log = logging.getLogger(__name__)

StreamSink = Callable[[list[dict[str, Any]]], None]

# On CPU, without a size given, the cache takes this share of available memory, at most this many bytes.
CPU_DEFAULT_FRACTION = 0.25
CPU_DEFAULT_MAX_BYTES = 2 * 1024**3
CPU_DEFAULT_MAX_BLOCKS = 4096  # a small model's blocks are small: no more than this many by default
CPU_DEFAULT_BATCH_TOKENS = 1024
START_TIMEOUT_S = 120.0
# How often the engine's loop is checked for having ended (see `GenerationEngine._watch_loop`).
WATCH_INTERVAL_S = 0.05


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """KV cache size (``num_blocks`` wins over ``memory_fraction``; neither: a default for the device) and the
    most tokens one step computes (prefill chunks included)."""

    num_blocks: int | None = None
    memory_fraction: float | None = None
    max_batch_tokens: int | None = None
    page_size: int = 64


class GenerationEngine(RequestFront):
    def __init__(
        self, model: Any, tokenizer: Any, config: EngineConfig, available_memory: int | None = None
    ) -> None:
        self.model = model
        self.tokenizer = tokenizer
        text_config = model.config.get_text_config()
        self.limits = ModelLimits(
            context_length=int(getattr(text_config, "max_position_embeddings", 2048)),
            vocab_size=int(text_config.vocab_size),
        )
        self.eos_token_ids = frozenset(
            _ids(model.generation_config.eos_token_id) | _ids(text_config.eos_token_id)
        )
        num_blocks = config.num_blocks
        fraction = config.memory_fraction
        batch_tokens = config.max_batch_tokens
        if model.device.type == "cpu":
            if num_blocks is None and fraction is None:
                budget = min(CPU_DEFAULT_MAX_BYTES, int((available_memory or 0) * CPU_DEFAULT_FRACTION))
                blocks = budget // self._bytes_per_block(text_config, config.page_size)
                num_blocks = max(16, min(CPU_DEFAULT_MAX_BLOCKS, blocks))
            batch_tokens = batch_tokens or CPU_DEFAULT_BATCH_TOKENS
        self.cb_config = ContinuousBatchingConfig(
            page_size=config.page_size,
            num_blocks=num_blocks,
            max_memory_percent=fraction,
            max_batch_tokens=batch_tokens,
            use_async_batching=False,
            auto_switch_to_flash=False,
            scheduler_type="fifo",
            allow_block_sharing=True,
        )
        generation_config = GenerationConfig(  # type: ignore[no-untyped-call]
            do_sample=False,  # RequestSampler decides every token; the engine takes its one-hot rows
            max_new_tokens=self.limits.context_length,
            eos_token_id=sorted(self.eos_token_ids) or -1,
            pad_token_id=getattr(model.generation_config, "pad_token_id", None),
        )
        self.sampler = RequestSampler()
        self._streams: dict[str, RequestStream] = {}
        self._lock = threading.Lock()
        self._sink: StreamSink | None = None
        self.prefix_queries = 0  # prompt tokens looked up in the prefix cache
        self.prefix_hits = 0  # of them, found
        self.prefix_evictions = 0  # times every cached block no request holds was dropped for room
        self._looked_up: set[str] = set()  # requests already counted (a request may be looked up again)
        self.manager: Any = model.init_continuous_batching(
            generation_config=generation_config, continuous_batching_config=self.cb_config
        )
        # On the other ranks of a sharded replica nobody reads the logprobs: they are not kept there.
        self.sampler.keep_logprobs = self.is_driver
        self.manager.logit_processor = sampler_list(self.sampler)
        self.manager.output_router = _StepOutputs(self)
        self.manager.start()
        self._wait_started()
        self._count_prefix_matches(self.manager.batch_processor.cache)
        threading.Thread(target=self._watch_loop, name="engine-watch", daemon=True).start()

    def _wait_started(self) -> None:
        """The engine's thread sizes and allocates the cache first: wait for that, so that a cache that
        cannot be had fails the worker's start (with the reason) instead of every request later."""
        deadline = time.monotonic() + START_TIMEOUT_S
        while self.manager.batch_processor is None:
            if not self.manager.is_running() or time.monotonic() > deadline:
                self.manager.stop(block=False)
                error = self.manager.background_thread_status.fatal_error
                raise RuntimeError(f"the generation engine did not start: {error or 'timed out'}")
            time.sleep(0.01)

    def _count_prefix_matches(self, cache: Any) -> None:
        """Count each request's prefix-cache lookup (its prompt tokens) and match (the tokens shared), once per
        request: transformers looks a waiting request up again at every step it could not be scheduled, and
        counts nothing itself. Its scheduler calls ``cache.search_prefix_match`` on the engine's thread. And
        count its evictions: when it needs room it drops every cached block no running request holds, at once
        (``cache.evict_cached_blocks``), which the driver's routing table follows."""
        search = cache.search_prefix_match

        def counted(request_id: str, prompt_ids: list[int]) -> int:
            matched = int(search(request_id, prompt_ids))
            with self._lock:
                if request_id not in self._looked_up:
                    self._looked_up.add(request_id)
                    self.prefix_queries += len(prompt_ids)
                if matched:
                    self.prefix_hits += matched
            return matched

        evict = cache.evict_cached_blocks

        def counted_eviction() -> bool:
            evicted = bool(evict())
            if evicted:
                with self._lock:
                    self.prefix_evictions += 1
            return evicted

        if getattr(cache, "use_prefix_sharing", False):
            cache.search_prefix_match = counted
            cache.evict_cached_blocks = counted_eviction

    @staticmethod
    def _bytes_per_block(text_config: Any, page_size: int) -> int:
        heads = getattr(text_config, "num_key_value_heads", None) or text_config.num_attention_heads
        head_dim = (
            getattr(text_config, "head_dim", None)
            or text_config.hidden_size // text_config.num_attention_heads
        )
        return int(2 * text_config.num_hidden_layers * heads * head_dim * page_size * 4)

    # -- requests ------------------------------------------------------------------------------------------

    def set_sink(self, sink: StreamSink | None) -> None:
        """Where each step's stream items go (the worker's output path)."""
        self._sink = sink

    @property
    def is_driver(self) -> bool:
        """Whether this rank admits requests (always with one rank; rank 0 of a sharded replica)."""
        return bool(self.manager.is_tp_driver)

    def _admit(self, request: GenerationRequest) -> None:
        params = request.params
        with self._lock:
            if request.request_id in self._streams:
                raise RequestRejected(
                    "id", f"request id {request.request_id!r} is already running", "duplicate"
                )
            self._streams[request.request_id] = self._stream(request)
        eos = set(params.stop_token_ids) | (set() if params.ignore_eos else set(self.eos_token_ids))
        if request.grammar is not None:
            self.sampler.constrain(request.request_id, matcher(request.grammar, self.eos_token_ids))
        accepted = self.manager.add_request(
            list(request.prompt_ids),
            request_id=request.request_id,
            max_new_tokens=params.max_tokens,
            streaming=True,
            eos_token_id=sorted(eos) or -1,
            **{PARAMS_KEY: params},
        )
        if accepted is None:
            with self._lock:
                self._streams.pop(request.request_id, None)
            self.sampler.forget(request.request_id)
            raise RequestRejected(
                "request", "the engine is not accepting requests (stopping or failed)", "unavailable"
            )

    def cancel(self, request_ids: list[str]) -> int:
        """Stop requests now: nothing more is sent for them; their cache blocks are freed at the next step."""
        cancelled = 0
        for request_id in request_ids:
            with self._lock:
                stream = self._streams.pop(request_id, None)
                self._looked_up.discard(request_id)
            if stream is not None:
                cancelled += 1
                self.manager.cancel_request(request_id)
                self.sampler.forget(request_id)
        return cancelled

    # -- each step (on the engine's thread) ------------------------------------------------------------------

    def _on_outputs(self, outputs: list[Any]) -> None:
        items: list[dict[str, Any]] = []
        for output in outputs:
            with self._lock:
                stream = self._streams.get(output.request_id)
            if stream is None:
                continue  # cancelled meanwhile
            try:
                item = self._next_item(stream, output)
            except Exception as exc:  # this request's output alone is broken: it fails, the engine goes on
                log.exception("request %s: its output could not be processed", output.request_id)
                self.manager.cancel_request(output.request_id)
                item = stream.failed(f"{type(exc).__name__}: {exc}")
            if item is not None:
                items.append(item)
            if stream.finished:
                with self._lock:
                    self._streams.pop(output.request_id, None)
                    self._looked_up.discard(output.request_id)
                self.sampler.forget(output.request_id)
        if items and self._sink is not None:
            try:
                self._sink(items)
            except Exception:
                log.exception("the stream sink failed; %d items lost", len(items))

    def _next_item(self, stream: RequestStream, output: Any) -> dict[str, Any] | None:
        if output.error is not None:
            # transformers fails a request on its own (nothing stops), or every request when its step raised
            # (a collective whose peer rank died, ...) and its loop stops: then the replica failed, not this
            # request, and the driver may run it elsewhere.
            code = REPLICA_FAILURE if self._engine_stopping() else None
            return stream.failed(f"the engine failed this request: {output.error}", code)
        take = None
        if stream.request.params.logprobs or stream.request.params.top_logprobs:
            request_id = output.request_id

            def take(count: int) -> list[TokenLogprobs]:
                return self.sampler.take_logprobs(request_id, count)

        item, stop_now = stream.update(list(output.generated_tokens), output.is_finished(), take)
        if stop_now:  # a stop string: the engine would go on
            self.manager.cancel_request(output.request_id)
        return item

    def _watch_loop(self) -> None:
        """When the engine's loop ends (a step raised, e.g. an all-reduce whose peer rank died; or it was
        stopped), fail every request still open as the replica's failure. transformers fails the requests it
        holds, but not those it had taken off its input queue for the step that raised: they would wait for the
        executor to notice the lost rank, seconds later."""
        while self.manager.is_running():
            time.sleep(WATCH_INTERVAL_S)
        with self._lock:
            streams = list(self._streams.values())
            self._streams.clear()
        if not streams:
            return
        error = self.manager.background_thread_status.fatal_error
        reason = f"the engine stopped: {type(error).__name__}: {error}" if error else "the engine stopped"
        log.warning("%s; failing its %d open request(s)", reason, len(streams))
        items = [stream.failed(reason, REPLICA_FAILURE) for stream in streams]
        for stream in streams:
            self.sampler.forget(stream.request.request_id)
        if self._sink is not None:
            try:
                self._sink(items)
            except Exception:
                log.exception("the stream sink failed; %d items lost", len(items))

    def _engine_stopping(self) -> bool:
        """Whether the engine's loop is stopping (a step raised, or it was asked to stop)."""
        status = getattr(self.manager, "background_thread_status", None)
        return status is not None and int(status.local_status) != BackgroundThreadStatus.DONT_STOP

    # -- state -------------------------------------------------------------------------------------------------

    @property
    def running(self) -> bool:
        return bool(self.manager.is_running())

    def stats(self, blocks_since: list[int] | None = None) -> dict[str, Any]:
        """Requests, KV cache use, prefix-cache counters. `blocks_since` is for vLLM's engine (it reports its
        blocks one by one); this engine evicts every cached block at once and counts it
        (``prefix_cache_evictions``), which the drivers follow."""
        processor = self.manager.batch_processor
        running = waiting = 0
        used = total = 0
        if processor is not None:
            scheduler = processor.scheduler
            running = len(scheduler.active_requests)
            waiting = len(scheduler.waiting_requests)
            for allocator in processor.cache.cache_allocators.values():
                tables = list(allocator.block_table.values())
                used += len({block for table in tables for block in table})
                total += allocator.num_blocks
        waiting += self.manager.input_queue.qsize()
        return {
            "requests_running": running,
            "requests_waiting": waiting,
            "streams": len(self._streams),
            "kv_cache_blocks_used": used,
            "kv_cache_blocks_total": total,
            "kv_cache_usage": used / total if total else 0.0,
            "block_size": self.cb_config.page_size,
            "prefix_cache_queries": self.prefix_queries,
            "prefix_cache_hits": self.prefix_hits,
            "prefix_cache_evictions": self.prefix_evictions,
            "structured_outputs": BACKEND,
            "tool_call_format": self.tool_call_format(),
            "engine_running": self.running,
        }

    def parameter_bytes(self) -> int:
        """Bytes of the weights this rank holds (its shards when the replica is sharded)."""
        from iwg_worker.models.sharding import local_parameter_bytes

        return local_parameter_bytes(self.model)

    def shutdown(self) -> None:
        if self.manager.is_running():
            self.manager.stop(block=True, timeout=10, hard_stop=True)


class _StepOutputs(OutputRouter):
    """transformers' output router, replaced: each step's outputs go to the engine together."""

    def __init__(self, engine: GenerationEngine) -> None:
        super().__init__()
        self._engine = engine

    def deliver(self, output: Any) -> None:
        self._engine._on_outputs([output])

    def deliver_batch(self, outputs: list[Any]) -> None:
        self._engine._on_outputs(outputs)


def _ids(value: Any) -> set[int]:
    if value is None:
        return set()
    if isinstance(value, int):
        return {value} if value >= 0 else set()
    return {int(v) for v in value if int(v) >= 0}
