"""Pure planning: (desired shape, observed worker pods) -> which pods to create and which to delete.

Rules: replicas at or above `replicas` go, highest first; a replica whose pods run another revision (image,
env, world size, ...) is replaced as a whole, at most `maxUnavailable` available replicas at a time (an
outdated replica that is not serving anyway is replaced at once); with `whole_replicas` (health.restartPolicy
Replica) a current replica of several ranks that lost one (gone or terminating) is torn down and created again
as a whole; otherwise missing ranks of a current replica are created;
a name still held by a terminating pod is not reused until that pod is gone. A pod that ended (Failed,
Succeeded) keeps its name here: the health prober replaces it within spec.health's restart budget and backoff
(deleting it here would recreate a pod the kubelet keeps rejecting at once, in a loop).

Gang placement adds one PodGroup per replica (`plan_gang`): it is created before the replica's pods and
deleted before them (scale down, rollout, Replica restart). A PodGroup being deleted marks its replica as
being replaced, which survives an operator restart: the replica's remaining pods go, and nothing is created
for it until the PodGroup is gone.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from iwg_operator import labels
from iwg_operator.api import wiring

TERMINAL_PHASES = frozenset({"Failed", "Succeeded"})


@dataclass(frozen=True)
class ObservedPod:
    """What the operator needs to know about one worker pod (kept in the pod index)."""

    name: str
    group: str
    replica: int
    rank: int
    revision: str
    phase: str = "Pending"
    ready: bool = False
    node: str | None = None
    terminating: bool = False
    unschedulable: str | None = None  # the scheduler's message, when it could not place the pod
    uid: str = ""
    ip: str | None = None  # for the health prober
    restarts: int = 0  # container restarts the kubelet made (the health prober counts a restart as a failure)
    created: str | None = None  # creationTimestamp (RFC 3339)
    seen_by_scheduler: bool = False  # a scheduler wrote its PodScheduled condition (bound or not)
    failure: str | None = (
        None  # why its worker last ended with an error (the container's termination message)
    )
    # Why the pod ended (Failed, Succeeded): status.reason and message, as the kubelet says.
    ended: str | None = None
    pod_group: str | None = None  # spec.schedulingGroup.podGroupName: the PodGroup it names, if any
    incarnation: int = 0  # which creation of its rank it is (labels.INCARNATION; 0: none)
    epoch: int = 0  # which creation of its replica it belongs to (labels.REPLICA_EPOCH; 0: none)
    deletion_deadline: str | None = None  # metadata.deletionTimestamp: its deletion's time plus grace period

    @property
    def terminal(self) -> bool:
        """The pod ran to an end (rejected or evicted by the kubelet, failed, completed): it never comes back."""
        return self.phase in TERMINAL_PHASES


def observe_pod(body: Mapping[str, Any]) -> ObservedPod | None:
    """Summarise a pod body; None when it is not a worker pod of a group."""
    metadata = body.get("metadata", {})
    pod_labels = metadata.get("labels") or {}
    try:
        group = pod_labels[labels.GROUP]
        replica = int(pod_labels[labels.REPLICA])
        rank = int(pod_labels[labels.RANK])
    except (KeyError, ValueError):
        return None
    status = body.get("status") or {}
    conditions = {c.get("type"): c for c in status.get("conditions") or []}
    ready = conditions.get("Ready", {}).get("status") == "True"
    scheduled = conditions.get("PodScheduled", {})
    unschedulable = None
    if scheduled.get("status") == "False" and scheduled.get("reason") == "Unschedulable":
        unschedulable = str(scheduled.get("message") or "unschedulable")
    return ObservedPod(
        name=str(metadata.get("name")),
        group=group,
        replica=replica,
        rank=rank,
        revision=pod_labels.get(labels.REVISION, ""),
        phase=str(status.get("phase") or "Pending"),
        ready=ready,
        node=(body.get("spec") or {}).get("nodeName"),
        terminating=metadata.get("deletionTimestamp") is not None,
        unschedulable=unschedulable,
        uid=str(metadata.get("uid") or ""),
        ip=status.get("podIP") or None,
        restarts=sum(int(c.get("restartCount") or 0) for c in status.get("containerStatuses") or []),
        created=metadata.get("creationTimestamp"),
        seen_by_scheduler="PodScheduled" in conditions,
        failure=termination_failure(status.get("containerStatuses") or []),
        ended=_ended(status),
        pod_group=((body.get("spec") or {}).get("schedulingGroup") or {}).get("podGroupName") or None,
        incarnation=_integer((metadata.get("annotations") or {}).get(labels.INCARNATION)),
        epoch=_integer((metadata.get("annotations") or {}).get(labels.REPLICA_EPOCH)),
        deletion_deadline=metadata.get("deletionTimestamp"),
    )


def _integer(value: Any) -> int:
    try:
        return int(value) if value is not None else 0
    except (TypeError, ValueError):
        return 0


def _ended(status: Mapping[str, Any]) -> str | None:
    if status.get("phase") not in TERMINAL_PHASES:
        return None
    why = ": ".join(str(status[k]) for k in ("reason", "message") if status.get(k))
    return why[:FAILURE_MESSAGE_CHARS] or None


FAILURE_MESSAGE_CHARS = 1024


def termination_failure(container_statuses: list[Mapping[str, Any]]) -> str | None:
    """Why a container ended with an error (now, else last time): from its termination message (the worker's
    own, or the end of its log), the last line that says why its start failed, else the last line with words
    in it (not a rule of dashes a traceback printer drew); None when no container failed."""
    for container in container_statuses:
        for key in ("state", "lastState"):
            terminated = (container.get(key) or {}).get("terminated") or {}
            if terminated and terminated.get("exitCode") not in (0, None):
                lines = [line.strip() for line in str(terminated.get("message") or "").splitlines()]
                lines = [line for line in lines if any(c.isalnum() for c in line)]
                marked = [line for line in lines if wiring.START_FAILURE_PREFIX in line]
                if marked:
                    why = wiring.START_FAILURE_PREFIX + marked[-1].split(wiring.START_FAILURE_PREFIX, 1)[1]
                else:
                    why = lines[-1] if lines else f"exited with code {terminated.get('exitCode')}"
                return why[:FAILURE_MESSAGE_CHARS]
    return None


@dataclass(frozen=True)
class ObservedDriver:
    """What the status needs to know about one driver pod (kept in the driver pod index)."""

    name: str
    group: str
    ready: bool
    terminating: bool
    restarts: int


def observe_driver_pod(body: Mapping[str, Any]) -> ObservedDriver | None:
    """Summarise a driver pod body; None when it belongs to no group."""
    metadata = body.get("metadata", {})
    group = (metadata.get("labels") or {}).get(labels.GROUP)
    if not group:
        return None
    status = body.get("status") or {}
    conditions = {c.get("type"): c for c in status.get("conditions") or []}
    return ObservedDriver(
        name=str(metadata.get("name")),
        group=str(group),
        ready=conditions.get("Ready", {}).get("status") == "True",
        terminating=metadata.get("deletionTimestamp") is not None,
        restarts=sum(int(c.get("restartCount") or 0) for c in status.get("containerStatuses") or []),
    )


@dataclass(frozen=True)
class ObservedPodGroup:
    """What the operator needs to know about one replica's PodGroup (kept in the PodGroup index)."""

    name: str
    group: str
    replica: int
    min_count: int
    uid: str = ""
    terminating: bool = False
    scheduled: bool | None = None  # PodGroupInitiallyScheduled: True, False, or not set yet
    message: str | None = None  # the scheduler's message on that condition


