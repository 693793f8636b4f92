"""Pure autoscaling decisions: the HPA formula with a tolerance, stabilization windows, bounds, and reading
the drivers' Prometheus text into the metric the spec names.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from iwg_operator.api.v1alpha1 import AutoscalingSpec

QUEUE_DEPTH = "iwg_queue_depth"
INFLIGHT = "iwg_inflight_requests"
LATENCY_BUCKET = "iwg_request_latency_seconds_bucket"
# Generation groups: requests the engines hold waiting for KV cache room (the group's total), and the share of
# KV cache blocks in use averaged over the serving replicas (the name vLLM and the gateways' endpoint picker use).
REQUESTS_WAITING = "iwg_requests_waiting"
KV_CACHE_USAGE = "vllm:kv_cache_usage_perc"
# Scale to zero: requests a driver holds while no replica serves, and every request it has answered (any sign of
# use resets the idle clock).
ACTIVATION_WAITING = "iwg_activation_waiting"
REQUESTS_TOTAL = "iwg_requests_total"
# The driver's latest activation: its time to first answer, and when that answer came (Unix time; 0: none yet).
LAST_ACTIVATION_SECONDS = "iwg_last_activation_seconds"
LAST_ACTIVATION_TIME = "iwg_last_activation_timestamp_seconds"
# ... and that activation in its parts, by label phase (pod_start, worker_start, model_load, ready, first_answer).
LAST_ACTIVATION_PHASE = "iwg_last_activation_phase_seconds"


class MetricsError(ValueError):
    """The driver's metrics do not hold what the autoscaler needs."""


@dataclass(frozen=True)
class DriverSample:
    """One scrape of the drivers: totals over the group, plus the cumulative latency histogram; the generation
    gauges are None when no driver exports them. `drivers` names the driver processes it was read from (their
    histograms count from their start, so latency is only compared between samples of the same ones)."""

    at: float
    queue_depth: float
    inflight: float
    latency_buckets: tuple[tuple[float, float], ...] = ()  # (upper bound s, cumulative count), summed
    requests_waiting: float | None = None
    kv_cache_usage: float | None = None
    drivers: tuple[str, ...] = ()
    activation_waiting: float = (
        0.0  # requests held for a replica to start (summed: each driver holds its own)
    )
    requests_total: float = 0.0  # requests answered since each driver started (summed)
    # (when, Unix time, its time to first answer in s) of the latest activation of any driver; None: none yet
    last_activation: tuple[float, float] | None = None
    last_activation_phases: tuple[
        tuple[str, float], ...
    ] = ()  # its parts, (phase, s), as its driver split it


def parse_driver_metrics(text: str, at: float) -> DriverSample:
    queue: float | None = None
    inflight: float | None = None
    buckets: dict[float, float] = {}
    gauges: dict[str, float] = {}
    answered = 0.0
    phases: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name_and_labels, _, value_text = line.rpartition(" ")
        name = name_and_labels.split("{", 1)[0]
        try:
            value = float(value_text)
        except ValueError:
            continue
        if name == QUEUE_DEPTH:
            queue = value
        elif name == INFLIGHT:
            inflight = value
        elif name in (
            REQUESTS_WAITING,
            KV_CACHE_USAGE,
            ACTIVATION_WAITING,
            LAST_ACTIVATION_SECONDS,
            LAST_ACTIVATION_TIME,
        ):
            gauges[name] = value
        elif name == REQUESTS_TOTAL:
            answered += value
        elif name == LAST_ACTIVATION_PHASE and 'phase="' in name_and_labels:
            phases[name_and_labels.split('phase="', 1)[1].split('"', 1)[0]] = value
        elif name == LATENCY_BUCKET and 'le="' in name_and_labels:
            bound_text = name_and_labels.split('le="', 1)[1].split('"', 1)[0]
            bound = math.inf if bound_text == "+Inf" else float(bound_text)
            buckets[bound] = buckets.get(bound, 0.0) + value
    if queue is None or inflight is None:
        missing = [n for n, v in ((QUEUE_DEPTH, queue), (INFLIGHT, inflight)) if v is None]
        raise MetricsError(f"driver metrics lack {', '.join(missing)}")
    return DriverSample(
        at,
        queue,
        inflight,
        tuple(sorted(buckets.items())),
        gauges.get(REQUESTS_WAITING),
        gauges.get(KV_CACHE_USAGE),
        activation_waiting=gauges.get(ACTIVATION_WAITING, 0.0),
        requests_total=answered,
        last_activation=(
            (gauges[LAST_ACTIVATION_TIME], gauges.get(LAST_ACTIVATION_SECONDS, 0.0))
            if gauges.get(LAST_ACTIVATION_TIME, 0.0) > 0
            else None
        ),
        last_activation_phases=tuple(sorted(phases.items())),
    )


