"""Methods a worker serves by name: `METHOD_REGISTRY` helpers plus the worker's public methods.

Only names travel on the wire; nothing callable does. A registry helper takes the `WorkerWrapperBase` first.
"""

from __future__ import annotations

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


def get_timings(wrapper: WorkerWrapperBase) -> dict[str, dict[str, float]]:
    return wrapper.timings.snapshot()


METHOD_REGISTRY: dict[str, RegistryMethod] = {
    "get_free_memory_mb": get_free_memory_mb,
    "get_memory_info": get_memory_info,
    "get_timings": get_timings,
}