PODGROUP_SCHEDULED = "PodGroupInitiallyScheduled"


def observe_pod_group(body: Mapping[str, Any]) -> ObservedPodGroup | None:
    """Summarise a PodGroup body; None when it is not a replica's PodGroup of a group."""
    metadata = body.get("metadata", {})
    pod_labels = metadata.get("labels") or {}
    try:
        group = pod_labels[labels.GROUP]
        replica = int(pod_labels[labels.REPLICA])
    except (KeyError, ValueError):
        return None
    gang = ((body.get("spec") or {}).get("schedulingPolicy") or {}).get("gang") or {}
    conditions = {c.get("type"): c for c in (body.get("status") or {}).get("conditions") or []}
    scheduled = conditions.get(PODGROUP_SCHEDULED)
    return ObservedPodGroup(
        name=str(metadata.get("name")),
        group=group,
        replica=replica,
        min_count=int(gang.get("minCount") or 0),
        uid=str(metadata.get("uid") or ""),
        terminating=metadata.get("deletionTimestamp") is not None,
        scheduled=None if scheduled is None else scheduled.get("status") == "True",
        message=None if scheduled is None else str(scheduled.get("message") or "") or None,
    )


@dataclass(frozen=True)
class Desired:
    replicas: int
    world_size: int
    revision: str
    max_unavailable: int
    max_surge: int = 0
    # health.restartPolicy Replica: a replica of several ranks that lost one (evicted, deleted) loses the rest too
    whole_replicas: bool = False


