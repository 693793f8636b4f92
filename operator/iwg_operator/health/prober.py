"""The health prober of one group: probes every worker each health.periodSeconds (deep /healthz, with a
timeout), counts consecutive failures, and replaces the pod or its whole replica within the restart budget.

It only deletes: the reconciler recreates what is missing, away from a node whose device failed
(`status.avoidedNodes`, which the supervisor writes). Every replacement is an Event and counts in status.restartCount; a spent
budget is the condition RestartBudgetExhausted. The replacements within the budget's window are kept in
`status.recentRestarts` (time and replica), so an operator restart neither forgets the budget nor the backoff.

A worker's answer is read up to `pod_http.HEALTH_BODY_LIMIT`: a longer one fails the check.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import aiohttp

from iwg_operator.api import wiring
from iwg_operator.api.v1alpha1 import HealthSpec
from iwg_operator.health.policy import (
    PodHealth,
    ProbeOutcome,
    judge_health_response,
    observe,
    pods_to_replace,
    restart_decision,
    shown_engine,
)
from iwg_operator.planning import ObservedPod
from iwg_operator.pod_http import HEALTH_BODY_LIMIT, BodyTooLarge, read_bounded
from iwg_operator.status import rfc3339

log = logging.getLogger("iwg_operator.health")

RESTART_BUDGET_EXHAUSTED = "RestartBudgetExhausted"
UNSUPERVISED_PROBE_EVERY = 3
# Newest replacements kept in status.recentRestarts: with maxRestarts above it, a restarted operator counts at
# most this many of the window's replacements against the budget.
MAX_RECENT_RESTARTS = 128


@dataclass(frozen=True)
class Replacement:
    """What the prober decided in one round (the supervisor applies it)."""

    pods: tuple[ObservedPod, ...]
    reason: str
    failed_pod: ObservedPod
    device_fault: bool


@dataclass
class RoundResult:
    replacements: list[Replacement] = field(default_factory=list)
    exhausted: str | None = None  # the budget message, while replacements are refused
    engine: str | None = None  # status.engine: what the live workers last reported (group_engine)


async def probe_worker(
    http: aiohttp.ClientSession, pod: ObservedPod, timeout_s: float, port: int = wiring.DEFAULT_HEALTH_PORT
) -> ProbeOutcome:
    if not pod.ip:
        return judge_health_response(None, None, "pod has no IP")
    url = f"http://{pod.ip}:{port}/healthz"
    try:
        async with http.get(url, timeout=aiohttp.ClientTimeout(total=timeout_s)) as response:
            body = await read_bounded(response, HEALTH_BODY_LIMIT)
            try:
                report = json.loads(body)
            except ValueError:
                report = None
            return judge_health_response(
                response.status, report if isinstance(report, Mapping) else None, None
            )
    except BodyTooLarge as error:
        return judge_health_response(None, None, f"health answer not read: {error}")
    except TimeoutError:
        return judge_health_response(None, None, f"no health answer within {timeout_s:g}s")
    except (aiohttp.ClientError, OSError) as error:
        return judge_health_response(None, None, f"health check failed: {error}")


class GroupProber:
    def __init__(self, restart_count: int = 0, restarts: Iterable[tuple[float, int]] = ()) -> None:
        """`restarts`: earlier replacements as (time.monotonic() time, replica), see `restarts_from_status`."""
        self.pods: dict[str, PodHealth] = {}
        self.group_restarts: list[float] = []
        self.replica_restarts: dict[int, list[float]] = {}
        for at, replica in sorted(restarts):
            self.group_restarts.append(at)
            self.replica_restarts.setdefault(replica, []).append(at)
        self.restart_count = restart_count
        self.engine: str | None = None  # status.engine as last reported

    def recent_restarts(self, window_s: float) -> list[dict[str, Any]]:
        """status.recentRestarts: the replacements of the last `window_s`, oldest first, at most
        MAX_RECENT_RESTARTS (the newest). Older ones leave memory too: the budget no longer counts them."""
        now, wall = time.monotonic(), time.time()
        self.group_restarts = [t for t in self.group_restarts if now - t < window_s]
        for replica in list(self.replica_restarts):
            kept = [t for t in self.replica_restarts[replica] if now - t < window_s]
            if kept:
                self.replica_restarts[replica] = kept
            else:
                del self.replica_restarts[replica]
        entries = sorted((t, r) for r, times in self.replica_restarts.items() for t in times)
        return [{"time": rfc3339(wall - (now - t)), "replica": r} for t, r in entries[-MAX_RECENT_RESTARTS:]]

    async def round(
        self, http: aiohttp.ClientSession, pods: Sequence[ObservedPod], spec: HealthSpec, world_size: int
    ) -> RoundResult:
        now = time.monotonic()
        live = [p for p in pods if p.uid and not p.terminating]
        probed = []
        for pod in live:
            memory = self.pods.setdefault(pod.uid, PodHealth())
            memory.rounds += pod.ready
            # Until its first healthy answer a ready pod is probed only every few rounds: simulated pods
            # and unreachable ones would otherwise cost a request each period for nothing.
            if memory.was_healthy or (pod.ready and memory.rounds % UNSUPERVISED_PROBE_EVERY == 1):
                probed.append(pod)
        outcomes = await asyncio.gather(*(probe_worker(http, p, spec.timeout_seconds) for p in probed))
        by_uid = {p.uid: o for p, o in zip(probed, outcomes, strict=True)}
        failed = [
            p for p in live if observe(self.pods[p.uid], p, by_uid.get(p.uid), spec.failure_threshold, now)
        ]
        for uid in set(self.pods) - {p.uid for p in live}:
            del self.pods[uid]

        result = RoundResult()
        handled: set[int] = set()
        for pod in sorted(failed, key=lambda p: (p.replica, p.rank)):
            if pod.replica in handled:
                continue
            memory = self.pods[pod.uid]
            decision = restart_decision(
                self.group_restarts,
                self.replica_restarts.get(pod.replica, []),
                memory.failed_since or now,
                now,
                spec,
            )
            if decision.action == "exhausted":
                result.exhausted = f"{decision.message}; last failure: {pod.name}: {memory.last_reason}"
                continue
            if decision.action == "wait":
                continue
            members = pods_to_replace(pod, live, spec.restart_policy)
            if spec.restart_policy == "Replica":
                handled.add(pod.replica)
            self.group_restarts.append(now)
            self.replica_restarts.setdefault(pod.replica, []).append(now)
            self.restart_count += 1
            result.replacements.append(
                Replacement(
                    pods=tuple(members),
                    reason=f"{memory.last_reason} ({memory.failures} failed check(s))",
                    failed_pod=pod,
                    device_fault=memory.device_fault,
                )
            )
            for member in members:
                self.pods.pop(member.uid, None)
        self.engine = result.engine = shown_engine(self.engine, self.pods.values())
        return result


def restarts_from_status(entries: object) -> list[tuple[float, int]]:
    """status.recentRestarts as (time.monotonic() time, replica); entries that do not parse are left out."""
    now, wall = time.monotonic(), time.time()
    found = []
    for entry in entries if isinstance(entries, list) else ():
        try:
            at = datetime.fromisoformat(str(entry["time"]).replace("Z", "+00:00")).timestamp()
            found.append((now - max(0.0, wall - at), int(entry["replica"])))
        except (KeyError, TypeError, ValueError):
            continue
    return found


def describe(replacement: Replacement, world_size: int) -> str:
    names = ", ".join(p.name for p in replacement.pods)
    node = replacement.failed_pod.node or "unknown node"
    scope = (
        "pod"
        if len(replacement.pods) == 1 and world_size == 1
        else f"replica {replacement.failed_pod.replica}"
    )
    return f"replacing {scope} ({names}): {replacement.failed_pod.name} on {node}: {replacement.reason}"
