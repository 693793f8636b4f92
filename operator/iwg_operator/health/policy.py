"""Pure decisions of the health prober: what a probe answer means, when a worker counts as failed, which pods
go with it, and whether the restart budget and its backoff allow replacing them now.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Literal

from iwg_operator.api.v1alpha1 import HealthSpec
from iwg_operator.planning import ObservedPod

# The generation engines a worker reports in its deep health answer (`worker.engine`).
ENGINES = ("vllm", "transformers")


@dataclass(frozen=True)
class ProbeOutcome:
    healthy: bool
    reason: str = ""
    device_fault: bool = False
    engine: str | None = None  # the generation engine a healthy worker reported (None: embed, or not said)


HEALTHY = ProbeOutcome(True)


def judge_health_response(
    status: int | None, report: Mapping[str, Any] | None, error: str | None
) -> ProbeOutcome:
    """A worker's /healthz answer (deep: busy loop alive, device available, model state) as an outcome.

    No answer within the timeout (a hung or stopped process) and connection errors are failures; a report
    whose worker says its device is unavailable is a device fault, which moves the replacement elsewhere.
    """
    if error is not None:
        return ProbeOutcome(False, error)
    worker = (report or {}).get("worker")
    if isinstance(worker, Mapping) and worker.get("device_available") is False:
        note = worker.get("device_note") or worker.get("device") or "device unavailable"
        return ProbeOutcome(False, f"device fault: {note}", device_fault=True)
    if status is None or not 200 <= status < 300:
        detail = ""
        if report and report.get("alive") is False:
            detail = f": busy loop silent for {report.get('busy_loop_age_s')}s"
        return ProbeOutcome(False, f"health check answered HTTP {status}{detail}")
    engine = worker.get("engine") if isinstance(worker, Mapping) else None
    return ProbeOutcome(True, engine=engine) if engine in ENGINES else HEALTHY


def group_engine(engines: Iterable[str | None]) -> str | None:
    """status.engine from the engines the group's live workers last reported: the one engine they share, or
    during a change every engine seen, sorted and joined by commas (`transformers,vllm`); None when none
    reported one (task embed, no worker answered yet, no workers)."""
    seen = sorted({e for e in engines if e is not None})
    return ",".join(seen) or None


def shown_engine(previous: str | None, pods: Iterable[PodHealth]) -> str | None:
    """status.engine after a round: what the live workers report (group_engine), or, while no live worker has
    answered a deep check yet (a replacement starting, the moment between a pod's deletion and its successor's
    creation, a group at zero), the engine shown before: the group still runs it, and clearing it would write
    the status twice for nothing."""
    memories = list(pods)
    if not any(m.was_healthy for m in memories):
        return previous
    return group_engine(m.engine for m in memories)


@dataclass
class PodHealth:
    """What the prober remembers of one pod (by uid)."""

    failures: int = 0
    restarts_seen: int | None = None
    was_healthy: bool = False  # answered a deep check once: from then on the prober supervises it
    rounds: int = 0
    last_reason: str = ""
    device_fault: bool = False
    failed_since: float | None = None
    engine: str | None = None  # the generation engine of its last healthy answer


def observe(
    memory: PodHealth, pod: ObservedPod, outcome: ProbeOutcome | None, threshold: int, now: float
) -> bool:
    """Fold one round into the pod's memory; True when the pod has failed (replace it).

    A container restart (the kubelet saw the process die) fails the pod at once: the replica's in-memory
    state, and for world size > 1 its collective communicators, are gone. So does a pod that ended (Failed:
    rejected or evicted by the kubelet; Succeeded): it never comes back by itself, and replacing it goes
    through the same budget and backoff as any other failure (the reconciler never deletes it). Failed checks
    count only once the worker has answered one deep check: before that it is starting (the kubelet's startup
    probe owns it), or it cannot be reached from the operator at all, which replacing it would not mend.
    `outcome` is None when the pod was not probed this round.
    """
    if memory.restarts_seen is None:
        memory.restarts_seen = pod.restarts
    if pod.restarts > memory.restarts_seen or pod.terminal:
        memory.restarts_seen = pod.restarts
        memory.failures = max(memory.failures + 1, threshold)
        memory.last_reason = (
            f"pod {pod.phase}" + (f": {pod.ended or pod.failure}" if pod.ended or pod.failure else "")
            if pod.terminal
            else f"container restarted ({pod.restarts} restarts)"
        )
    elif outcome is None or (not outcome.healthy and not memory.was_healthy):
        return memory.failures >= threshold
    elif outcome.healthy:
        memory.was_healthy = True
        memory.failures = 0
        memory.failed_since = None
        memory.device_fault = False
        memory.engine = outcome.engine
        return False
    else:
        memory.failures += 1
        memory.last_reason = outcome.reason
        memory.device_fault = memory.device_fault or outcome.device_fault
    if memory.failed_since is None:
        memory.failed_since = now
    return memory.failures >= threshold


def pods_to_replace(
    failed: ObservedPod, pods: Iterable[ObservedPod], policy: Literal["Pod", "Replica"]
) -> list[ObservedPod]:
    """The failed pod, or every live pod of its replica (ranks share communicators and state)."""
    if policy == "Pod":
        return [failed]
    return sorted(
        (p for p in pods if p.replica == failed.replica and not p.terminating), key=lambda p: p.rank
    )


@dataclass(frozen=True)
class BudgetDecision:
    action: Literal["replace", "wait", "exhausted"]
    wait_seconds: float = 0.0
    message: str = ""


def backoff_delay(restarts_of_replica: int, spec: HealthSpec) -> float:
    """backoffSeconds before the first restart of a replica, doubling each time, at most maxBackoffSeconds."""
    if spec.backoff_seconds == 0:
        return 0.0
    exponent = min(restarts_of_replica, 30)
    return float(min(spec.backoff_seconds * math.pow(2, exponent), spec.max_backoff_seconds))


def restart_decision(
    group_restarts: Sequence[float],
    replica_restarts: Sequence[float],
    failed_since: float,
    now: float,
    spec: HealthSpec,
) -> BudgetDecision:
    """May the replica be replaced now? `*_restarts` are the times of earlier replacements."""
    window = spec.restart_window_seconds
    recent = [t for t in group_restarts if now - t < window]
    if len(recent) >= spec.max_restarts:
        return BudgetDecision(
            "exhausted",
            message=(
                f"{len(recent)} replacement(s) in the last {window}s reached spec.health.maxRestarts="
                f"{spec.max_restarts}; not replacing until the oldest leaves the window"
            ),
        )
    recent_replica = [t for t in replica_restarts if now - t < window]
    due = failed_since + backoff_delay(len(recent_replica), spec)
    if now < due:
        return BudgetDecision("wait", due - now, f"backoff {due - failed_since:.0f}s before replacing")
    return BudgetDecision("replace")


# The device-fault avoid list (status.avoidedNodes): how long a node is avoided, and how many are kept.
AVOID_SECONDS = 3600.0
MAX_AVOIDED_NODES = 16


def _still_avoided(entry: Mapping[str, Any], now: str) -> bool:
    try:
        since = datetime.fromisoformat(str(entry["since"]))
    except (KeyError, ValueError):
        return False
    return (datetime.fromisoformat(now) - since).total_seconds() < AVOID_SECONDS


def current_avoided(entries: Iterable[Mapping[str, Any]] | None, now: str) -> list[dict[str, Any]]:
    """The avoid list without the entries that expired (or that are not entries at all)."""
    return [
        {"node": str(e["node"]), "since": str(e["since"])}
        for e in entries or ()
        if isinstance(e, Mapping) and e.get("node") and _still_avoided(e, now)
    ]


def avoid_after_fault(
    entries: Iterable[Mapping[str, Any]] | None, node: str, now: str
) -> list[dict[str, Any]]:
    """The avoid list after a device fault on `node`: expired entries dropped, `node` (again) newest, at most
    MAX_AVOIDED_NODES (the oldest go first)."""
    kept = [e for e in current_avoided(entries, now) if e["node"] != node]
    return [*kept, {"node": node, "since": now}][-MAX_AVOIDED_NODES:]


def avoid_nodes(pod: dict[str, Any], nodes: Iterable[str]) -> dict[str, Any]:
    """The pod with a required node affinity that keeps it off `nodes` (where a device fault was seen)."""
    excluded = sorted(set(nodes))
    if not excluded:
        return pod
    spec = pod.setdefault("spec", {})
    affinity = spec.setdefault("affinity", {})
    node_affinity = affinity.setdefault("nodeAffinity", {})
    required = node_affinity.setdefault("requiredDuringSchedulingIgnoredDuringExecution", {})
    terms = required.setdefault("nodeSelectorTerms", [])
    expression = {"key": "kubernetes.io/hostname", "operator": "NotIn", "values": excluded}
    if not terms:
        terms.append({"matchExpressions": [expression]})
    else:  # terms are ORed: the exclusion must hold in each of them
        for term in terms:
            term.setdefault("matchExpressions", []).append(expression)
    return pod