@dataclass(frozen=True)
class PodPlan:
    create: tuple[tuple[int, int], ...]  # (replica, rank), lowest replica first
    delete: tuple[ObservedPod, ...]  # highest replica first
    scale_down: tuple[int, ...]  # replicas removed because replicas shrank (or a rollout's surge ended)
    replace: tuple[int, ...]  # replicas replaced because they run another revision
    waiting_for_termination: bool
    rolled: tuple[int, ...] = ()  # of `replace`: replicas a rollout replaces (drained before they go)
    torn_down: tuple[int, ...] = ()  # of `replace`: replicas that lost a rank, their other ranks deleted
    extent: int = 0  # replica indices kept: replicas, and the surge replicas while a rollout runs

    @property
    def empty(self) -> bool:
        return not self.create and not self.delete


@dataclass(frozen=True)
class ReplicaView:
    index: int
    live: tuple[ObservedPod, ...]
    terminating: tuple[ObservedPod, ...]
    world_size: int
    revision: str

    @property
    def outdated(self) -> bool:
        return any(p.revision != self.revision or p.rank >= self.world_size for p in self.live)

    @property
    def available(self) -> bool:
        current = {p.rank for p in self.live if p.ready and p.revision == self.revision}
        return not self.outdated and current >= set(range(self.world_size))

    @property
    def serving(self) -> bool:
        """Every pod it has is ready and none is going away (whatever its revision): it answers requests."""
        return bool(self.live) and not self.terminating and all(p.ready for p in self.live)

    @property
    def missing_ranks(self) -> list[int]:
        held = {p.rank for p in self.live} | {p.rank for p in self.terminating}
        return [rank for rank in range(self.world_size) if rank not in held]


def replica_views(desired: Desired, pods: Iterable[ObservedPod]) -> dict[int, ReplicaView]:
    grouped: dict[int, list[ObservedPod]] = defaultdict(list)
    for pod in pods:
        grouped[pod.replica].append(pod)
    indices = set(grouped) | set(range(desired.replicas))
    return {
        index: ReplicaView(
            index=index,
            live=tuple(sorted((p for p in grouped[index] if not p.terminating), key=lambda p: p.rank)),
            terminating=tuple(p for p in grouped[index] if p.terminating),
            world_size=desired.world_size,
            revision=desired.revision,
        )
        for index in sorted(indices)
    }


