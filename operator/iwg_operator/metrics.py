"""Prometheus metrics of the operator, all named `iwg_operator_*`, served on their own port.

The handlers, the API access layer, the health prober and the autoscaler call the small functions below;
`serve()` starts the HTTP endpoint (`/metrics`) when a port is given by `--metrics-port` or the
`IWG_METRICS_PORT` environment variable (the Helm chart sets the flag). Metrics live in their own registry,
so the endpoint shows the operator's series and its process's, nothing a library registered globally.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import wraps
from typing import Final, ParamSpec, TypeVar

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.exposition import start_http_server
from prometheus_client.platform_collector import PlatformCollector
from prometheus_client.process_collector import ProcessCollector

PREFIX: Final = "iwg_operator"
PORT_ENV: Final = "IWG_METRICS_PORT"
ADDRESS_ENV: Final = "IWG_METRICS_ADDRESS"

REGISTRY: Final = CollectorRegistry(auto_describe=True)
ProcessCollector(registry=REGISTRY)
PlatformCollector(registry=REGISTRY)

# Reconciles last from milliseconds (nothing changed) to tens of seconds (a large group created).
_RECONCILE_BUCKETS: Final = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)

RECONCILE_DURATION: Final = Histogram(
    f"{PREFIX}_reconcile_duration_seconds",
    "Time one handler run took, by handler",
    ["handler"],
    buckets=_RECONCILE_BUCKETS,
    registry=REGISTRY,
)
RECONCILES: Final = Counter(
    f"{PREFIX}_reconciles_total", "Handler runs, by handler", ["handler"], registry=REGISTRY
)
RECONCILE_ERRORS: Final = Counter(
    f"{PREFIX}_reconcile_errors_total",
    "Handler runs that raised, by handler and exception class",
    ["handler", "error"],
    registry=REGISTRY,
)
GROUPS: Final = Gauge(
    f"{PREFIX}_groups", "InferenceWorkerGroups the operator handles, by phase", ["phase"], registry=REGISTRY
)
PODS_CREATED: Final = Counter(
    f"{PREFIX}_pods_created_total",
    "Worker and driver pods the operator created, by reason",
    ["reason"],
    registry=REGISTRY,
)
PODS_REPLACED: Final = Counter(
    f"{PREFIX}_pods_replaced_total",
    "Pods the operator deleted to replace them, by reason",
    ["reason"],
    registry=REGISTRY,
)
AUTOSCALER_DECISIONS: Final = Counter(
    f"{PREFIX}_autoscaler_decisions_total",
    "Autoscaler evaluations, by decision (up, down, hold)",
    ["decision"],
    registry=REGISTRY,
)
API_REQUESTS: Final = Counter(
    f"{PREFIX}_api_requests_total",
    "Requests to the Kubernetes API made by the operator's API layer, by verb, resource and status code",
    ["verb", "resource", "code"],
    registry=REGISTRY,
)

_ALL: Final = (
    RECONCILE_DURATION,
    RECONCILES,
    RECONCILE_ERRORS,
    GROUPS,
    PODS_CREATED,
    PODS_REPLACED,
    AUTOSCALER_DECISIONS,
    API_REQUESTS,
)
# Every metric this module defines, as a scrape names it (counters end in _total; the docs list these).
METRIC_NAMES: Final = tuple(
    family.name + ("_total" if family.type == "counter" else "")
    for metric in _ALL
    for family in metric.describe()
)

P = ParamSpec("P")
R = TypeVar("R")


@contextmanager
def reconcile(handler: str) -> Iterator[None]:
    """Times one handler run; counts it, and counts it as an error when it raises."""
    started = time.perf_counter()
    try:
        yield
    except BaseException as exc:
        RECONCILE_ERRORS.labels(handler, type(exc).__name__).inc()
        raise
    finally:
        RECONCILES.labels(handler).inc()
        RECONCILE_DURATION.labels(handler).observe(time.perf_counter() - started)


def timed(handler: str) -> Callable[[Callable[P, Awaitable[R]]], Callable[P, Awaitable[R]]]:
    """`reconcile()` as a decorator for async handlers (Kopf still sees the wrapped signature)."""

    def decorate(func: Callable[P, Awaitable[R]]) -> Callable[P, Awaitable[R]]:
        @wraps(func)
        async def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
            with reconcile(handler):
                return await func(*args, **kwargs)

        return wrapper

    return decorate


def pod_created(reason: str, count: int = 1) -> None:
    PODS_CREATED.labels(reason).inc(count)


def pod_replaced(reason: str, count: int = 1) -> None:
    PODS_REPLACED.labels(reason).inc(count)


def autoscaler_decision(decision: str) -> None:
    AUTOSCALER_DECISIONS.labels(decision).inc()


def api_request(verb: str, resource: str, code: int) -> None:
    API_REQUESTS.labels(verb, resource, str(code)).inc()


class _GroupPhases:
    """The phase of every group the operator knows, exported as a count per phase."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._phases: dict[tuple[str, str], str] = {}
        self._exported: set[str] = set()

    def set(self, namespace: str, name: str, phase: str) -> None:
        with self._lock:
            self._phases[(namespace, name)] = phase
            self._export()

    def forget(self, namespace: str, name: str) -> None:
        with self._lock:
            self._phases.pop((namespace, name), None)
            self._export()

    def _export(self) -> None:
        counts: dict[str, int] = {}
        for phase in self._phases.values():
            counts[phase] = counts.get(phase, 0) + 1
        # Phases that no group is in any more stay at 0 rather than vanishing from the scrape.
        for phase in self._exported:
            counts.setdefault(phase, 0)
        self._exported |= counts.keys()
        for phase, count in counts.items():
            GROUPS.labels(phase).set(count)


_group_phases: Final = _GroupPhases()


def group_phase(namespace: str, name: str, phase: str) -> None:
    _group_phases.set(namespace, name, phase)


def group_gone(namespace: str, name: str) -> None:
    _group_phases.forget(namespace, name)


@dataclass(frozen=True)
class MetricsServer:
    address: str
    port: int
    _shutdown: Callable[[], None]

    def close(self) -> None:
        self._shutdown()


def port_from_env(flag: int | None = None) -> int | None:
    """The metrics port: the flag when given, else IWG_METRICS_PORT, else None (not served)."""
    if flag is not None:
        return flag
    raw = os.environ.get(PORT_ENV, "").strip()
    if not raw:
        return None
    try:
        port = int(raw)
    except ValueError:
        raise ValueError(f"{PORT_ENV} must be a port number, got {raw!r}") from None
    if not 0 <= port <= 65535:
        raise ValueError(f"{PORT_ENV} must be between 0 and 65535, got {port}")
    return port


def serve(port: int, address: str | None = None) -> MetricsServer:
    """Serves /metrics on address:port in a daemon thread (port 0 picks a free port)."""
    # All interfaces by default: Prometheus scrapes the pod from elsewhere.
    bind = address or os.environ.get(ADDRESS_ENV, "0.0.0.0")
    server, thread = start_http_server(port, addr=bind, registry=REGISTRY)

    def shutdown() -> None:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)

    return MetricsServer(bind, int(server.server_address[1]), shutdown)
