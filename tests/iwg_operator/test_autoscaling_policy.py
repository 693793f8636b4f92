"""Pure decisions of the autoscaler."""

from __future__ import annotations

import socket

import aiohttp
import pytest
from iwg_operator.api.v1alpha1 import AutoscalingSpec
from iwg_operator.autoscaling.policy import (
    DriverSample,
    MetricsError,
    Recommendation,
    combine_samples,
    latency_p95_ms,
    metric_value,
    parse_driver_metrics,
    recommend,
    stabilize,
)
from iwg_operator.autoscaling.scaler import GroupScaler
from iwg_operator.driver_admin import DriverPod

METRICS = """# HELP iwg_queue_depth Inputs waiting
# TYPE iwg_queue_depth gauge
iwg_queue_depth 12.0
iwg_inflight_requests 3.0
iwg_request_latency_seconds_bucket{endpoint="embeddings",le="0.05"} 90.0
iwg_request_latency_seconds_bucket{endpoint="embeddings",le="0.1"} 99.0
iwg_request_latency_seconds_bucket{endpoint="embeddings",le="+Inf"} 100.0
"""


def spec(**kwargs: object) -> AutoscalingSpec:
    base: dict[str, object] = {"enabled": True, "min_replicas": 1, "max_replicas": 4, "target": 4.0}
    return AutoscalingSpec.model_validate({**base, **kwargs})


def test_driver_metrics_are_parsed_and_missing_ones_named() -> None:
    sample = parse_driver_metrics(METRICS, at=1.0)
    assert sample.queue_depth == 12 and sample.inflight == 3
    assert dict(sample.latency_buckets)[0.1] == 99
    with pytest.raises(MetricsError, match="iwg_queue_depth"):
        parse_driver_metrics("iwg_inflight_requests 1\n", at=1.0)


def test_metric_is_per_replica_for_load_and_p95_over_the_scrape_interval() -> None:
    sample = parse_driver_metrics(METRICS, at=2.0)
    assert metric_value(spec(metric="queueDepth"), 3, sample, None) == 4.0
    assert metric_value(spec(metric="inflight"), 3, sample, None) == 1.0
    assert metric_value(spec(metric="latencyP95Ms"), 3, sample, None) is None
    before = DriverSample(1.0, 0, 0, ((0.05, 0.0), (0.1, 0.0), (float("inf"), 0.0)))
    assert latency_p95_ms(before, sample) == pytest.approx(100.0)
    assert latency_p95_ms(sample, sample) == 0.0


def test_hpa_formula_with_tolerance_and_bounds() -> None:
    s = spec(tolerance=0.1)
    assert recommend(2, 4.3, s) == 2  # within 10 % of target
    assert recommend(2, 6.0, s) == 3  # ceil(2 * 1.5)
    assert recommend(2, 100.0, s) == 4  # max
    assert recommend(3, 0.0, s) == 1  # min
    assert recommend(0, 8.0, s) == 2  # from zero the metric is the group total


def test_stabilization_uses_the_window_extremes_so_a_spike_or_a_dip_changes_nothing() -> None:
    s = spec(scale_up_stabilization_seconds=10, scale_down_stabilization_seconds=30)
    history = [Recommendation(0, 2), Recommendation(5, 4)]
    assert stabilize(2, history, now=5, spec=s) == 2  # the up-window still holds a 2
    assert stabilize(2, [Recommendation(0, 4), Recommendation(5, 4)], now=5, spec=s) == 4
    down = [Recommendation(0, 4), Recommendation(20, 1)]
    assert stabilize(4, down, now=20, spec=s) == 4  # a 4 within the last 30 s
    assert stabilize(4, [*down, Recommendation(31, 1)], now=31, spec=s) == 1


