"""`TorchWorker`: the CUDA/CPU implementation of `WorkerBase` for the ``embed`` and ``generate`` tasks."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from iwg_worker import distributed

if TYPE_CHECKING:
    from iwg_worker.engine.engine import EngineConfig, GenerationEngine
    from iwg_worker.engine.vllm_engine import VllmEngine
from iwg_worker.model_dir import read_config
from iwg_worker.worker_base import WorkerBase, WorkerConfig

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def auto_dtype(model_config: dict[str, Any] | None, device_type: str) -> torch.dtype:
    """`dtype: auto`: the dtype the model's `config.json` names (`torch_dtype`, or `dtype` in newer
    transformers), float32 when it names none; on a CPU a half-precision model runs in float32 (CPUs have few
    half-precision kernels, and those are slow)."""
    named = None
    if model_config is not None:
        named = model_config.get("torch_dtype") or model_config.get("dtype")
    dtype = _DTYPES.get(named, torch.float32) if isinstance(named, str) else torch.float32
    if device_type == "cpu" and dtype in (torch.float16, torch.bfloat16):
        return torch.float32
    return dtype


CGROUP_ROOT = Path("/sys/fs/cgroup")
_UNLIMITED = 1 << 60  # cgroup v1 writes "no limit" as a number near 2**63


def cgroup_memory(root: Path = CGROUP_ROOT) -> tuple[int, int] | None:
    """(limit, usage) in bytes of this process's memory cgroup (a pod's limits.memory), None without a limit:
    cgroup v2's memory.max and memory.current, or v1's memory.limit_in_bytes and memory.usage_in_bytes."""
    for limit_file, usage_file in (
        ("memory.max", "memory.current"),
        ("memory/memory.limit_in_bytes", "memory/memory.usage_in_bytes"),
    ):
        try:
            raw = (root / limit_file).read_text().strip()
            if raw == "max":
                return None
            limit, usage = int(raw), int((root / usage_file).read_text().strip())
        except (OSError, ValueError):
            continue
        return None if limit >= _UNLIMITED else (limit, usage)
    return None


def host_memory_info(cgroup_root: Path = CGROUP_ROOT) -> tuple[int, int]:
    """(available, total) bytes of memory this process may use: the host's (/proc/meminfo where present),
    bounded by its memory cgroup's limit where one is set (a pod's limit, not the node's memory: sizing a KV
    cache from the node's would ask for more than the container may hold)."""
    try:
        fields = {}
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                name, value = line.split(":", 1)
                fields[name] = int(value.split()[0]) * 1024
        available, total = fields["MemAvailable"], fields["MemTotal"]
    except (OSError, KeyError, ValueError):
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        available = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
    bounded = cgroup_memory(cgroup_root)
    if bounded is not None:
        limit, usage = bounded
        total = min(total, limit)
        available = min(available, max(0, limit - usage))
    return available, total


