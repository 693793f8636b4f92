"""`WorkerWrapperBase`: the proxy and lazy initialiser between a process and its worker.

Phase 1 (`__init__`) records the rank only; `init_worker` builds the worker from a qualified class name,
optionally with an extension class applied as a mixin (a built subclass, never a mutated ``__bases__``).
Attribute access is forwarded to the worker; bound methods are cached on the wrapper so the hot path costs
a plain attribute lookup.
"""

from __future__ import annotations

import functools
import importlib
import os
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from iwg_worker.method_registry import METHOD_REGISTRY, UnknownMethodError
from iwg_worker.worker_base import WorkerBase

# Wrapper methods a remote caller may name (the rest of the wrapper is local-only).
_WRAPPER_METHODS = frozenset({"execute_model"})


def resolve_qualname(name: str, what: str = "worker_cls") -> type:
    """``'pkg.module.Class'`` or ``'pkg.module:Class'`` -> the class; a clear error names the string."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"{what} must be a qualified class name, got {name!r}")
    module_name, sep, attr_path = name.partition(":")
    if not sep:
        module_name, _, attr_path = name.rpartition(".")
    if not module_name or not attr_path:
        raise ValueError(f"{what} {name!r} is not a qualified name like 'package.module.Class'")
    try:
        obj: Any = importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(f"{what} {name!r} does not resolve: cannot import {module_name!r} ({exc})") from exc
    for part in attr_path.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise ValueError(
                f"{what} {name!r} does not resolve: {module_name!r} has no {attr_path!r}"
            ) from None
    if not isinstance(obj, type):
        raise ValueError(f"{what} {name!r} resolves to a {type(obj).__name__}, not a class")
    return obj


def with_extension(worker_cls: type, extension_cls: type) -> type:
    """A new subclass of ``worker_cls`` that also has ``extension_cls``'s members; clashes are errors."""
    own: set[str] = set()
    for klass in extension_cls.__mro__:
        if klass is object:
            continue
        own.update(n for n in vars(klass) if not (n.startswith("__") and n.endswith("__")))
    clashes = sorted(n for n in own if hasattr(worker_cls, n))
    if clashes:
        raise TypeError(
            f"worker_extension_cls {extension_cls.__qualname__} defines {clashes}, "
            f"which {worker_cls.__qualname__} already has"
        )
    return type(f"{worker_cls.__name__}With{extension_cls.__name__}", (extension_cls, worker_cls), {})


@dataclass(slots=True)
class CallStats:
    count: int = 0
    errors: int = 0
    total_s: float = 0.0
    last_s: float = 0.0


class CallTimings:
    """Per-method call count, error count and durations, read by the metrics endpoint."""

    def __init__(self) -> None:
        self._stats: dict[str, CallStats] = {}
        self._lock = threading.Lock()

    def record(self, method: str, seconds: float, ok: bool) -> None:
        with self._lock:
            stats = self._stats.get(method)
            if stats is None:
                stats = self._stats[method] = CallStats()
            stats.count += 1
            stats.errors += not ok
            stats.total_s += seconds
            stats.last_s = seconds

    def snapshot(self) -> dict[str, dict[str, float]]:
        with self._lock:
            return {
                m: {"count": s.count, "errors": s.errors, "total_s": s.total_s, "last_s": s.last_s}
                for m, s in self._stats.items()
            }