def combine_samples(samples: Mapping[str, DriverSample]) -> DriverSample:
    """The group's sample from one scrape of each driver (keyed by driver process).

    Each driver counts only the requests it admitted itself: its queue, its in-flight requests and its
    latency histogram are its share of the group's, so these are summed. The engine gauges are not shares:
    every driver asks the same replicas' engines for their counts (`poll_stats` in the driver's streams.py),
    so each driver exports the whole group's requests waiting and KV cache usage, read at a moment of its
    own. Summing them would count each waiting request once per driver (two drivers would double the group's
    `requestsWaiting` and scale it up for nothing). They are taken as the highest reading instead: the
    readings differ only in when each driver took them and which serving replicas it reached, and the highest
    keeps a scale-down from acting on one driver's partial view. The latest activation is the latest of any
    driver's.
    """
    if not samples:
        raise MetricsError("no driver sample")
    parts = list(samples.values())
    activated = [p for p in parts if p.last_activation]
    latest = max(activated, key=lambda p: p.last_activation or (0.0, 0.0)) if activated else None
    buckets: dict[float, float] = {}
    for part in parts:
        for bound, count in part.latency_buckets:
            buckets[bound] = buckets.get(bound, 0.0) + count
    return DriverSample(
        at=max(p.at for p in parts),
        queue_depth=sum(p.queue_depth for p in parts),
        inflight=sum(p.inflight for p in parts),
        latency_buckets=tuple(sorted(buckets.items())),
        requests_waiting=_highest(p.requests_waiting for p in parts),
        kv_cache_usage=_highest(p.kv_cache_usage for p in parts),
        drivers=tuple(sorted(samples)),
        activation_waiting=sum(p.activation_waiting for p in parts),
        requests_total=sum(p.requests_total for p in parts),
        last_activation=latest.last_activation if latest else None,
        last_activation_phases=latest.last_activation_phases if latest else (),
    )


def _highest(values: Iterable[float | None]) -> float | None:
    exported = [v for v in values if v is not None]
    return max(exported) if exported else None


def latency_p95_ms(previous: DriverSample, current: DriverSample) -> float:
    """95th percentile of the requests answered between two scrapes (bucket upper bound), 0 with none."""
    before = dict(previous.latency_buckets)
    deltas = [(bound, count - before.get(bound, 0.0)) for bound, count in current.latency_buckets]
    total = deltas[-1][1] if deltas else 0.0
    if total <= 0:
        return 0.0
    for bound, count in deltas:
        if count >= 0.95 * total:
            finite = (
                bound if math.isfinite(bound) else max((b for b, _ in deltas if math.isfinite(b)), default=0)
            )
            return finite * 1000.0
    return 0.0


def metric_value(
    spec: AutoscalingSpec, replicas: int, current: DriverSample, previous: DriverSample | None
) -> float | None:
    """The spec's metric: per replica for the load metrics (as the HPA's averageValue), the serving replicas'
    mean for `kvCacheUsage` (as the HPA's averageUtilization); None when unknown (the first latency sample,
    or the first after the set of driver processes changed).
    `MetricsError` names a gauge the driver does not export (a driver without generation support)."""
    if spec.metric == "queueDepth":
        return current.queue_depth / max(replicas, 1)
    if spec.metric == "inflight":
        return current.inflight / max(replicas, 1)
    if spec.metric == "requestsWaiting":
        return _exported(current.requests_waiting, REQUESTS_WAITING) / max(replicas, 1)
    if spec.metric == "kvCacheUsage":
        return _exported(current.kv_cache_usage, KV_CACHE_USAGE)
    if previous is None or previous.drivers != current.drivers:
        return None
    return latency_p95_ms(previous, current)


def _exported(value: float | None, name: str) -> float:
    if value is None:
        raise MetricsError(f"driver metrics lack {name}")
    return value


def recommend(current_replicas: int, value: float, spec: AutoscalingSpec) -> int:
    """desired = ceil(replicas x value / target), unchanged within the tolerance, within [min, max]; never
    below 1: only idleness takes a group to zero (`GroupScaler.decide`), not a low metric."""
    ratio = value / spec.target
    replicas = max(current_replicas, 1)
    desired = current_replicas if abs(ratio - 1.0) <= spec.tolerance else math.ceil(replicas * ratio)
    return max(spec.min_replicas, 1, min(spec.max_replicas, desired))


@dataclass(frozen=True)
class Recommendation:
    at: float
    replicas: int


def stabilize(
    current_replicas: int, history: Sequence[Recommendation], now: float, spec: AutoscalingSpec
) -> int:
    """The HPA's stabilization: scale up to the lowest recommendation of the up-window, down to the highest
    of the down-window, so a brief spike or dip changes nothing and the count never flaps.
    """
    up_window = [r.replicas for r in history if now - r.at <= spec.scale_up_stabilization_seconds]
    down_window = [r.replicas for r in history if now - r.at <= spec.scale_down_stabilization_seconds]
    if not up_window or not down_window:
        return current_replicas
    scale_up_to = min(up_window)
    if scale_up_to > current_replicas:
        return scale_up_to
    scale_down_to = max(down_window)
    if scale_down_to < current_replicas:
        return scale_down_to
    return current_replicas


def prune(history: Iterable[Recommendation], now: float, spec: AutoscalingSpec) -> list[Recommendation]:
    keep = max(spec.scale_up_stabilization_seconds, spec.scale_down_stabilization_seconds)
    return [r for r in history if now - r.at <= keep]


def is_stale(sample: DriverSample | None, now: float, max_age: float) -> bool:
    return sample is None or now - sample.at > max_age