def plan_pods(
    desired: Desired, pods: Iterable[ObservedPod], replacing: frozenset[int] = frozenset()
) -> PodPlan:
    """`replacing`: replicas whose PodGroup is being deleted; their pods go and none is created for them.

    A rollout with `max_surge` keeps `max_surge` more replicas of the new revision (indices from `replicas`
    on) until every replica below `replicas` runs the new revision and serves; then they leave like a
    scale-down. Of the replicas + surge, at most `max_unavailable` may be unavailable: a serving replica is
    replaced only while that holds (surge replicas not serving yet count as unavailable)."""
    views = replica_views(desired, pods)
    delete: list[ObservedPod] = []
    scale_down: list[int] = []
    replace: list[int] = []
    rolled: list[int] = []
    torn_down: list[int] = []
    create: list[tuple[int, int]] = []

    below = [views[i] for i in range(desired.replicas)]
    extent = desired.replicas
    if desired.max_surge > 0:
        surge = range(desired.replicas, desired.replicas + desired.max_surge)
        rolling = any(view.outdated for view in below)
        surged = any(views[i].live for i in surge if i in views)
        if rolling or (surged and not all(view.available for view in below)):
            extent += desired.max_surge
            views = replica_views(Desired(extent, desired.world_size, desired.revision, 0), pods)

    for index in sorted(views, reverse=True):
        view = views[index]
        if index >= extent and view.live:
            scale_down.append(index)
            delete.extend(sorted(view.live, key=lambda p: -p.rank))

    kept = [views[i] for i in range(extent)]
    unavailable = sum(1 for view in kept if not view.serving)
    budget = desired.max_unavailable - unavailable
    for view in sorted(kept, key=lambda v: -v.index):
        if view.index in replacing:
            if view.live:
                replace.append(view.index)
                delete.extend(sorted(view.live, key=lambda p: -p.rank))
            continue
        if not view.outdated:
            if (desired.whole_replicas and broken(view)) or split(view):
                torn_down.append(view.index)
                replace.append(view.index)
                delete.extend(sorted(view.live, key=lambda p: -p.rank))
            continue
        if view.serving:
            if budget <= 0:
                continue
            budget -= 1
        # Drained before it goes whether it serves or not: readiness is a probe's last answer (under load a
        # ready replica can miss one), while a driver routes by its own view and may have batches there.
        rolled.append(view.index)  # outdated: it has pods
        replace.append(view.index)
        delete.extend(sorted(view.live, key=lambda p: -p.rank))

    for view in kept:
        if view.outdated or view.index in replacing or view.index in torn_down:
            continue
        if desired.whole_replicas and view.world_size > 1 and view.terminating:
            # Rebuilt whole: a rank made while another of the old ones still terminates would find the
            # replica broken (a live rank beside a terminating one) and be torn down in turn, and again for
            # each old rank that leaves later: the replica never forms (seen on real kubelets, whose ranks
            # take their grace periods to go one by one).
            continue
        create.extend((view.index, rank) for rank in view.missing_ranks)

    waiting = any(view.terminating for view in views.values())
    return PodPlan(
        create=tuple(create),
        delete=tuple(delete),
        scale_down=tuple(scale_down),
        replace=tuple(sorted(replace, reverse=True)),
        waiting_for_termination=waiting,
        rolled=tuple(sorted(rolled, reverse=True)),
        extent=extent,
        torn_down=tuple(sorted(torn_down, reverse=True)),
    )


def broken(view: ReplicaView) -> bool:
    """A replica of several ranks with some still running and one going, or gone while the others are Ready
    (an eviction, a deletion by hand): its running ranks cannot serve without it (they share communicators),
    yet they would stay Ready and count as available to a PodDisruptionBudget. A rank missing beside ranks not
    Ready yet is one still to be created (its creation failed), not a loss."""
    if view.world_size == 1 or not view.live:
        return False
    return bool(view.terminating) or bool(view.missing_ranks and any(p.ready for p in view.live))


def split(view: ReplicaView) -> bool:
    """A replica whose ranks belong to different creations of it (replica epochs: a race, a creation another
    leader made): they meet in different rendezvous and never form a group, so it is torn down and made again
    as a whole, whatever health.restartPolicy says."""
    return view.world_size > 1 and len({p.epoch for p in view.live}) > 1