class TorchWorker(WorkerBase):
    def __init__(self, config: WorkerConfig) -> None:
        super().__init__(config)
        self.device: torch.device | None = None
        self.device_note = ""
        self.dtype = torch.float32
        self.model: Any = None
        self.last_step_s: float | None = None
        self.last_step_at: float | None = None
        self.steps = 0
        self.distributed_backend: str | None = None
        self.engine_name: str | None = None  # generate: the engine resolved from config.engine
        self._stream_sink: Callable[[list[dict[str, Any]]], None] | None = None

    # -- WorkerBase ------------------------------------------------------------------------------------

    def init_device(self) -> None:
        wanted = self.config.device
        cuda = torch.cuda.is_available()
        if wanted == "cuda" and not cuda:
            raise RuntimeError("device 'cuda' was requested but torch sees no CUDA device")
        if wanted == "cuda" or (wanted == "auto" and cuda):
            self.device = torch.device("cuda", distributed.cuda_index())
            torch.cuda.set_device(self.device)
            self.device_note = torch.cuda.get_device_name(self.device)
        else:
            self.device = torch.device("cpu")
            self.device_note = "CPU: no CUDA device available" if wanted == "auto" else "CPU: requested"
        if self.config.dtype == "auto":
            config = read_config(Path(self.config.model_path)) if self.config.model_path else None
            self.dtype = auto_dtype(config, self.device.type)
        else:
            self.dtype = _DTYPES[self.config.dtype]
        if self.config.world_size > 1:
            self._refuse_unshardable()
            self.distributed_backend = distributed.init_distributed(
                distributed.Rendezvous.from_env(), self.device
            )

    def _refuse_unshardable(self) -> None:
        """`ShardingRefused` (naming the architecture) for a model that cannot be sharded worldSize ways: read
        from its configuration before the ranks meet and before any weight is read."""
        if self.config.task == "none":
            return
        from iwg_worker.models.loading import model_source
        from iwg_worker.models.sharding import check_shardable, load_config

        source = model_source(self.config.model_path)
        check_shardable(load_config(source.directory, **source.pretrained_kwargs()), self.config.world_size)

    def load_model(self) -> None:
        """Load this rank's part of the model: all of it with worldSize 1, else a 1/worldSize shard (tensor
        parallel over the replica's process group; `init_device` has refused a model that cannot be sharded)."""
        device = self._require_device()
        world_size = self.config.world_size
        if self.config.task == "embed":
            from iwg_worker.models.embed import EmbeddingModel

            self.model = EmbeddingModel(
                self.config.model_path, device, self.dtype, self.config.max_seq_length, world_size
            )
        elif self.config.task == "generate":
            from iwg_worker.engine.choice import resolve_engine

            self.engine_name = resolve_engine(
                self.config.engine, self.config.model_path, device.type, self.config.world_size
            )
            self.model = self._load_vllm(device) if self.engine_name == "vllm" else self._load_transformers()
            if self._stream_sink is not None:
                self.model.set_sink(self._stream_sink)

    def _engine_config(self) -> EngineConfig:
        from iwg_worker.engine.engine import EngineConfig

        return EngineConfig(
            num_blocks=self.config.kv_cache_blocks, memory_fraction=self.config.kv_cache_memory_fraction
        )

    def _load_transformers(self) -> GenerationEngine:
        from iwg_worker.engine.engine import GenerationEngine
        from iwg_worker.models.loading import load_causal_lm, load_tokenizer, model_source
        from iwg_worker.models.sharding import distributed_kwargs

        device = self._require_device()
        world_size = self.config.world_size
        source = model_source(self.config.model_path)
        # transformers' continuous batching reads the KV cache through its paged attention.
        model = load_causal_lm(
            source, self.dtype, attn_implementation="sdpa", **distributed_kwargs(world_size)
        )
        if world_size == 1:
            model = model.to(device)  # sharded, transformers has placed each rank's part already
        model = model.eval()
        tokenizer = load_tokenizer(source, self.config.chat_template) if source.has_tokenizer else None
        return GenerationEngine(model, tokenizer, self._engine_config(), self.get_memory_info()[0])

    def _load_vllm(self, device: torch.device) -> VllmEngine:
        from iwg_worker.engine.vllm_engine import VllmEngine, VllmOptions
        from iwg_worker.models.loading import load_tokenizer, model_source

        source = model_source(self.config.model_path)
        options = VllmOptions(
            dtype=str(self.dtype).removeprefix("torch."),
            device_type=device.type,
            world_size=self.config.world_size,
            rank=self.config.rank,
            enforce_eager=self.config.enforce_eager,
            available_memory=self.get_memory_info()[0],
        )
        tokenizer = load_tokenizer(source, self.config.chat_template) if source.has_tokenizer else None
        return VllmEngine(self.config.model_path, tokenizer, self._engine_config(), options)

    def execute_model(self, batch: dict[str, Any]) -> dict[str, Any]:
        if not isinstance(batch, dict):
            raise TypeError(f"batch must be a map, got {type(batch).__name__}")
        if self.model is None:
            raise RuntimeError(f"no model loaded (task {self.config.task!r})")
        started = time.perf_counter()
        if self.config.task == "generate":
            raise TypeError("a generate worker streams: send requests with engine_add, not execute_model")
        if self.config.task == "embed":
            if "inputs" not in batch:
                raise ValueError("an embed batch needs field 'inputs' (a list of strings)")
            embeddings, counts = self.model.embed_counted(batch["inputs"])
            result: dict[str, Any] = {"embeddings": embeddings, "prompt_tokens": counts}
        self.last_step_s = time.perf_counter() - started
        self.last_step_at = time.time()
        self.steps += 1
        return result

    def get_memory_info(self) -> tuple[int, int]:
        device = self.device
        if device is not None and device.type == "cuda":
            free, total = torch.cuda.mem_get_info(device)
            return int(free), int(total)
        return host_memory_info()

    def check_health(self) -> dict[str, Any]:
        free, total = self.get_memory_info() if self.device is not None else (0, 0)
        return {
            "device": str(self.device) if self.device is not None else None,
            "device_available": self._device_available(),
            "device_note": self.device_note,
            "cpu": self.device is not None and self.device.type == "cpu",
            "memory_free_bytes": free,
            "memory_total_bytes": total,
            "model_loaded": self.model is not None or self.config.task == "none",
            "engine_running": self.model.running if isinstance(self.model, _engine_type()) else None,
            "task": self.config.task,
            "engine": self.engine_name,
            "last_step_s": self.last_step_s,
            "last_step_at": self.last_step_at,
            "steps": self.steps,
            "distributed": self.distributed_backend,
        }

    def set_stream_sink(self, sink: Callable[[list[dict[str, Any]]], None]) -> None:
        self._stream_sink = sink
        if isinstance(self.model, _engine_type()):
            self.model.set_sink(sink)

    def shutdown(self) -> None:
        if isinstance(self.model, _engine_type()):
            self.model.shutdown()
        self.model = None
        # No destroy_process_group here: rank 0 hosts the rendezvous store and would wait for the other
        # ranks, which may already be gone; the process is about to exit, which frees the group anyway.
        if self.device is not None and self.device.type == "cuda":
            torch.cuda.empty_cache()

    # -- public methods callable by name --------------------------------------------------------------

    def tp_reference(self, x: torch.Tensor, seed: int, hidden: int, reduce: bool = True) -> torch.Tensor:
        """Run the tensor-parallel reference MLP on this replica's ranks (all ranks must be called);
        ``reduce=False``: this rank's shard alone, without the all-reduce."""
        device = self._require_device()
        w1, b1, w2, b2 = distributed.reference_weights(seed, x.shape[-1], hidden)
        module = distributed.TensorParallelMLP(w1, b1, w2, b2, self.config.rank, self.config.world_size).to(
            device
        )
        result: torch.Tensor = module(x.double().to(device), reduce=reduce).cpu()
        return result

    def engine_add(self, requests: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Admit generation requests into this replica's engine; one answer per request (see GenerationEngine)."""
        return self._engine().add(requests)

    def engine_cancel(self, request_ids: list[str]) -> int:
        """Stop generation requests; their KV cache blocks are freed at the engine's next step."""
        if not isinstance(request_ids, list) or not all(isinstance(r, str) for r in request_ids):
            raise TypeError("engine_cancel takes a list of request ids")
        return self._engine().cancel(request_ids)

    def engine_stats(self, blocks_since: list[int] | None = None) -> dict[str, Any]:
        """Requests running and waiting, KV cache blocks used and total, prefix-cache counters; with
        `blocks_since` ([epoch, seq] of the caller's last report, or []), what the engine's prefix cache stored
        and evicted since (vLLM's engine)."""
        if blocks_since is not None and (
            not isinstance(blocks_since, list)
            or len(blocks_since) not in (0, 2)
            or not all(type(v) is int for v in blocks_since)
        ):
            raise TypeError("engine_stats takes [epoch, seq] or []")
        return self._engine().stats(blocks_since)

    def _engine(self) -> GenerationEngine | VllmEngine:
        if not isinstance(self.model, _engine_type()):
            raise RuntimeError(f"this worker runs task {self.config.task!r}, not a generation engine")
        return self.model

    def describe(self) -> dict[str, Any]:
        return {
            "task": self.config.task,
            "served_name": self.config.served_name,
            "replica": self.config.replica,
            "rank": self.config.rank,
            "world_size": self.config.world_size,
            "device": str(self.device),
            "dtype": str(self.dtype).removeprefix("torch."),
            "parameter_bytes": self._parameter_bytes(),
        }

    def _parameter_bytes(self) -> int | None:
        """Bytes of the weights this rank holds (1/worldSize of the model when sharded)."""
        if isinstance(self.model, _engine_type()):
            return self.model.parameter_bytes()
        from iwg_worker.models.sharding import local_parameter_bytes

        module = getattr(self.model, "model", None)
        return local_parameter_bytes(module) if isinstance(module, torch.nn.Module) else None

    # -- internals ------------------------------------------------------------------------------------

    def _require_device(self) -> torch.device:
        if self.device is None:
            raise RuntimeError("init_device() must run before this call")
        return self.device

    def _device_available(self) -> bool:
        if self.device is None:
            return False
        if isinstance(self.model, _engine_type()) and not self.model.running:
            return False  # the engine's thread died: this worker can no longer serve
        if self.device.type == "cuda":
            return bool(torch.cuda.is_available())
        return True


def _engine_type() -> tuple[type[GenerationEngine], type[VllmEngine]]:
    """The generation engines' classes (imported when asked: the vLLM module imports vLLM only when used)."""
    from iwg_worker.engine.engine import GenerationEngine
    from iwg_worker.engine.vllm_engine import VllmEngine

    return GenerationEngine, VllmEngine
