"""The autoscaler of one group: scrapes every ready driver's /metrics, combines them, recommends with the HPA
formula, stabilizes, and writes `spec.replicas` of the group. Scale-down drains the leaving replicas in every
driver first (iwg_operator.driver_admin). A /metrics page is read up to `pod_http.METRICS_BODY_LIMIT`: a
longer one makes that scrape unusable.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import aiohttp

from iwg_operator.api.v1alpha1 import AutoscalingSpec
from iwg_operator.autoscaling.policy import (
    DriverSample,
    MetricsError,
    Recommendation,
    combine_samples,
    metric_value,
    parse_driver_metrics,
    prune,
    recommend,
    stabilize,
)
from iwg_operator.driver_admin import DriverPod
from iwg_operator.pod_http import METRICS_BODY_LIMIT, read_bounded

log = logging.getLogger("iwg_operator.autoscaling")

SCRAPE_TIMEOUT_S = 3.0


@dataclass(frozen=True)
class ScaleDecision:
    """`replicas` is None while holding; `reason` says why (for the condition), `value` what was measured."""

    replicas: int | None
    reason: str
    message: str
    value: float | None = None
    event: str = "Autoscaled"  # the reason of the Event a change of replicas posts


@dataclass
class GroupScaler:
    history: list[Recommendation] = field(default_factory=list)
    previous: DriverSample | None = None
    last_used: float | None = None  # when a sample last showed a request (scale to zero's idle clock)
    answered: float | None = None  # the drivers' requests_total at the last sample

    async def scrape(
        self, http: aiohttp.ClientSession, drivers: Sequence[DriverPod], port: int
    ) -> DriverSample:
        """Every driver's /metrics at once, combined (`combine_samples`). One driver that cannot be read fails
        the whole scrape (`MetricsError` naming its pod): the sum of the others would under-count the load
        (its queue and in-flight requests are missing), and a scale-down on it could remove replicas that
        driver is busy on. The autoscaler holds instead; a driver that is gone stops being Ready and leaves
        the set."""
        results = await asyncio.gather(
            *(_scrape_one(http, f"http://{d.address}:{port}/metrics") for d in drivers),
            return_exceptions=True,
        )
        samples = {}
        for driver, result in zip(drivers, results, strict=True):
            if isinstance(result, Exception):
                raise MetricsError(
                    f"metrics of driver pod {driver.name} unavailable: {str(result) or type(result).__name__}"
                )
            if isinstance(result, BaseException):
                raise result
            samples[driver.process] = result
        return combine_samples(samples)

    def decide(
        self, sample: DriverSample | None, error: str | None, current: int, spec: AutoscalingSpec
    ) -> ScaleDecision:
        """Pure but for the memory of recommendations: bring replicas within [min, max] first (like the HPA,
        with or without metrics), hold on missing metrics, else recommend and stabilize."""
        bounded = min(max(current, spec.min_replicas), spec.max_replicas)
        if bounded != current:
            reason = "TooFewReplicas" if bounded > current else "TooManyReplicas"
            bounds = f"[{spec.min_replicas}, {spec.max_replicas}]"
            return ScaleDecision(
                bounded, reason, f"{current} replicas outside {bounds} -> {bounded} replicas"
            )
        if sample is None:
            self.previous = None
            return ScaleDecision(None, "MetricsUnavailable", f"holding at {current} replicas: {error}")
        if current == 0 or spec.min_replicas == 0:
            self._watch_use(sample)
        if current == 0:  # no metric of replicas to read: only held requests matter
            return self._from_zero(sample, spec)
        try:
            value = metric_value(spec, current, sample, self.previous)
        except MetricsError as missing:
            self.previous = None
            return ScaleDecision(None, "MetricsUnavailable", f"holding at {current} replicas: {missing}")
        self.previous = sample
        zero = self._zero(sample, current, spec)
        if zero is not None:
            return zero
        if value is None:
            return ScaleDecision(
                None, "MetricsUnavailable", f"holding at {current}: first sample of {spec.metric}"
            )
        now = sample.at
        self.history = prune(self.history, now, spec)
        self.history.append(Recommendation(now, recommend(current, value, spec)))
        desired = stabilize(current, self.history, now, spec)
        message = f"{spec.metric} {value:.2f} per replica (target {spec.target:g}) -> {desired} replicas"
        return ScaleDecision(desired, "ScalingActive", message, value)

    def _watch_use(self, sample: DriverSample) -> None:
        """Restart the idle clock when the sample shows a request: one answered since the last sample (the
        drivers' request counters moved), in flight, queued, or held for activation."""
        busy = sample.inflight > 0 or sample.queue_depth > 0 or sample.activation_waiting > 0
        if busy or self.last_used is None or sample.requests_total != self.answered:
            self.last_used = sample.at
        self.answered = sample.requests_total

    def _from_zero(self, sample: DriverSample, spec: AutoscalingSpec) -> ScaleDecision:
        """At zero replicas: one replica as soon as any driver holds a request (no window: a client waits)."""
        self.history = []
        self.previous = None
        if sample.activation_waiting > 0:
            waiting = int(sample.activation_waiting)
            return ScaleDecision(
                1,
                "ScaledFromZero",
                f"{waiting} request(s) held by the drivers with no replica -> 1 replica",
                sample.activation_waiting,
                event="ScaledFromZero",
            )
        return ScaleDecision(0, "Idle", "no request held: 0 replicas")

    def _zero(self, sample: DriverSample, current: int, spec: AutoscalingSpec) -> ScaleDecision | None:
        """With minReplicas 0: to zero once no request was seen for scaleToZeroAfterSeconds."""
        if spec.min_replicas != 0 or self.last_used is None:
            return None
        idle = sample.at - self.last_used
        if idle < spec.scale_to_zero_after_seconds:
            return None
        self.history = []
        return ScaleDecision(
            0,
            "Idle",
            f"no request for {idle:.0f} s (scaleToZeroAfterSeconds {spec.scale_to_zero_after_seconds}) "
            f"-> 0 replicas",
            event="ScaledToZero",
        )


async def _scrape_one(http: aiohttp.ClientSession, url: str) -> DriverSample:
    async with http.get(url, timeout=aiohttp.ClientTimeout(total=SCRAPE_TIMEOUT_S)) as response:
        if response.status != 200:
            raise MetricsError(f"HTTP {response.status}")
        body = await read_bounded(response, METRICS_BODY_LIMIT)  # BodyTooLarge names the limit
        return parse_driver_metrics(body.decode("utf-8", "replace"), time.monotonic())