@dataclass(frozen=True)
class GangPlan:
    active: bool  # gang placement on and served: every pod created names its replica's PodGroup
    delete: tuple[ObservedPodGroup, ...]  # PodGroups to delete, before any pod of theirs
    create: tuple[int, ...]  # replicas whose PodGroup is created, before their pods
    held: frozenset[int]  # replicas that get no pod in this pass (their PodGroup is going)
    loose: frozenset[int] = (
        frozenset()
    )  # replicas placed without a gang: they get no PodGroup (loose_replicas)

    @property
    def empty(self) -> bool:
        return not self.delete and not self.create


def replacing_replicas(pod_groups: Iterable[ObservedPodGroup]) -> frozenset[int]:
    """Replicas whose PodGroup is being deleted: they are being replaced (see plan_pods)."""
    return frozenset(g.replica for g in pod_groups if g.terminating)


def loose_replicas(pods: Iterable[ObservedPod], revision: str) -> frozenset[int]:
    """Replicas of the current revision with a live pod that names no PodGroup: placed one by one while the
    cluster did not serve gang placement. They stay so (a PodGroup now would wait for minCount pods naming it,
    which their running pods never do); their next replacement (rollout, Replica restart) makes them gangs.
    `pods` must be what the API server showed (the index), not pods this operator just created."""
    return frozenset(
        p.replica for p in pods if not p.terminating and p.revision == revision and p.pod_group is None
    )


def plan_gang(
    desired: Desired,
    gang: bool,
    pod_groups: Iterable[ObservedPodGroup],
    plan: PodPlan,
    loose: frozenset[int] = frozenset(),
) -> GangPlan:
    """PodGroups to delete and create so that each replica that gets pods has exactly one current PodGroup.

    Deleted: all of them when gang placement is off; those of replicas at or above `replicas`, of replicas
    being replaced, and those whose minCount is not the world size. Created: for replicas that get pods and
    have none. Held: replicas whose PodGroup is still there but going (its pods wait for the new one).
    """
    by_replica: dict[int, ObservedPodGroup] = {}
    for pod_group in pod_groups:
        if pod_group.replica not in by_replica or by_replica[pod_group.replica].terminating:
            by_replica[pod_group.replica] = pod_group
    replaced = set(plan.replace) | set(plan.scale_down)
    delete = [
        g
        for g in by_replica.values()
        if not g.terminating
        and (
            not gang
            or g.replica >= max(desired.replicas, plan.extent)
            or g.replica in replaced
            or g.min_count != desired.world_size
        )
    ]
    going = {g.replica for g in delete} | {g.replica for g in by_replica.values() if g.terminating}
    wanted = sorted({replica for replica, _ in plan.create}) if gang else []
    loose = loose - set(plan.replace) if gang else frozenset()
    create = [r for r in wanted if r not in by_replica and r not in loose]
    return GangPlan(
        active=gang,
        delete=tuple(sorted(delete, key=lambda g: -g.replica)),
        create=tuple(create),
        held=frozenset(going if gang else ()),
        loose=frozenset(loose),
    )


def overdue_deletions(
    pods: Iterable[ObservedPod], now: float, after: float
) -> tuple[list[ObservedPod], float | None]:
    """Pods still there `after` seconds past their deletion deadline (a kubelet kills a pod's containers at
    that deadline and removes it at once, so none is acting for these: their node is gone), and the seconds
    until the next terminating pod would be (None: none will)."""
    overdue: list[ObservedPod] = []
    waits: list[float] = []
    for pod in pods:
        if pod.deletion_deadline is None:
            continue
        try:
            deadline = datetime.fromisoformat(pod.deletion_deadline.replace("Z", "+00:00")).timestamp()
        except ValueError:
            continue
        left = deadline + after - now
        if left <= 0:
            overdue.append(pod)
        else:
            waits.append(left)
    return overdue, min(waits, default=None)
