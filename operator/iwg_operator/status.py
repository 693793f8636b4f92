"""Pure status computation: (desired shape, observed pods, plan, previous status) -> the group's status.

Conditions keep their lastTransitionTime while their status does not change, so an unchanged world yields
an identical status and the operator writes nothing.

Two writers share the status: the reconciler (phase, counts, replicaStatuses and the conditions in
RECONCILER_CONDITIONS) and the supervisor (restartCount, engine, avoidedNodes, scale counters and its own
conditions). Each writes only its own fields and conditions, merged into the status as last read
(`status_patch`), and the write is checked against the resourceVersion it was read at (see
Controller.write_status): neither can put back a condition the other changed.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from iwg_operator import labels
from iwg_operator.planning import (
    Desired,
    ObservedDriver,
    ObservedPod,
    ObservedPodGroup,
    PodPlan,
    ReplicaView,
    replica_views,
)

READY = "Ready"
PROGRESSING = "Progressing"
DEGRADED = "Degraded"
UNSCHEDULABLE = "Unschedulable"
SPEC_INVALID = "SpecInvalid"
RECONCILE_FAILED = "ReconcileFailed"
GANG_SCHEDULING = "GangScheduling"
DRIVER_AVAILABLE = "DriverAvailable"

# The conditions the reconciler computes; those in RECONCILER_REMOVES disappear when it no longer writes them
# (a spec made valid, a refusal resolved, gang placement turned off). Other types belong to other writers.
RECONCILER_CONDITIONS = frozenset(
    {
        READY,
        PROGRESSING,
        DEGRADED,
        UNSCHEDULABLE,
        SPEC_INVALID,
        RECONCILE_FAILED,
        GANG_SCHEDULING,
        DRIVER_AVAILABLE,
    }
)
RECONCILER_REMOVES = frozenset({SPEC_INVALID, RECONCILE_FAILED, GANG_SCHEDULING})

GANG_NOT_SERVED = (
    "the cluster does not serve workloads and podgroups (scheduling.k8s.io/v1beta1: Kubernetes >= 1.37 with "
    "the GenericWorkload feature gate and that API enabled); pods are placed one by one"
)

Status = dict[str, Any]

# A pod that no scheduler has looked at this long after its creation is reported: its schedulerName names a
# scheduler that does not run (or the default scheduler is down).
DEFAULT_SCHEDULING_TIMEOUT_SECONDS = 60.0


def rfc3339(wall: float) -> str:
    """A Unix time as the status writes times: RFC 3339, whole seconds, UTC."""
    return datetime.fromtimestamp(wall, UTC).replace(microsecond=0).isoformat().replace("+00:00", "Z")


def _age(pod: ObservedPod, now: str) -> float:
    if not pod.created:
        return 0.0
    return (datetime.fromisoformat(now) - datetime.fromisoformat(pod.created)).total_seconds()


def unbound(pods: Iterable[ObservedPod]) -> list[ObservedPod]:
    """Live pods not bound to a node (placed means bound)."""
    return sorted((p for p in pods if not p.node and not p.terminating), key=lambda p: p.name)


def not_picked_up(pods: Iterable[ObservedPod], now: str, timeout: float) -> list[ObservedPod]:
    """Unbound pods no scheduler has looked at `timeout` seconds after their creation."""
    return [p for p in unbound(pods) if not p.seen_by_scheduler and _age(p, now) >= timeout]


def scheduling_recheck(pods: Iterable[ObservedPod], now: str, timeout: float) -> float | None:
    """Seconds until an unbound pod no scheduler has seen would count as not picked up, if any will."""
    waits = [timeout - _age(p, now) for p in unbound(pods) if not p.seen_by_scheduler]
    pending = [wait for wait in waits if wait > 0]
    return min(pending) if pending else None


@dataclass(frozen=True)
class Gang:
    """Gang placement as the status reports it: whether the cluster serves it, and the replicas' PodGroups."""

    served: bool
    pod_groups: tuple[ObservedPodGroup, ...] = ()

    def replica(self, view: ReplicaView) -> tuple[str, str | None]:
        """("Placed" | "Waiting", the scheduler's message) of one replica with pods."""
        pod_group = next((g for g in self.pod_groups if g.replica == view.index and not g.terminating), None)
        bound = len(view.live) >= view.world_size and all(p.node for p in view.live)
        if bound or (pod_group is not None and pod_group.scheduled):
            return "Placed", None
        message = pod_group.message if pod_group is not None else None
        return "Waiting", message or next((p.unschedulable for p in view.live if p.unschedulable), None)


