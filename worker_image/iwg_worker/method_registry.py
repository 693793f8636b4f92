"""Methods a worker serves by name: `METHOD_REGISTRY` helpers plus the worker's public methods.

Only names travel on the wire; nothing callable does. A registry helper takes the `WorkerWrapperBase` first.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from iwg_worker.worker_wrapper import WorkerWrapperBase

RegistryMethod = Callable[..., Any]


class UnknownMethodError(LookupError):
    """The called name is neither a registry helper nor a public method of the worker."""


def get_free_memory_mb(wrapper: WorkerWrapperBase) -> int:
    free, _total = wrapper.require_worker().get_memory_info()
    return free // (1024 * 1024)


def get_memory_info(wrapper: WorkerWrapperBase) -> list[int]:
    free, total = wrapper.require_worker().get_memory_info()
    return [free, total]


def adjust_batch_params(
    wrapper: WorkerWrapperBase, max_batch_size: int | None = None, max_wait_ms: float | None = None
) -> dict[str, Any]:
    """Record batching limits on the worker (the driver reads them back); returns the current values."""
    worker = wrapper.require_worker()
    params: dict[str, Any] = dict(getattr(worker, "batch_params", {}))
    if max_batch_size is not None:
        if not isinstance(max_batch_size, int) or max_batch_size < 1:
            raise ValueError(f"max_batch_size must be a positive integer, got {max_batch_size!r}")
        params["max_batch_size"] = max_batch_size
    if max_wait_ms is not None:
        if not isinstance(max_wait_ms, int | float) or max_wait_ms < 0:
            raise ValueError(f"max_wait_ms must be >= 0, got {max_wait_ms!r}")
        params["max_wait_ms"] = float(max_wait_ms)
    worker.batch_params = params  # type: ignore[attr-defined]
    return params


def echo(wrapper: WorkerWrapperBase, *args: Any) -> list[Any]:
    """Return the arguments unchanged: the transport's round trip, used by tests and bench/rpc.py."""
    return list(args)


def sleep(wrapper: WorkerWrapperBase, seconds: float) -> float:
    """Block the busy loop for ``seconds`` (at most 60): drains, timeouts and liveness are tested with it."""
    if not 0 <= seconds <= 60:
        raise ValueError(f"seconds must be within [0, 60], got {seconds!r}")
    time.sleep(seconds)
    return seconds


def get_timings(wrapper: WorkerWrapperBase) -> dict[str, dict[str, float]]:
    return wrapper.timings.snapshot()


def put_mm_features(wrapper: WorkerWrapperBase, request_id: str, features: Any) -> int:
    """Store multimodal features for a request; the next `execute_model` naming it receives them."""
    wrapper.mm_receiver_cache.put(request_id, features)
    return len(wrapper.mm_receiver_cache)


METHOD_REGISTRY: dict[str, RegistryMethod] = {
    "get_free_memory_mb": get_free_memory_mb,
    "get_memory_info": get_memory_info,
    "adjust_batch_params": adjust_batch_params,
    "echo": echo,
    "sleep": sleep,
    "get_timings": get_timings,
    "put_mm_features": put_mm_features,
}
