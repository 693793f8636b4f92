"""`WorkerBase`: the hardware-neutral interface every worker implements, and the config it is built from."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

Task = Literal["embed", "generate", "none"]
DeviceChoice = Literal["auto", "cuda", "cpu"]
DtypeChoice = Literal["auto", "float32", "float16", "bfloat16"]
EngineChoice = Literal["auto", "vllm", "transformers"]

TASKS: tuple[str, ...] = ("embed", "generate", "none")
DEVICES: tuple[str, ...] = ("auto", "cuda", "cpu")
DTYPES: tuple[str, ...] = ("auto", "float32", "float16", "bfloat16")
ENGINES: tuple[str, ...] = ("auto", "vllm", "transformers")


@dataclass(frozen=True, slots=True)
class WorkerConfig:
    """What a worker needs to know to load and serve its model. ``task='none'`` serves RPC only."""

    task: Task = "none"
    model_path: str = ""
    served_name: str = ""
    device: DeviceChoice = "auto"
    dtype: DtypeChoice = "auto"
    group: str = "local"
    replica: int = 0
    rank: int = 0
    world_size: int = 1
    max_seq_length: int | None = None
    kv_cache_blocks: int | None = None  # generate: KV cache size in blocks, or
    kv_cache_memory_fraction: float | None = None  # ... a fraction of free device memory
    engine: EngineChoice = "auto"  # generate: vLLM's engine, transformers' continuous batching, or auto
    enforce_eager: bool = False  # vLLM: skip torch.compile (starts faster, steps slower)
    chat_template: str | None = None  # generate: a Jinja chat template in place of the tokenizer's own
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.task not in TASKS:
            raise ValueError(f"task must be one of {TASKS}, got {self.task!r}")
        if self.device not in DEVICES:
            raise ValueError(f"device must be one of {DEVICES}, got {self.device!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.engine not in ENGINES:
            raise ValueError(f"engine must be one of {ENGINES}, got {self.engine!r}")
        if self.task != "none" and not self.model_path:
            raise ValueError(f"model_path is required for task {self.task!r}")
        if self.world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {self.world_size}")
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank must be in [0, {self.world_size}), got {self.rank}")
        if self.replica < 0:
            raise ValueError(f"replica must be >= 0, got {self.replica}")


class WorkerBase(ABC):
    """One worker: owns a device and a model; all calls come from one thread (the busy loop).

    ``check_health`` may also be called from the health server thread: keep it cheap and read-only.
    """

    def __init__(self, config: WorkerConfig) -> None:
        self.config = config

    @abstractmethod
    def init_device(self) -> None:
        """Choose and initialise the device (from config and availability, never assumed)."""

    @abstractmethod
    def load_model(self) -> None:
        """Load the configured model onto the device."""

    @abstractmethod
    def execute_model(self, batch: dict[str, Any]) -> dict[str, Any]:
        """Run one batch; inputs and outputs are msgpack types and tensors."""

    @abstractmethod
    def get_memory_info(self) -> tuple[int, int]:
        """(free_bytes, total_bytes) of the worker's device."""

    @abstractmethod
    def check_health(self) -> dict[str, Any]:
        """Device available, memory free, model loaded, last step time."""

    def set_stream_sink(self, sink: Callable[[list[dict[str, Any]]], None]) -> None:  # noqa: B027
        """Where a streaming worker (a generation engine) sends each step's stream items; optional hook."""

    def shutdown(self) -> None:  # noqa: B027 - optional hook
        """Release the device and model."""