def condition(
    kind: str,
    ok: bool,
    reason: str,
    message: str,
    generation: int,
    previous: Mapping[str, Mapping[str, Any]],
    now: str,
) -> dict[str, Any]:
    status = "True" if ok else "False"
    before = previous.get(kind)
    changed = before is None or before.get("status") != status
    return {
        "type": kind,
        "status": status,
        "reason": reason,
        "message": message[:4096],
        "lastTransitionTime": now if changed or before is None else before.get("lastTransitionTime", now),
        "observedGeneration": generation,
    }


def previous_conditions(status: Mapping[str, Any] | None) -> dict[str, Mapping[str, Any]]:
    return {
        c["type"]: c for c in (status or {}).get("conditions") or [] if isinstance(c, Mapping) and "type" in c
    }


def group_status(
    group_name: str,
    generation: int,
    desired: Desired,
    pods: Iterable[ObservedPod],
    plan: PodPlan,
    previous: Mapping[str, Any] | None,
    now: str,
    failure: str | None = None,
    scheduler_name: str | None = None,
    scheduling_timeout: float = DEFAULT_SCHEDULING_TIMEOUT_SECONDS,
    gang: Gang | None = None,
    drivers: Iterable[ObservedDriver] | None = None,
) -> Status:
    """The status the group should show. `failure` is an error from applying the plan (API refusal);
    `scheduler_name` is spec.scheduling.schedulerName, named when no scheduler picks the pods up; `gang` is
    None when the spec asks for no gang placement; `drivers` are the group's driver pods (None: not looked
    at, no DriverAvailable condition)."""
    pods = list(pods)
    views = replica_views(desired, pods)
    kept = [views[i] for i in range(desired.replicas)]
    existing = [v for v in views.values() if v.live]
    ready = sum(1 for v in kept if v.available)
    updated = sum(1 for v in kept if v.live and not v.outdated and not v.missing_ranks)
    unschedulable = sorted((p for p in pods if p.unschedulable and not p.terminating), key=lambda p: p.name)
    waiting = unbound(pods)
    ignored = not_picked_up(pods, now, scheduling_timeout) if waiting else []
    failed_pods = [p for p in pods if p.phase == "Failed"]
    # Workers that ended with an error and are not serving: why (a start that failed names its cause).
    worker_failures = sorted(
        (p.name, p.failure) for p in pods if p.failure is not None and not p.ready and not p.terminating
    )
    settled = plan.empty and not plan.waiting_for_termination and updated == desired.replicas
    before = previous_conditions(previous)

    if failure is not None:
        phase = "Failed" if ready == 0 else "Degraded"
    elif unschedulable or ignored or failed_pods or worker_failures:
        phase = "Pending" if ready == 0 else "Degraded"
    elif desired.replicas == 0 and settled and not existing:
        phase = "Idle"  # scaled to zero (by the autoscaler or kubectl scale): nothing is wrong
    elif ready == desired.replicas and settled:
        phase = "Running"
    elif ready == 0 and desired.replicas > 0 and not any(p.ready for p in pods):
        phase = "Pending"
    else:
        phase = "Progressing"

    conditions = [
        condition(
            READY,
            ready == desired.replicas,
            "AllReplicasReady" if ready == desired.replicas else "ReplicasNotReady",
            f"{ready}/{desired.replicas} replicas ready",
            generation,
            before,
            now,
        ),
        condition(
            PROGRESSING,
            not settled,
            "Reconciling" if not settled else "Settled",
            _progress_message(plan, desired, updated),
            generation,
            before,
            now,
        ),
    ]
    degraded_reasons = []
    if unschedulable:
        degraded_reasons.append(f"{len(unschedulable)} pod(s) unschedulable")
    if ignored:
        degraded_reasons.append(f"{len(ignored)} pod(s) not picked up by any scheduler")
    if failed_pods:
        degraded_reasons.append(f"{len(failed_pods)} pod(s) failed")
    if failure is not None:
        degraded_reasons.append(failure)
    degraded_reasons.extend(f"worker {name} failed: {why}" for name, why in worker_failures)
    conditions.append(
        condition(
            DEGRADED,
            bool(degraded_reasons),
            "Unschedulable"
            if unschedulable
            else "NotScheduled"
            if ignored
            else (
                "PodsFailed"
                if failed_pods
                else ("ReconcileFailed" if failure else ("WorkerFailed" if worker_failures else "Healthy"))
            ),
            "; ".join(degraded_reasons) or "no problems",
            generation,
            before,
            now,
        )
    )
    conditions.append(
        condition(
            UNSCHEDULABLE,
            bool(unschedulable or ignored),
            *_scheduling(unschedulable, ignored, waiting, scheduler_name, scheduling_timeout),
            generation,
            before,
            now,
        )
    )
    if failure is not None or RECONCILE_FAILED in before:
        conditions.append(
            condition(
                RECONCILE_FAILED,
                failure is not None,
                "ApiRefused" if failure else "Applied",
                failure or "last reconcile applied",
                generation,
                before,
                now,
            )
        )
    if SPEC_INVALID in before:
        conditions.append(condition(SPEC_INVALID, False, "Valid", "spec is valid", generation, before, now))
    if drivers is not None:
        conditions.append(_driver_condition(list(drivers), generation, before, now))
    placement = {v.index: gang.replica(v) for v in existing} if gang is not None and gang.served else {}
    if gang is not None:
        conditions.append(_gang_condition(gang, placement, generation, before, now))
    # Conditions written by others (the health prober, the autoscaler) are kept as they are.
    owned = {c["type"] for c in conditions} | {SPEC_INVALID, RECONCILE_FAILED, GANG_SCHEDULING}
    conditions.extend(dict(c) for kind, c in before.items() if kind not in owned)

    return {
        "phase": phase,
        "replicas": len(existing),
        "readyReplicas": ready,
        "updatedReplicas": updated,
        "worldSize": desired.world_size,
        "selector": labels.selector_string(labels.worker_selector(group_name)),
        "revision": desired.revision,
        "observedGeneration": generation,
        "replicaStatuses": [
            {
                "index": v.index,
                "pods": len(v.live),
                "readyPods": sum(1 for p in v.live if p.ready),
                "ready": v.available,
                "revision": _replica_revision(v.live),
                "nodes": sorted({p.node for p in v.live if p.node}),
                **_gang_fields(placement.get(v.index)),
            }
            for v in existing
        ],
        "conditions": conditions,
    }