def test_scaler_holds_without_metrics_and_scales_up_then_down_after_the_window() -> None:
    s = spec(scale_down_stabilization_seconds=20)
    scaler = GroupScaler()
    held = scaler.decide(None, "driver metrics unavailable: refused", 2, s)
    assert held.replicas is None and held.reason == "MetricsUnavailable" and "refused" in held.message
    busy = DriverSample(100.0, queue_depth=40.0, inflight=8.0)
    assert scaler.decide(busy, None, 2, s).replicas == 4
    idle = [DriverSample(100.0 + t, 0.0, 0.0) for t in (5, 10, 15, 21)]
    decisions = [scaler.decide(sample, None, 4, s).replicas for sample in idle]
    assert decisions == [4, 4, 4, 1]


def test_scaler_brings_replicas_within_the_bounds_before_reading_any_metric() -> None:
    s = spec(min_replicas=2, max_replicas=5)
    scaler = GroupScaler()
    up = scaler.decide(None, "the driver is not ready", 1, s)
    assert (up.replicas, up.reason) == (2, "TooFewReplicas") and "[2, 5]" in up.message
    busy = DriverSample(100.0, queue_depth=400.0, inflight=8.0)
    down = scaler.decide(busy, None, 9, s)
    assert (down.replicas, down.reason) == (5, "TooManyReplicas")
    assert scaler.decide(None, "refused", 3, s).replicas is None, "within the bounds: metrics decide"


GENERATION_METRICS = (
    METRICS
    + """iwg_requests_waiting 6.0
vllm:num_requests_waiting 6.0
iwg_kv_cache_usage{replica="0"} 0.9
iwg_kv_cache_usage{replica="1"} 0.5
vllm:kv_cache_usage_perc 0.7
"""
)


def test_generation_metrics_waiting_per_replica_and_kv_usage_as_the_serving_mean() -> None:
    sample = parse_driver_metrics(GENERATION_METRICS, at=1.0)
    assert (sample.requests_waiting, sample.kv_cache_usage) == (6.0, 0.7)
    assert metric_value(spec(metric="requestsWaiting", target=2), 2, sample, None) == 3.0
    # Already a mean over the serving replicas: not divided again by the replica count.
    assert metric_value(spec(metric="kvCacheUsage", target=0.5), 2, sample, None) == pytest.approx(0.7)
    assert recommend(2, 3.0, spec(metric="requestsWaiting", target=2)) == 3  # ceil(2 x 3 / 2)
    assert recommend(2, 0.7, spec(metric="kvCacheUsage", target=0.5)) == 3  # ceil(2 x 0.7 / 0.5)
    assert recommend(2, 0.0, spec(metric="requestsWaiting", target=2)) == 1  # nothing waits: the minimum


def test_a_driver_without_the_generation_gauges_holds_naming_the_gauge() -> None:
    sample = parse_driver_metrics(METRICS, at=1.0)
    assert sample.requests_waiting is None and sample.kv_cache_usage is None
    for metric, gauge in (
        ("requestsWaiting", "iwg_requests_waiting"),
        ("kvCacheUsage", "vllm:kv_cache_usage"),
    ):
        s = spec(metric=metric, target=0.5)
        with pytest.raises(MetricsError, match=gauge):
            metric_value(s, 1, sample, None)
        held = GroupScaler().decide(sample, None, 1, s)
        assert (held.replicas, held.reason) == (None, "MetricsUnavailable") and gauge in held.message


def test_scaler_on_requests_waiting_scales_up_under_a_step_and_down_after_the_window() -> None:
    s = spec(metric="requestsWaiting", target=1, max_replicas=2, scale_down_stabilization_seconds=20)
    scaler = GroupScaler()

    def waiting(at: float, count: float) -> DriverSample:
        return DriverSample(at, 0.0, 0.0, requests_waiting=count, kv_cache_usage=1.0)

    assert scaler.decide(waiting(100, 0), None, 1, s).replicas == 1
    up = scaler.decide(waiting(101, 5), None, 1, s)
    assert up.replicas == 2 and "requestsWaiting 5.00" in up.message
    decisions = [scaler.decide(waiting(101 + t, 0), None, 2, s).replicas for t in (5, 15, 22)]
    assert decisions == [2, 2, 1]