class WorkerWrapperBase:
    def __init__(self, rpc_rank: int = 0) -> None:
        self.rpc_rank = rpc_rank
        self.worker: WorkerBase | None = None
        self.timings = CallTimings()
        self._cached_names: list[str] = []
        self._resolved: dict[str, Callable[..., Any]] = {}

    # -- phase 2 ----------------------------------------------------------------------------------------

    def update_environment_variables(self, envs: list[Mapping[str, str]] | Mapping[str, str]) -> None:
        """Set this rank's environment variables (one mapping, or a list indexed by rpc_rank)."""
        mapping = envs[self.rpc_rank] if isinstance(envs, list) else envs
        for key, value in mapping.items():
            if not isinstance(key, str) or not isinstance(value, str):
                raise TypeError(
                    f"environment variable {key!r} must map str to str, got {type(value).__name__}"
                )
            os.environ[key] = value

    def init_worker(self, all_kwargs: list[dict[str, Any]]) -> None:
        """Build the worker from this rank's kwargs: ``worker_cls`` (qualified name or class),
        optional ``worker_extension_cls``; the remaining kwargs go to the constructor."""
        if not 0 <= self.rpc_rank < len(all_kwargs):
            raise ValueError(
                f"init_worker got {len(all_kwargs)} kwargs sets, none for rpc_rank {self.rpc_rank}"
            )
        kwargs = dict(all_kwargs[self.rpc_rank])
        worker_cls = kwargs.pop("worker_cls", None)
        if worker_cls is None:
            raise ValueError("init_worker kwargs need 'worker_cls'")
        cls = worker_cls if isinstance(worker_cls, type) else resolve_qualname(worker_cls, "worker_cls")
        extension = kwargs.pop("worker_extension_cls", None)
        if extension:
            ext_cls = (
                extension
                if isinstance(extension, type)
                else resolve_qualname(extension, "worker_extension_cls")
            )
            cls = with_extension(cls, ext_cls)
        if not issubclass(cls, WorkerBase):
            raise TypeError(f"worker_cls {cls.__qualname__} is not a WorkerBase")
        for name in self._cached_names:
            self.__dict__.pop(name, None)
        self._cached_names.clear()
        self._resolved.clear()
        self.worker = cls(**kwargs)

    def require_worker(self) -> WorkerBase:
        if self.worker is None:
            raise RuntimeError(f"worker of rpc_rank {self.rpc_rank} is not initialised (call init_worker)")
        return self.worker

    # -- forwarding ------------------------------------------------------------------------------------

    def __getattr__(self, name: str) -> Any:
        # Only reached when normal lookup fails; the bound method is stored on the instance so the next
        # access is a plain dict hit.
        if name.startswith("__") or name in ("worker", "_cached_names", "_resolved"):
            raise AttributeError(name)
        worker = self.__dict__.get("worker")
        if worker is None:
            raise AttributeError(
                f"{name!r}: worker of rpc_rank {self.__dict__.get('rpc_rank')} is not initialised"
            )
        value = getattr(worker, name)
        if callable(value) and hasattr(value, "__self__"):
            self.__dict__[name] = value
            self._cached_names.append(name)
        return value

    def execute_model(self, batch: dict[str, Any]) -> dict[str, Any]:
        return self.require_worker().execute_model(batch)

    # -- dispatch by name ------------------------------------------------------------------------------

    def resolve_method(self, name: str) -> Callable[..., Any]:
        """A name from the wire -> the callable serving it (cached); `UnknownMethodError` names anything
        else."""
        resolved = self._resolved.get(name)
        if resolved is None:
            resolved = self._resolved[name] = self._resolve_uncached(name)
        return resolved

    def _resolve_uncached(self, name: str) -> Callable[..., Any]:
        registered = METHOD_REGISTRY.get(name)
        if registered is not None:
            return functools.partial(registered, self)
        if name in _WRAPPER_METHODS:
            return getattr(self, name)  # type: ignore[no-any-return]
        worker = self.require_worker()
        if not name.startswith("_") and name.isidentifier():
            attr = getattr(type(worker), name, None)
            if callable(attr):
                return getattr(self, name)  # type: ignore[no-any-return]
        raise UnknownMethodError(
            f"unknown method {name!r}: not in METHOD_REGISTRY and not a public method of "
            f"{type(worker).__qualname__}"
        )

    def execute_method(self, name: str, args: list[Any] | tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """Resolve and call ``name``, recording its duration for the metrics."""
        method = self.resolve_method(name)
        started = time.perf_counter()
        ok = False
        try:
            result = method(*args, **kwargs)
            ok = True
            return result
        finally:
            self.timings.record(name, time.perf_counter() - started, ok)