def _driver_condition(
    drivers: list[ObservedDriver], generation: int, before: Mapping[str, Mapping[str, Any]], now: str
) -> dict[str, Any]:
    """DriverAvailable: True while a driver pod is ready (it serves the group's clients); False while none
    is, which is when the group's Service has nobody to send requests to."""
    live = sorted((d for d in drivers if not d.terminating), key=lambda d: d.name)
    ready = [d for d in live if d.ready]
    if ready:
        message = f"{len(ready)}/{len(live)} driver pod(s) ready"
        return condition(DRIVER_AVAILABLE, True, "DriverReady", message, generation, before, now)
    if not live:
        return condition(DRIVER_AVAILABLE, False, "NoDriverPod", "no driver pod", generation, before, now)
    message = "no driver pod ready: " + ", ".join(f"{d.name} (restarts {d.restarts})" for d in live)
    return condition(DRIVER_AVAILABLE, False, "DriverDown", message, generation, before, now)


def _scheduling(
    unschedulable: list[ObservedPod],
    ignored: list[ObservedPod],
    waiting: list[ObservedPod],
    scheduler_name: str | None,
    timeout: float,
) -> tuple[str, str]:
    """Reason and message of the Unschedulable condition: the scheduler's refusal, pods no scheduler picked
    up, pods waiting for a node, or every pod bound."""
    if unschedulable:
        return "Unschedulable", f"{unschedulable[0].name}: {unschedulable[0].unschedulable}"
    if ignored:
        scheduler = (
            f"spec.scheduling.schedulerName {scheduler_name!r}"
            if scheduler_name
            else "the default scheduler (spec.scheduling.schedulerName unset)"
        )
        return "NotScheduled", (
            f"{len(ignored)} pod(s) not picked up by any scheduler {timeout:g}s after creation "
            f"(first {ignored[0].name}): is {scheduler} running?"
        )
    if waiting:
        return "Scheduling", f"{len(waiting)} pod(s) waiting to be bound to a node"
    return "Scheduled", "all pods bound to nodes"


def _gang_fields(placement: tuple[str, str | None] | None) -> dict[str, str]:
    if placement is None:
        return {}
    state, message = placement
    return {"gang": state, "gangMessage": message} if message else {"gang": state}


def _gang_condition(
    gang: Gang,
    placement: Mapping[int, tuple[str, str | None]],
    generation: int,
    before: Mapping[str, Mapping[str, Any]],
    now: str,
) -> dict[str, Any]:
    if not gang.served:
        return condition(GANG_SCHEDULING, False, "ApiNotServed", GANG_NOT_SERVED, generation, before, now)
    waiting = {index: message for index, (state, message) in placement.items() if state == "Waiting"}
    if not waiting:
        return condition(
            GANG_SCHEDULING,
            True,
            "Placed",
            f"{len(placement)} replica(s) placed whole",
            generation,
            before,
            now,
        )
    message = "; ".join(
        f"replica {index}: {text or 'waiting for the scheduler'}" for index, text in sorted(waiting.items())
    )
    return condition(GANG_SCHEDULING, True, "Waiting", message, generation, before, now)