def test_kv_cache_usage_target_is_a_fraction_and_the_error_names_the_field() -> None:
    assert spec(metric="kvCacheUsage", target=1.0).target == 1.0
    with pytest.raises(ValueError, match=r"spec\.autoscaling\.target must be a fraction in \(0, 1\]"):
        spec(metric="kvCacheUsage", target=4)
    with pytest.raises(ValueError, match="target"):
        spec(metric="kvCacheUsage", target=0)
    assert spec(metric="requestsWaiting", target=4).target == 4  # a count: above 1 is fine


def two_drivers(at: float, second_latency_count: float = 10.0) -> dict[str, DriverSample]:
    """One scrape of two drivers of a generation group: their own queues and latencies, and the engines'
    gauges as each read them (the same group's engines)."""
    buckets = ((0.1, 8.0), (1.0, 10.0), (float("inf"), 10.0))
    return {
        "g-driver-a#0": DriverSample(at, 3.0, 2.0, buckets, requests_waiting=4.0, kv_cache_usage=0.5),
        "g-driver-b#0": DriverSample(
            at + 0.2,
            5.0,
            1.0,
            ((0.1, 0.0), (1.0, second_latency_count), (float("inf"), second_latency_count)),
            requests_waiting=6.0,
            kv_cache_usage=0.6,
        ),
    }


def test_drivers_samples_sum_their_own_load_and_take_the_highest_engine_reading() -> None:
    combined = combine_samples(two_drivers(10.0))
    assert (combined.queue_depth, combined.inflight) == (8.0, 3.0)  # each driver's share, summed
    assert dict(combined.latency_buckets) == {0.1: 8.0, 1.0: 20.0, float("inf"): 20.0}
    # Both drivers read the same engines: 6 requests wait in the group, not 4 + 6.
    assert (combined.requests_waiting, combined.kv_cache_usage) == (6.0, 0.6)
    assert combined.at == 10.2 and combined.drivers == ("g-driver-a#0", "g-driver-b#0")
    s = spec(metric="requestsWaiting", target=3, max_replicas=8)
    assert metric_value(s, 2, combined, None) == 3.0  # 6 waiting over 2 replicas: on target, no scale-up
    assert GroupScaler().decide(combined, None, 2, s).replicas == 2
    assert metric_value(spec(metric="queueDepth"), 2, combined, None) == 4.0


def test_latency_is_compared_only_between_scrapes_of_the_same_driver_processes() -> None:
    s = spec(metric="latencyP95Ms", target=500)
    first, second = combine_samples(two_drivers(10.0)), combine_samples(two_drivers(15.0, 30.0))
    # 20 requests answered between the scrapes, all by driver b and within 1 s.
    assert metric_value(s, 2, second, first) == pytest.approx(1000.0)
    restarted = {**two_drivers(20.0), "g-driver-b#1": two_drivers(20.0)["g-driver-b#0"]}
    del restarted["g-driver-b#0"]
    # Driver b restarted: its histogram counts from zero again, so there is no interval to read.
    assert metric_value(s, 2, combine_samples(restarted), second) is None
    with pytest.raises(MetricsError):
        combine_samples({})


async def test_one_driver_that_cannot_be_read_holds_the_scaler_naming_its_pod() -> None:
    # Nothing listens on the port: each scrape is refused, as for drivers that died between the pod list and
    # the scrape. The scaler names the first driver (in the list's order) that could not be read, and holds.
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        closed_port = probe.getsockname()[1]
    drivers = [DriverPod("g-driver-a", "127.0.0.1"), DriverPod("g-driver-b", "127.0.0.1", restarts=1)]
    scaler = GroupScaler()
    async with aiohttp.ClientSession() as http:
        with pytest.raises(MetricsError, match="driver pod g-driver-a") as refused:
            await scaler.scrape(http, drivers, closed_port)
    held = scaler.decide(None, str(refused.value), 2, spec())
    assert (held.replicas, held.reason) == (None, "MetricsUnavailable") and "g-driver-a" in held.message