def invalid_spec_status(
    group_name: str, generation: int, message: str, previous: Mapping[str, Any] | None, now: str
) -> Status:
    before = previous_conditions(previous)
    kept = [c for kind, c in before.items() if kind not in (SPEC_INVALID, READY, PROGRESSING, DEGRADED)]
    return {
        "phase": "Failed",
        "observedGeneration": generation,
        "selector": labels.selector_string(labels.worker_selector(group_name)),
        "conditions": [
            condition(READY, False, "SpecInvalid", "spec is invalid", generation, before, now),
            condition(PROGRESSING, False, "SpecInvalid", "waiting for a valid spec", generation, before, now),
            condition(DEGRADED, True, "SpecInvalid", message, generation, before, now),
            condition(SPEC_INVALID, True, "SpecInvalid", message, generation, before, now),
            *kept,
        ],
    }


def set_conditions(
    current: Iterable[Mapping[str, Any]] | None,
    mine: Iterable[Mapping[str, Any]],
    owned: Iterable[str],
    now: str,
) -> list[dict[str, Any]]:
    """The conditions after one writer sets its own: each of `mine` replaces the current one of its type in
    place (new types go last); a current condition of an `owned` type not in `mine` is removed; every other
    condition stays as it is. A condition whose status equals the current one keeps its lastTransitionTime
    (it may have been computed from an older read); one whose status changes takes `now`."""
    # lastTransitionTime `now`, corrected below where the status is unchanged
    wanted = {c["type"]: {**c, "lastTransitionTime": now} for c in mine}
    drop = set(owned) - wanted.keys()
    result: list[dict[str, Any]] = []
    for item in current or ():
        kind = item.get("type")
        if kind in drop:
            continue
        mine_now = wanted.pop(kind, None) if isinstance(kind, str) else None
        if mine_now is None:
            result.append(dict(item))
            continue
        if item.get("status") == mine_now["status"] and item.get("lastTransitionTime"):
            mine_now["lastTransitionTime"] = item["lastTransitionTime"]
        result.append(mine_now)
    result.extend(wanted.values())
    return result


def status_patch(
    current: Mapping[str, Any] | None,
    fields: Mapping[str, Any],
    conditions: Iterable[Mapping[str, Any]],
    owned: Iterable[str],
    now: str,
) -> Status:
    """The merge patch that sets one writer's `fields` and `conditions` (of the `owned` types) on the status
    as last read: only what differs; empty when nothing does."""
    current = current or {}
    patch: Status = {key: value for key, value in fields.items() if current.get(key) != value}
    before = list(current.get("conditions") or [])
    merged = set_conditions(before, conditions, owned, now)
    if merged != before:
        patch["conditions"] = merged
    return patch


def reconciler_patch(current: Mapping[str, Any] | None, desired: Status, now: str) -> Status:
    """`status_patch` for the reconciler's whole computed status (group_status, invalid_spec_status): its
    fields, and its conditions of RECONCILER_CONDITIONS (the others' it copied are left to the others)."""
    mine = [c for c in desired.get("conditions") or [] if c.get("type") in RECONCILER_CONDITIONS]
    fields = {key: value for key, value in desired.items() if key != "conditions"}
    owned = {c["type"] for c in mine} | RECONCILER_REMOVES
    return status_patch(current, fields, mine, owned, now)


def status_differs(current: Mapping[str, Any] | None, desired: Status) -> bool:
    """True when some field the operator owns differs (fields others write are ignored)."""
    current = current or {}
    return any(current.get(key) != value for key, value in desired.items())


def _replica_revision(pods: Iterable[ObservedPod]) -> str:
    revisions = sorted({p.revision for p in pods})
    return revisions[0] if len(revisions) == 1 else ",".join(revisions)


def _progress_message(plan: PodPlan, desired: Desired, updated: int) -> str:
    parts = [f"{updated}/{desired.replicas} replicas at revision {desired.revision}"]
    if plan.create:
        parts.append(f"{len(plan.create)} pod(s) to create")
    if plan.delete:
        parts.append(f"{len(plan.delete)} pod(s) to delete")
    if plan.waiting_for_termination:
        parts.append("waiting for pods to terminate")
    return ", ".join(parts)
