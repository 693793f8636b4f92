"""The reconciler: one serial loop per group that applies the difference between desired and observed.

Kopf handlers only feed it (group bodies, spec acceptance, pod changes); it never lists anything: pods come
from Kopf's in-memory pod index. Bursts of events are coalesced; a group is never reconciled twice at once.
Writes happen only when something differs: children are compared field by field with what the builders
produce (they carry a hash of their desired content), pods have deterministic names (a second create is a
harmless 409), and status is patched only when it changes. Children deleted or edited by hand are repaired:
the handlers feed their watch events (`child_changed`), and a child that is gone or differs makes the group's
loop look at its children again.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import secrets
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, TypeVar

import aiohttp
import zmq

from iwg_operator import builders, drift, labels, metrics, planning, pod_http, status
from iwg_operator.api import v1alpha1 as api
from iwg_operator.builders.common import (
    config_map_name,
    driver_name,
    driver_pdb_name,
    drivers_service_name,
    headless_service_name,
    network_policy_name,
    pdb_name,
    secret_name,
    stable_hash,
)
from iwg_operator.builders.workers import name_group_fields
from iwg_operator.driver_admin import DrainError, NoRunningDriver, drain_group_replicas
from iwg_operator.health.policy import avoid_nodes, current_avoided
from iwg_operator.kube import (
    CONFIG_MAPS,
    DEPLOYMENTS,
    EVENTS,
    GROUPS,
    NETWORK_POLICIES,
    POD_DISRUPTION_BUDGETS,
    POD_GROUPS,
    PODS,
    SECRETS,
    SERVICES,
    WORKLOADS,
    ApiError,
    KubeApi,
    Resource,
    gather_limited,
)

log = logging.getLogger("iwg_operator.controller")

GroupKey = tuple[str, str]  # (namespace, name)
PodLookup = Callable[[GroupKey], Iterable[planning.ObservedPod]]
PodGroupLookup = Callable[[GroupKey], Iterable[planning.ObservedPodGroup]]
DriverLookup = Callable[[GroupKey], Iterable[planning.ObservedDriver]]

DEBOUNCE_SECONDS = 0.05
EXPECTATION_SECONDS = 30.0
WRITE_CONCURRENCY = 16
# Groups writing their driver, Services and policies at once: those requests wait behind every pod anyway, and
# building them for hundreds of groups at a time only holds memory.
SUPPORT_CONCURRENCY = 16
# Seconds after which a pod no scheduler has looked at is reported (condition Unschedulable, NotScheduled).
ENV_SCHEDULING_TIMEOUT = "IWG_SCHEDULING_TIMEOUT_S"
# While the cluster does not serve gang placement (scheduling.k8s.io/v1beta1), discovery is asked again this
# often, and every gang group is reconciled again as often: an API enabled later is used without a restart.
ENV_GANG_API_RECHECK = "IWG_GANG_API_RECHECK_S"
GANG_API_RECHECK_SECONDS = 60.0
MIN_BACKOFF_SECONDS = 1.0
# Status writes refused because the group changed since it was read (409), each followed by a fresh read.
STATUS_WRITE_ATTEMPTS = 5
MAX_BACKOFF_SECONDS = 300.0
# A worker pod still there this long after its deletion deadline has no kubelet acting for it (its node is off or
# cut off): it is deleted with grace period 0, so its replacement (the same name) can be made. Fencing keeps the
# old process, should it still run, from serving (wiring.INCARNATION).
FORCE_DELETE_AFTER_SECONDS = 30.0
# How long a pass that finds the group's Secret gone waits for the watch to deliver its data (to put it back).
SECRET_EVENT_WAIT_SECONDS = 5.0


class ReconcileRefused(Exception):
    """The API server refused part of the plan (invalid pod, missing PriorityClass, name taken...)."""


@dataclass
class GroupState:
    key: GroupKey
    body: Mapping[str, Any]
    group: builders.Group | None = None
    children_hash: str | None = None
    expected_present: dict[str, float] = field(default_factory=dict)  # pod name -> deadline
    expected_gone: dict[str, float] = field(default_factory=dict)  # pod uid -> deadline
    force_deleted: dict[str, float] = field(default_factory=dict)  # pod uid -> deadline (the index may lag)
    # PodGroups this operator created / deleted that the index may not show yet
    pod_groups_made: dict[str, float] = field(default_factory=dict)  # name -> deadline
    pod_groups_gone: dict[str, float] = field(default_factory=dict)  # uid -> deadline
    trigger: asyncio.Event = field(default_factory=asyncio.Event)
    task: asyncio.Task[None] | None = None
    backoff: float = 0.0
    # metadata.resourceVersion of the read the status in `body` comes from (a watch event, a write's answer, a
    # GET): status writes are checked against it
    status_version: str | None = None
    posted: dict[str, str] = field(default_factory=dict)  # event reason -> last message, to post once
    children_attempted: bool = False  # a retry after a failed first pass looks before it creates
    decided_generation: int = 0  # the generation whose spec was last accepted or rejected
    invalid: str | None = None  # why the decided spec was rejected; the loop marks the group with it
    drained: set[int] = field(default_factory=set)  # replicas drained in the driver for a scale-down
    support_refused: str | None = None  # why the supporting objects were refused, until they are applied
    # Children deleted or edited by hand: each such watch event counts up `repairs_due`; a pass that applied
    # every child sets `repairs_done` to the count it started with.
    repairs_due: int = 0
    repairs_done: int = 0
    # The data of the group's deleted Secret, to put back as it was.
    lost_secret: Mapping[str, str] | None = None
    # (the group's rotate-keys value, keys_digest) of the Secret last read or written; None: not read yet
    keys: tuple[str, str] | None = None
    # (plural, name) -> (desired spec hash, fingerprint): what an apply left that still differs from the manifest
    # (another manager's item in a list the operator sets); not written again while it stays so.
    accepted_drift: dict[tuple[str, str], tuple[str, str]] = field(default_factory=dict)
    # (plural, name) -> (generation, digest of labels, annotations, owners) of the child last found in sync: a
    # later event with the same ones is a status update (Deployments and PDBs get many) and is not compared.
    seen_in_sync: dict[tuple[str, str], tuple[int, str]] = field(default_factory=dict)
    hashed: tuple[builders.Group, str] | None = None  # the children hash of a group object, computed once
    # (replica, rank) -> the incarnation of the pod last created for it (pods of a rank are numbered upwards).
    incarnations: dict[tuple[int, int], int] = field(default_factory=dict)
    # replica -> the epoch of its creation this operator made last (creations of a replica are numbered upwards),
    # and pod name -> the epoch it was created with (for pods the watch has not shown yet).
    epochs: dict[int, int] = field(default_factory=dict)
    pod_epochs: dict[str, int] = field(default_factory=dict)

    @property
    def current_status(self) -> Mapping[str, Any]:
        return self.body.get("status") or {}

    @property
    def generation(self) -> int:
        return int(self.body.get("metadata", {}).get("generation") or 1)

    def __post_init__(self) -> None:
        if self.status_version is None:
            self.status_version = _resource_version(self.body)

    def see(self, body: Mapping[str, Any]) -> None:
        """A watch event's body. Its status is kept only when it is not older than the status held: a watch
        that lags (hundreds of groups) still delivers the bodies this operator's own later writes replaced, and
        a pass computed from one of them would write back what those writes changed. Spec and metadata are
        always taken (events arrive in order; only this operator's write answers run ahead of them)."""
        version = _resource_version(body)
        known = self.current_status
        if _older(version, self.status_version) or (version is None and not body.get("status") and known):
            self.body = {**body, "status": known}
        else:
            self.body = body
            self.status_version = version

    def adopt(self, body: Mapping[str, Any]) -> None:
        """The object as a write answered it or a GET read it: its status, at its resourceVersion."""
        self.body = {**self.body, "status": body.get("status") or {}}
        self.status_version = _resource_version(body) or self.status_version


def now_rfc3339() -> str:
    return datetime.now(UTC).replace(microsecond=0).isoformat().replace("+00:00", "Z")


def group_from_body(body: Mapping[str, Any]) -> builders.Group:
    """Validate a group body (raises api.ManifestError naming the field)."""
    metadata = body.get("metadata", {})
    spec = api.parse_spec(body.get("spec") or {})
    return builders.Group(
        name=str(metadata["name"]),
        namespace=str(metadata["namespace"]),
        uid=str(metadata.get("uid", "")),
        spec=spec,
        generation=int(metadata.get("generation") or 1),
    )


class Controller:
    def __init__(self, kube: KubeApi, settings: builders.BuildSettings | None = None) -> None:
        self.kube = kube
        self.settings = settings or builders.BuildSettings()
        self.groups: dict[GroupKey, GroupState] = {}
        self._pods: PodLookup = lambda key: ()
        self._pod_groups: PodGroupLookup = lambda key: ()
        self._drivers: DriverLookup | None = None
        self._support_slots = asyncio.Semaphore(SUPPORT_CONCURRENCY)
        self._http: aiohttp.ClientSession | None = None
        self.scheduling_timeout = float(
            os.environ.get(ENV_SCHEDULING_TIMEOUT, status.DEFAULT_SCHEDULING_TIMEOUT_SECONDS)
        )
        self.gang_api_recheck = float(os.environ.get(ENV_GANG_API_RECHECK, GANG_API_RECHECK_SECONDS))
        # Called once when gang placement becomes served after it was not (Kopf then watches PodGroups).
        self.on_gang_api_served: Callable[[], Awaitable[None]] | None = None
        self._gang_api_served: bool | None = None  # the last answer of discovery
        self._gang_api_ready: asyncio.Future[None] | None = None  # on_gang_api_served, once

    # ------------------------------------------------------------------ fed by the handlers

    def bind_pod_index(self, lookup: PodLookup) -> None:
        self._pods = lookup

    def bind_pod_group_index(self, lookup: PodGroupLookup) -> None:
        self._pod_groups = lookup

    def bind_driver_index(self, lookup: DriverLookup) -> None:
        self._drivers = lookup

    def observe_group(self, body: Mapping[str, Any]) -> bool:
        """Every watch event of a live group: keep its latest body. True when its generation has not been
        decided yet (the caller validates the spec, then accepts or rejects it); status writes, label edits
        and repeated events of a decided generation change nothing else."""
        key = _key(body)
        state = self.groups.get(key)
        if state is None:
            state = self.groups[key] = GroupState(key=key, body=body)
        else:
            state.see(body)
        if state.group is not None and state.keys is not None and state.keys[0] != _rotation(body):
            self._wake(state)  # `rotate-keys` set or changed: new keys, every pod rolled
        return state.decided_generation != _generation(body)

    def accept(self, body: Mapping[str, Any], group: builders.Group) -> None:
        """A valid spec: reconcile towards it."""
        state = self._decided(body)
        state.group = group
        state.invalid = None
        self._start(state)

    def reject(self, body: Mapping[str, Any], message: str) -> None:
        """An invalid spec the API server could not catch: stop reconciling; the loop marks it, tells the user
        once, and retries the marking if the API refuses it for a while."""
        state = self._decided(body)
        state.group = None
        state.invalid = message
        self._start(state)

    def _decided(self, body: Mapping[str, Any]) -> GroupState:
        state = self.groups.setdefault(key := _key(body), GroupState(key=key, body=body))
        if _generation(body) >= state.generation:
            state.see(body)  # keeps the status this operator already knows when the body predates it
        state.decided_generation = _generation(body)
        state.backoff = 0.0
        return state

    def _start(self, state: GroupState) -> None:
        if state.task is None or state.task.done():
            state.task = asyncio.create_task(
                self._run(state), name=f"reconcile {state.key[0]}/{state.key[1]}"
            )
        self._wake(state)

    def observed(self, key: GroupKey) -> list[planning.ObservedPod]:
        """The group's worker pods as the index shows them (for the health prober)."""
        return list(self._pods(key))

    def pods_changed(self, key: GroupKey) -> None:
        state = self.groups.get(key)
        if state is not None and state.group is not None:
            self._wake(state)

    def child_changed(self, key: GroupKey, plural: str, body: Mapping[str, Any], deleted: bool) -> None:
        """A watch event of an object labelled as the operator's (driver Deployment, Services, Secret,
        ConfigMap, NetworkPolicies, PDBs): when it is gone or a field the operator sets differs from what the
        builders produce, the group's loop repairs its children (compare, then recreate or apply)."""
        state = self.groups.get(key)
        group = None if state is None else state.group
        if state is None or group is None or not drift.owned_by(body, group.uid):
            return  # not a live group's (the group's own deletion takes its children), or not this group's
        if deleted:
            if plural == SECRETS.plural:
                state.lost_secret = dict(body.get("data") or {})
        elif plural == SECRETS.plural:
            return  # immutable: only its deletion is repaired
        else:
            # Compared with the current spec's manifest even while a pass for a new spec is due or running: that
            # pass may have applied this child already, before the edit, and would not look at it again.
            name = str(body.get("metadata", {}).get("name"))
            seen = drift.metadata_digest(body)
            if seen is not None and state.seen_in_sync.get((plural, name)) == seen:
                return  # the same spec and metadata as last time: a status update
            desired = self._desired_child(group, plural, name)
            if desired is None:
                return
            accepted = state.accepted_drift.get((plural, name))
            digest = desired["metadata"]["annotations"][labels.SPEC_HASH]
            if drift.in_sync(desired, body, accepted[1] if accepted and accepted[0] == digest else None):
                if seen is not None:
                    state.seen_in_sync[(plural, name)] = seen
                return
        log.info("%s/%s: %s %s %s; repairing", *key, plural, body.get("metadata", {}).get("name"),
                 "deleted" if deleted else "edited")  # fmt: skip
        state.repairs_due += 1
        self._wake(state)

    def _desired_child(self, group: builders.Group, plural: str, name: str) -> builders.Manifest | None:
        """The builders' manifest of one supporting object (built on demand: none is kept in memory)."""
        g, settings = group, self.settings
        build: dict[tuple[str, str], Callable[[], builders.Manifest]] = {
            (NETWORK_POLICIES.plural, network_policy_name(g.name)): lambda: builders.network_policy(
                g, settings
            ),
            (NETWORK_POLICIES.plural, driver_name(g.name)): lambda: builders.driver_network_policy(
                g, settings
            ),
            (CONFIG_MAPS.plural, config_map_name(g.name)): lambda: builders.config_map(g, settings),
            (SERVICES.plural, headless_service_name(g.name)): lambda: builders.headless_service(g),
            (SERVICES.plural, driver_name(g.name)): lambda: builders.driver_service(g),
            (SERVICES.plural, drivers_service_name(g.name)): lambda: builders.drivers_service(g),
            (DEPLOYMENTS.plural, driver_name(g.name)): lambda: builders.driver_deployment(g),
            (POD_DISRUPTION_BUDGETS.plural, pdb_name(g.name)): lambda: builders.pod_disruption_budget(g),
            (POD_DISRUPTION_BUDGETS.plural, driver_pdb_name(g.name)): lambda: (
                builders.driver_disruption_budget(g)
            ),
        }
        make = build.get((plural, name))
        return None if make is None else make()

    def _children_hash(self, state: GroupState, group: builders.Group) -> str:
        if state.hashed is None or state.hashed[0] is not group:
            digest = stable_hash(
                {
                    "spec": group.spec.to_manifest(),
                    "uid": group.uid,
                    "settings": repr(self.settings),
                    "keys": group.keys,
                }
            )
            state.hashed = (group, digest)
        return state.hashed[1]

    def _support_children(self, group: builders.Group) -> list[tuple[Resource, builders.Manifest]]:
        return [
            (NETWORK_POLICIES, builders.network_policy(group, self.settings)),
            (NETWORK_POLICIES, builders.driver_network_policy(group, self.settings)),
            (CONFIG_MAPS, builders.config_map(group, self.settings)),
            (SERVICES, builders.headless_service(group)),
            (SERVICES, builders.driver_service(group)),
            (SERVICES, builders.drivers_service(group)),
            (DEPLOYMENTS, builders.driver_deployment(group)),
            (POD_DISRUPTION_BUDGETS, builders.pod_disruption_budget(group)),
            (POD_DISRUPTION_BUDGETS, builders.driver_disruption_budget(group)),
        ]

    def forget(self, key: GroupKey) -> None:
        state = self.groups.pop(key, None)
        metrics.group_gone(*key)
        if state is not None and state.task is not None:
            state.task.cancel()

    async def close(self) -> None:
        tasks = [s.task for s in self.groups.values() if s.task is not None]
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        if self._http is not None:
            await self._http.close()
        await self.kube.close()

    def http(self) -> aiohttp.ClientSession:
        """The session for calls to the groups' drivers (draining replicas before a scale-down): a pool of its
        own without a connection limit (pod_http.session), so a large scale-down's drains never queue."""
        if self._http is None or self._http.closed:
            self._http = pod_http.session()
        return self._http

    # ------------------------------------------------------------------ the loop

    def _wake(self, state: GroupState) -> None:
        state.trigger.set()

    def _wake_later(self, state: GroupState, delay: float) -> None:
        asyncio.get_running_loop().call_later(delay, state.trigger.set)

    async def _run(self, state: GroupState) -> None:
        while True:
            await state.trigger.wait()
            await asyncio.sleep(DEBOUNCE_SECONDS)
            state.trigger.clear()
            if state.group is None and state.invalid is None:
                continue
            try:
                with metrics.reconcile("reconcile"):
                    recheck = await (
                        self.reconcile(state) if state.invalid is None else self._mark_invalid(state)
                    )
            except asyncio.CancelledError:
                raise
            except Exception as error:  # a retry with backoff, never a crash of the operator
                if isinstance(error, ApiError) and error.namespace_terminating:
                    # The namespace goes, the group with it: no retries, no Events (they would be refused).
                    log.info("%s/%s: its namespace is being deleted; nothing more is created", *state.key)
                    state.group = state.invalid = None  # a later spec update would try once more
                    continue
                state.backoff = min(max(state.backoff * 2, MIN_BACKOFF_SECONDS), MAX_BACKOFF_SECONDS)
                log.warning("reconcile %s/%s failed (retry in %.0fs): %r", *state.key, state.backoff, error)
                self._wake_later(state, state.backoff)
                continue
            state.backoff = 0.0
            if recheck is not None:
                self._wake_later(state, recheck)

    async def reconcile(self, state: GroupState) -> float | None:
        """One pass; returns seconds until a recheck is needed (pending expectations), or None.

        Order: the Secret the pods mount, the pods (the critical path: scheduling, image pull, model load),
        the status users watch, then Events and what no pod needs to start (driver, Services, NetworkPolicy,
        PDB, ConfigMap).
        The client's request scheduler keeps the same order across all groups.
        """
        assert state.group is not None
        # A group no operator has reconciled yet has no children: create them without looking first.
        fresh = not state.current_status.get("observedGeneration") and not state.children_attempted
        failure: str | None = None
        keys_due = state.keys is None or state.keys[0] != _rotation(state.body)
        if keys_due:
            # The keys the pods mount (and whose hash they carry) come first: read once, or made anew.
            try:
                await self._ensure_secret(state, state.group, fresh)
            except ReconcileRefused as error:
                failure = str(error)  # pods would mount keys that are not the group's: create none
        if state.keys is not None and state.group.keys != state.keys[1]:
            state.group = dataclasses.replace(state.group, keys=state.keys[1])  # a new spec, the keys known
        group = state.group
        children_hash = self._children_hash(state, group)
        # Unchanged spec and no child deleted or edited: no child is even looked at.
        repairs = state.repairs_due
        children_due = state.children_hash != children_hash or repairs != state.repairs_done
        state.children_attempted = state.children_attempted or children_due
        desired = planning.Desired(
            replicas=group.spec.replicas,
            world_size=group.spec.world_size,
            revision=builders.revision(group, self.settings),
            max_unavailable=group.spec.rollout.max_unavailable,
            max_surge=group.spec.rollout.max_surge,
            whole_replicas=group.spec.health.restart_policy == "Replica",
        )
        gang_served = await self._gang_served() if group.spec.gang_enabled else False
        force_recheck = await self._force_delete_overdue(state, group)
        pods = self._observed_pods(state, desired)
        pod_groups = self._observed_pod_groups(state, desired.world_size)
        replacing = planning.replacing_replicas(pod_groups) if gang_served else frozenset()
        plan = planning.plan_pods(desired, pods, replacing)
        loose = (
            planning.loose_replicas(self._pods(state.key), desired.revision) if gang_served else frozenset()
        )
        gang_plan = planning.plan_gang(desired, gang_served, pod_groups, plan, loose)
        done: list[tuple[str, str]] = []  # (reason, message) of Events, posted after the status
        await self._undrain_kept(state, group, plan.extent)
        # New pods mount the Secret and must be fenced by the NetworkPolicies: before creating any, a group
        # that is not new looks at those too, in case their deletion has not reached the watch yet.
        if failure is None and (children_due or (plan.create and not fresh)):
            try:
                if not keys_due:
                    await self._ensure_secret(state, group, fresh)
                await self._ensure_network_policy(state, group, fresh)
                if gang_served:
                    await self._ensure_workload(group, fresh)
            except ReconcileRefused as error:
                # Pods would mount keys that are not the group's, or be reachable unfenced: create none.
                failure = str(error)
        if failure is None and not (plan.empty and gang_plan.empty):
            if not await self._drain_leaving(state, group, plan):
                return 0.0  # the spec changed while the driver drained: plan again with the new one
            failure = await self._apply_plan(state, group, plan, gang_plan, done)
            pods = self._observed_pods(state, desired)
            pod_groups = self._observed_pod_groups(state, desired.world_size)
            replacing = planning.replacing_replicas(pod_groups) if gang_served else frozenset()
            plan = planning.plan_pods(desired, pods, replacing)
        if not gang_served and gang_plan.delete:
            # Gang placement turned off: the Workload goes with the PodGroups (they wait for their pods).
            await self.kube.delete(WORKLOADS, group.namespace, builders.workload_name(group.name))
        gang = status.Gang(gang_served, tuple(pod_groups)) if group.spec.gang_enabled else None
        if group.spec.gang_enabled and not gang_served:
            done.append(("GangSchedulingUnavailable", status.GANG_NOT_SERVED))

        def current_status() -> status.Status:
            # Supporting objects refused before are not applied until this pass retries them: the status
            # written first says so, instead of flipping to applied and back.
            refused = failure or (state.support_refused if children_due else None)
            return status.group_status(
                group.name,
                group.generation,
                desired,
                pods,
                plan,
                state.current_status,
                now_rfc3339(),
                refused,
                group.spec.scheduling.scheduler_name,
                self.scheduling_timeout,
                gang,
                None if self._drivers is None else list(self._drivers(state.key)),
            )

        await self._write_status(state, current_status())
        for reason, message in done:
            if reason == "GangSchedulingUnavailable":  # said once, not on every pass
                await self._event(state, "Warning", reason, message)
            else:
                await self._event(state, "Normal", reason, message, once=False)
        if children_due and not failure:
            try:
                async with self._support_slots:
                    await self._ensure_support(state, group, fresh)
                state.children_hash = children_hash
                state.repairs_done = repairs
                if state.support_refused is not None:
                    state.support_refused = None
                    await self._write_status(state, current_status())
            except ReconcileRefused as error:
                failure = state.support_refused = str(error)
                await self._write_status(state, current_status())
        await self._report_unschedulable(state, pods)
        if failure is not None:
            await self._event(state, "Warning", "ReconcileFailed", failure)
            raise ReconcileRefused(failure)
        state.posted.pop("ReconcileFailed", None)
        rechecks = [status.scheduling_recheck(pods, now_rfc3339(), self.scheduling_timeout), force_recheck]
        if state.expected_present or state.expected_gone:
            rechecks.append(EXPECTATION_SECONDS)
        if group.spec.gang_enabled and not gang_served:
            rechecks.append(self.gang_api_recheck)  # the API may be enabled meanwhile
        return min((r for r in rechecks if r is not None), default=None)

    async def _force_delete_overdue(self, state: GroupState, group: builders.Group) -> float | None:
        """Deletes with grace period 0 the worker pods FORCE_DELETE_AFTER_SECONDS past their deletion deadline
        (a Warning `ForceDeletedPods` names them and their nodes); returns the seconds until the next
        terminating pod would be overdue."""
        pods = list(self._pods(state.key))
        clock = time.monotonic()
        indexed = {p.uid for p in pods}
        for uid, until in list(state.force_deleted.items()):
            if uid not in indexed or until < clock:
                del state.force_deleted[uid]
        overdue, recheck = planning.overdue_deletions(pods, time.time(), FORCE_DELETE_AFTER_SECONDS)
        overdue = [p for p in overdue if p.uid not in state.force_deleted]  # deleted: the watch lags
        if not overdue:
            return recheck
        results = await gather_limited(
            WRITE_CONCURRENCY,
            *(self.kube.delete(PODS, group.namespace, p.name, p.uid, grace_seconds=0) for p in overdue),
        )
        deadline = time.monotonic() + EXPECTATION_SECONDS
        for pod, result in zip(overdue, results, strict=True):
            if isinstance(result, BaseException):
                raise result
            state.force_deleted[pod.uid] = deadline
        named = ", ".join(f"{p.name} (node {p.node or 'none'})" for p in overdue)
        await self._event(
            state,
            "Warning",
            "ForceDeletedPods",
            f"{named}: still there {FORCE_DELETE_AFTER_SECONDS:.0f}s after their deletion deadline, so no "
            "kubelet is acting for them (a node off or cut off); deleted with grace period 0, their "
            "replacements fenced from them by incarnation",
            once=False,
        )
        return recheck

    async def _mark_invalid(self, state: GroupState) -> None:
        assert state.invalid is not None
        desired = status.invalid_spec_status(
            state.key[1], state.generation, state.invalid, state.current_status, now_rfc3339()
        )
        await self._write_status(state, desired)
        await self._event(state, "Warning", "SpecInvalid", state.invalid)

    # ------------------------------------------------------------------ observed state

    def _observed_pods(self, state: GroupState, desired: planning.Desired) -> list[planning.ObservedPod]:
        """The index's pods, corrected by what this operator just did and the watch has not shown yet."""
        result = _expected(list(self._pods(state.key)), state.expected_present, state.expected_gone)
        for name in state.expected_present:
            replica, rank = _replica_rank(name)
            result.append(
                planning.ObservedPod(
                    name=name,
                    group=state.key[1],
                    replica=replica,
                    rank=rank,
                    revision=desired.revision,
                    epoch=state.pod_epochs.get(name, 0),
                )
            )
        return result

    def _observed_pod_groups(self, state: GroupState, world_size: int) -> list[planning.ObservedPodGroup]:
        """The index's PodGroups, corrected by what this operator just created or deleted."""
        result = _expected(list(self._pod_groups(state.key)), state.pod_groups_made, state.pod_groups_gone)
        for name in state.pod_groups_made:
            replica = int(name.rsplit("-r", 1)[1])
            result.append(
                planning.ObservedPodGroup(
                    name=name, group=state.key[1], replica=replica, min_count=world_size
                )
            )
        return result

    async def _gang_served(self) -> bool:
        """Whether the cluster serves Workloads and PodGroups: discovery, asked once while served and again
        every `gang_api_recheck` seconds while not. When it becomes served, `on_gang_api_served` runs once
        before any PodGroup is created (the PodGroup index must watch them)."""
        served = await self.kube.served(WORKLOADS, self.gang_api_recheck) and await self.kube.served(
            POD_GROUPS, self.gang_api_recheck
        )
        if served and self._gang_api_served is False:
            log.info("the cluster serves gang placement (scheduling.k8s.io/v1beta1) now: used from here on")
            if self.on_gang_api_served is not None:
                self._gang_api_ready = asyncio.ensure_future(self.on_gang_api_served())
        self._gang_api_served = served
        ready = self._gang_api_ready
        if served and ready is not None:
            try:
                await asyncio.shield(ready)  # every group waits for it, not only the one that saw it first
            except Exception:
                if self._gang_api_ready is ready:
                    self._gang_api_served = False  # asked again on the next pass (this one retries)
                    self._gang_api_ready = None
                raise
        return served

    async def delete_unhealthy(self, state: GroupState, pods: Iterable[planning.ObservedPod]) -> None:
        """The health prober's replacement: `pods` deleted with grace period 0, all counted as going before the
        first is deleted, so a pass that runs between the deletions neither takes a rank still listed for one of
        a replica that stays (it would create the lost rank again under the old replica epoch, which the fence
        is for) nor creates a rank beside them."""
        group = state.group
        if group is None:
            return
        pods = list(pods)
        deadline = time.monotonic() + EXPECTATION_SECONDS
        for pod in pods:
            if pod.uid:
                state.expected_gone[pod.uid] = deadline
        for pod in pods:
            await self.kube.delete(PODS, group.namespace, pod.name, pod.uid, grace_seconds=0)

    async def retire_pod_group(self, state: GroupState, replica: int) -> None:
        """Before a whole replica is replaced (health restart policy Replica): its PodGroup goes first, which
        marks the replica as being replaced until its pods are gone (see planning), restarts included."""
        group = state.group
        if group is None:
            return
        for pod_group in self._observed_pod_groups(state, group.spec.world_size):
            if pod_group.replica == replica and not pod_group.terminating:
                await self._delete_pod_group(state, group, pod_group)

    async def _delete_pod_group(
        self, state: GroupState, group: builders.Group, pod_group: planning.ObservedPodGroup
    ) -> None:
        await self.kube.delete(POD_GROUPS, group.namespace, pod_group.name, pod_group.uid or None)
        state.pod_groups_made.pop(pod_group.name, None)
        if pod_group.uid:
            state.pod_groups_gone[pod_group.uid] = time.monotonic() + EXPECTATION_SECONDS

    # ------------------------------------------------------------------ writes

    async def _apply_plan(
        self,
        state: GroupState,
        group: builders.Group,
        plan: planning.PodPlan,
        gang: planning.GangPlan,
        done: list[tuple[str, str]],
    ) -> str | None:
        """Delete and create PodGroups and pods; what was done is appended to `done` as (Event reason, message).

        Order: PodGroups of replicas that go (before their pods: a PodGroup being deleted marks its replica as
        being replaced), pods, then new PodGroups before the pods that name them."""
        namespace = group.namespace
        for pod_group in gang.delete:
            await self._delete_pod_group(state, group, pod_group)
        deletions = await gather_limited(
            WRITE_CONCURRENCY, *(self.kube.delete(PODS, namespace, pod.name, pod.uid) for pod in plan.delete)
        )
        deadline = time.monotonic() + EXPECTATION_SECONDS
        for pod, result in zip(plan.delete, deletions, strict=True):
            if isinstance(result, BaseException):
                raise result
            state.expected_gone[pod.uid] = deadline
        if plan.scale_down:
            done.append(("ScaledDown", f"removing replicas {_ranges(plan.scale_down)}"))
        if plan.torn_down:
            metrics.pod_replaced("rank_lost", sum(1 for p in plan.delete if p.replica in plan.torn_down))
            done.append(
                ("TearingDownReplicas", f"replicas {_ranges(plan.torn_down)} lost a rank: the rest go too")
            )
        if rolled := [r for r in plan.replace if r not in plan.torn_down]:
            metrics.pod_replaced("rollout", sum(1 for p in plan.delete if p.replica in rolled))
            done.append(("ReplacingReplicas", f"replacing replicas {_ranges(rolled)}"))

        failure = await self._create_pod_groups(state, group, gang.create)
        todo = [(replica, rank) for replica, rank in plan.create if replica not in gang.held]
        if failure is not None:  # no pod without its PodGroup
            made = {
                g.replica
                for g in self._observed_pod_groups(state, group.spec.world_size)
                if not g.terminating
            }
            todo = [(replica, rank) for replica, rank in todo if replica in made]
        created, pod_failure = await self._create_pods(state, group, todo, gang.active, gang.loose)
        failure = failure or pod_failure
        if created:
            metrics.pod_created("reconcile", len(created))
            replicas = sorted({replica for replica, _ in created})
            done.append(("CreatedPods", f"created {len(created)} pod(s) for replicas {_ranges(replicas)}"))
        return failure

    async def _drain_leaving(self, state: GroupState, group: builders.Group, plan: planning.PodPlan) -> bool:
        """Before a scale-down deletes pods (whoever lowered spec.replicas, or a rollout's surge ending) and
        before a rollout replaces a replica, every driver that runs stops sending batches to those replicas
        and finishes the ones in flight, for at most rollout.drainTimeoutSeconds. Returns False when the group's
        spec changed meanwhile (the plan is stale; the rolled replicas serve again until it is made anew)."""
        leaving = [r for r in plan.scale_down if r not in state.drained]
        rolled = [r for r in plan.rolled if r not in leaving]
        timeout = group.spec.rollout.drain_timeout_seconds
        if not (leaving or rolled) or timeout == 0:
            return True
        started = time.monotonic()
        draining = sorted([*leaving, *rolled])
        try:
            drivers = await drain_group_replicas(
                self.kube, self.http(), group.namespace, group.name, group.spec.driver.port, draining, timeout
            )
            seconds = time.monotonic() - started
            where = "the driver" if len(drivers) == 1 else f"{len(drivers)} drivers"
            # Said at once, not with the pass's other Events after the status: a step after it that fails
            # (a pod deletion, the status write) retries the pass, which finds these pods going and drains
            # nothing, so the drain would never be told.
            await self._event(
                state,
                "Normal",
                "DrainedReplicas",
                f"drained replicas {_ranges(draining)} in {where} in {seconds:.1f}s",
                once=False,
            )
        except NoRunningDriver:
            pass  # no driver routes anything to them
        except (DrainError, ApiError, aiohttp.ClientError, TimeoutError) as error:
            await self._event(
                state,
                "Warning",
                "DrainFailed",
                f"replicas {_ranges(draining)} not drained ({error}); removing them anyway",
                once=False,
            )
        state.drained.update(leaving)
        if state.group is group:
            return True
        if rolled:
            state.drained.update(rolled)  # the new plan may keep them: undrained unless it replaces them
        return False

    async def _undrain_kept(self, state: GroupState, group: builders.Group, extent: int) -> None:
        """Replicas drained for a scale-down (or a rollout) that was undone before their pods went serve again.
        `extent`: the replica indices the plan keeps (spec.replicas, and a rollout's surge)."""
        kept = sorted(r for r in state.drained if r < extent)
        if not kept:
            return
        state.drained.difference_update(kept)
        try:
            await drain_group_replicas(
                self.kube,
                self.http(),
                group.namespace,
                group.name,
                group.spec.driver.port,
                kept,
                10,
                undrain=True,
            )
        except NoRunningDriver:
            pass  # a new driver starts with nothing drained
        except (DrainError, ApiError, aiohttp.ClientError, TimeoutError) as error:
            log.warning("%s/%s: replicas %s not undrained: %s", *state.key, _ranges(kept), error)

    async def _create_pod_groups(
        self, state: GroupState, group: builders.Group, replicas: Iterable[int]
    ) -> str | None:
        manifests = [builders.pod_group(group, replica) for replica in replicas]
        results = await gather_limited(
            WRITE_CONCURRENCY, *(self.kube.create(POD_GROUPS, group.namespace, m) for m in manifests)
        )
        deadline = time.monotonic() + EXPECTATION_SECONDS
        for manifest, result in zip(manifests, results, strict=True):
            name = manifest["metadata"]["name"]
            if isinstance(result, ApiError) and result.status == 409:
                continue  # it exists: the index will show it
            if isinstance(result, ApiError) and result.refusal:
                return f"PodGroup {name}: {result.message}"
            if isinstance(result, BaseException):
                raise result
            state.pod_groups_made[name] = deadline
        return None

    def _highest_incarnations(self, state: GroupState) -> dict[tuple[int, int], int]:
        """The highest incarnation the index shows for each rank (replica, rank)."""
        highest: dict[tuple[int, int], int] = {}
        for p in self._pods(state.key):
            highest[(p.replica, p.rank)] = max(highest.get((p.replica, p.rank), 0), p.incarnation)
        return highest

    def _next_incarnation(
        self, state: GroupState, replica: int, rank: int, indexed: dict[tuple[int, int], int] | None = None
    ) -> int:
        """A number above every earlier pod's of this rank, that this operator made or its index shows (a
        restarted operator, or another leader, learns them from the pods; `indexed`: `_highest_incarnations`,
        computed once for a batch): the clock in nanoseconds, unless a clock set back would go below one of
        those."""
        seen = (indexed if indexed is not None else self._highest_incarnations(state)).get((replica, rank), 0)
        floor = max(state.incarnations.get((replica, rank), 0), seen)
        incarnation = max(time.time_ns(), floor + 1)
        state.incarnations[(replica, rank)] = incarnation
        return incarnation

    def _replica_epochs(self, state: GroupState, replicas: set[int]) -> dict[int, int]:
        """The epoch each of `replicas`' new pods joins: the one of the replica's pods that are not going away (the
        ranks this pod makes a replica with, made in an earlier pass or by another leader), else a new creation of
        the replica, numbered above every epoch this operator made or its index shows for it (as incarnations)."""
        pods = _expected(list(self._pods(state.key)), state.expected_present, state.expected_gone)
        live: dict[int, int] = {}
        seen: dict[int, int] = {}
        for p in pods:
            seen[p.replica] = max(seen.get(p.replica, 0), p.epoch)
            # Epoch 0 counts too: a pod an operator of an earlier version made, whose peers meet without one.
            if not p.terminating:
                live[p.replica] = max(live.get(p.replica, 0), p.epoch)
        for name in state.expected_present:  # created, not shown by the watch yet
            replica, _ = _replica_rank(name)
            live[replica] = max(live.get(replica, 0), state.pod_epochs.get(name, 0))
        result: dict[int, int] = {}
        for replica in replicas:
            if replica in live:
                result[replica] = live[replica]
                continue
            floor = max(seen.get(replica, 0), state.epochs.get(replica, 0))
            result[replica] = state.epochs[replica] = max(time.time_ns(), floor + 1)
        return result

    async def _create_pods(
        self,
        state: GroupState,
        group: builders.Group,
        todo: list[tuple[int, int]],
        gang: bool = False,
        loose: frozenset[int] = frozenset(),
    ) -> tuple[list[tuple[int, int]], str | None]:
        """Create in slow-start waves: one replica's ranks (useless without each other), then twice as many
        each wave. A refused pod stops the rest without a storm of errors."""
        created: list[tuple[int, int]] = []
        wave = group.spec.world_size
        indexed = self._highest_incarnations(state)
        epochs = self._replica_epochs(state, {replica for replica, _ in todo})
        while todo:
            batch, todo = todo[:wave], todo[wave:]
            # Nodes where a worker reported a device fault (the prober keeps them in the status): kept off.
            avoided = [
                e["node"] for e in current_avoided(state.current_status.get("avoidedNodes"), now_rfc3339())
            ]
            manifests = [
                avoid_nodes(
                    builders.worker_pod(
                        group,
                        replica,
                        rank,
                        self.settings,
                        builders.pod_group_name(group.name, replica)
                        if gang and replica not in loose
                        else None,
                        self._next_incarnation(state, replica, rank, indexed),
                        epochs[replica],
                    ),
                    avoided,
                )
                for replica, rank in batch
            ]
            results = await gather_limited(
                WRITE_CONCURRENCY, *(self.kube.create(PODS, group.namespace, m) for m in manifests)
            )
            deadline = time.monotonic() + EXPECTATION_SECONDS
            refused: str | None = None
            failed: BaseException | None = None
            # Every pod made is recorded before a refusal or an error ends the batch: the next pass must see it
            # (its rank's peers take its replica epoch) even while the watch lags.
            for (replica, rank), manifest, result in zip(batch, manifests, results, strict=True):
                if isinstance(result, ApiError) and result.status == 409:
                    continue  # it exists: the index will show it
                if isinstance(result, ApiError) and result.refusal:
                    refused = (
                        refused or f"pod {manifest['metadata']['name']}: {name_group_fields(result.message)}"
                    )
                    continue
                if isinstance(result, BaseException):
                    failed = failed or result
                    continue
                state.expected_present[manifest["metadata"]["name"]] = deadline
                state.pod_epochs[manifest["metadata"]["name"]] = epochs[replica]
                created.append((replica, rank))
            if refused is not None:
                return created, refused
            if failed is not None:
                raise failed
            wave *= 2
        return created, None

    async def _ensure_support(self, state: GroupState, group: builders.Group, fresh: bool) -> None:
        """ConfigMap, Services, driver Deployment, PDB: create, or apply what differs."""
        children = [(r, m) for r, m in self._support_children(group) if r is not NETWORK_POLICIES]
        results = await gather_limited(
            WRITE_CONCURRENCY,
            *(self._ensure_child(state, group, resource, m, fresh) for resource, m in children),
        )
        for result in results:
            if isinstance(result, BaseException):
                raise result

    async def _ensure_network_policy(self, state: GroupState, group: builders.Group, fresh: bool) -> None:
        """The workers' and the driver's NetworkPolicies, ahead of the pods they fence."""
        for resource, manifest in self._support_children(group):
            if resource is not NETWORK_POLICIES:
                continue
            try:
                await self._ensure_child(state, group, NETWORK_POLICIES, manifest, fresh)
            except ApiError as error:
                if error.refusal:
                    raise _refused("NetworkPolicy", manifest["metadata"]["name"], error) from error
                raise

    async def _ensure_workload(self, group: builders.Group, fresh: bool) -> None:
        """The group's Workload; its pod-group templates are fixed after creation, so a different one (another
        world size) is deleted and created again rather than patched."""
        manifest = builders.workload(group)
        name = manifest["metadata"]["name"]
        try:
            current = None if fresh else await self.kube.get(WORKLOADS, group.namespace, name)
            if current is not None:
                _check_owner(current, group, "Workload")
                have = (current.get("metadata", {}).get("annotations") or {}).get(labels.SPEC_HASH)
                if have == manifest["metadata"]["annotations"][labels.SPEC_HASH]:
                    return
                await self.kube.delete(WORKLOADS, group.namespace, name, current["metadata"].get("uid"))
            await self.kube.create(WORKLOADS, group.namespace, manifest)
        except ApiError as error:
            if error.refusal and error.status != 409:
                raise _refused("Workload", name, error) from error
            raise

    async def _ensure_secret(self, state: GroupState, group: builders.Group, fresh: bool) -> None:
        """The driver's and the workers' CURVE keypairs and the admin token, made once per `rotate-keys` value
        of the group. A Secret deleted by hand comes back with the data it had (the watch showed it), so running
        pods and new ones keep their keys; one in the one-keypair form of earlier versions, or made for another
        `rotate-keys` value, is replaced by new keys (delete, then create: it is immutable). Its public keys'
        hash goes on the group (`state.keys`), so pods built from then on carry it and a change rolls them."""
        name = secret_name(group.name)
        rotation = _rotation(state.body)
        current = None if fresh else await self.kube.get(SECRETS, group.namespace, name)
        if current is None and not fresh and state.keys is not None:
            # Gone, but this operator knew its keys: deleted by hand, and the watch's event (the data to put
            # back) may not have come yet (this pass may have been woken by another child's deletion). Waiting
            # a little for it keeps the keys, instead of new ones that would roll every pod.
            for _ in range(int(SECRET_EVENT_WAIT_SECONDS / 0.1)):
                if state.lost_secret is not None:
                    break
                await asyncio.sleep(0.1)
        replaced = False  # deleted here for new keys: its data is never put back
        for _ in range(2):  # a create that finds one (409) looks at it as if it had been read first
            if current is not None:
                _check_owner(current, group, "Secret")
                if builders.secret_is_current(current, rotation):
                    break
                log.info("%s/%s: new CURVE keys (%s); the pods roll", *state.key,
                         "rotate-keys" if rotation else "one keypair for driver and workers before")  # fmt: skip
                await self.kube.delete(SECRETS, group.namespace, name, current["metadata"].get("uid"))
                replaced = True
            driver, worker = zmq.curve_keypair(), zmq.curve_keypair()
            manifest = builders.curve_secret(group, driver, worker, secrets.token_urlsafe(32), rotation)
            # A Secret deleted by someone else comes back as it was; the watch's event of this pass's own
            # deletion (it may arrive before the create) must not put the old keys back under the new value.
            lost = None if replaced else state.lost_secret
            if (
                lost
                and set(lost) >= set(manifest["data"])
                and state.keys
                and state.keys[0] == rotation
                and builders.keys_digest(dict(lost)) == state.keys[1]
            ):
                manifest["data"] = {key: lost[key] for key in manifest["data"]}
            try:
                await self.kube.create(SECRETS, group.namespace, manifest)
            except ApiError as error:
                if error.status != 409:
                    if error.refusal:
                        raise _refused("Secret", name, error) from error
                    raise
                current = await self.kube.get(SECRETS, group.namespace, name)
                continue
            state.lost_secret = None
            current = manifest
            break
        if current is None:
            return  # deleted meanwhile: the watch shows it, the next pass makes it
        digest = builders.keys_digest(dict(current.get("data") or {}))
        changed = state.keys is not None and state.keys[1] != digest
        state.keys = (rotation, digest)
        if changed:
            self._wake(state)  # pods of this pass were planned with the keys before

    async def _ensure_child(
        self,
        state: GroupState,
        group: builders.Group,
        resource: Resource,
        manifest: builders.Manifest,
        fresh: bool,
    ) -> None:
        """Create, or compare and apply; a fresh group's children are created without a lookup first."""
        name = manifest["metadata"]["name"]
        try:
            current = None if fresh else await self.kube.get(resource, group.namespace, name)
            if current is None:
                try:
                    await self.kube.create(resource, group.namespace, manifest)
                    return
                except ApiError as error:
                    if error.status != 409:
                        raise
                current = await self.kube.get(resource, group.namespace, name)
                if current is None:
                    return  # deleted meanwhile: the next spec change creates it
            _check_owner(current, group, resource.kind)
            digest = manifest["metadata"]["annotations"][labels.SPEC_HASH]
            accepted = state.accepted_drift.get((resource.plural, name))
            if drift.in_sync(manifest, current, accepted[1] if accepted and accepted[0] == digest else None):
                return
            try:
                result: Mapping[str, Any] | None = await self.kube.apply(
                    resource, group.namespace, name, manifest
                )
            except ApiError as error:
                if error.status != 422:
                    raise
                result = None  # merged with another manager's edit, the object is invalid (a port twice)
            if result is None or drift.accepted_after_apply(manifest, result) is not None:
                # Apply keeps what other field managers own (an edited port is theirs): put ours back by patch.
                patch = drift.repair_patch(manifest, result or current)
                result = await self.kube.patch(resource, group.namespace, name, patch)
            left = drift.accepted_after_apply(manifest, result)
            if left is None:
                state.accepted_drift.pop((resource.plural, name), None)
            else:
                # Another field manager's item in a list the operator sets: apply cannot remove it. Say so once,
                # and do not write the same state again.
                state.accepted_drift[(resource.plural, name)] = (digest, left)
                log.warning("%s %s/%s still differs from its manifest after an apply", resource.kind,
                            group.namespace, name)  # fmt: skip
        except ApiError as error:
            if error.refusal:
                raise _refused(resource.kind, name, error) from error
            raise

    async def _write_status(self, state: GroupState, desired: status.Status) -> None:
        """The reconciler's fields and conditions (status.reconciler_patch): the others' stay as they are."""
        now = now_rfc3339()
        written = await self.write_status(
            state, lambda current: status.reconciler_patch(current, desired, now)
        )
        if written and "phase" in desired:
            metrics.group_phase(*state.key, str(desired["phase"]))

    async def write_status(
        self, state: GroupState, change: Callable[[Mapping[str, Any]], Mapping[str, Any]]
    ) -> Mapping[str, Any] | None:
        """Read-modify-write of the group's status, for the reconciler and the supervisor alike: `change` gets
        the status as last read and returns the merge patch of its writer's own fields (empty: nothing to
        write). The patch is checked against the resourceVersion that status was read at, so a write computed
        from a status someone has changed since is refused (409) instead of putting back what they changed:
        the group is read again and `change` asked again. Returns the patch written (None: none, or the group
        is gone)."""
        namespace, name = state.key
        for attempt in range(STATUS_WRITE_ATTEMPTS):
            patch = change(state.current_status)
            if not patch:
                return None
            try:
                result = await self.kube.patch_status(
                    GROUPS, namespace, name, patch, resource_version=state.status_version
                )
            except ApiError as error:
                if error.status == 404:
                    return None
                if error.status != 409 or attempt == STATUS_WRITE_ATTEMPTS - 1:
                    raise
                found = await self.kube.list(GROUPS, namespace, "", field_selector=f"metadata.name={name}")
                if not found:
                    return None
                state.adopt(found[0])
                continue
            state.adopt(result)
            return patch
        return None

    async def _report_unschedulable(self, state: GroupState, pods: list[planning.ObservedPod]) -> None:
        """One Warning per distinct reason: the scheduler's refusal, or the condition's word that no scheduler
        picked the pods up."""
        stuck = sorted((p for p in pods if p.unschedulable and not p.terminating), key=lambda p: p.name)
        if stuck:
            await self._event(state, "Warning", "Unschedulable", f"{stuck[0].name}: {stuck[0].unschedulable}")
            return
        condition = status.previous_conditions(state.current_status).get(status.UNSCHEDULABLE) or {}
        if condition.get("reason") == "NotScheduled":
            await self._event(state, "Warning", "Unschedulable", str(condition.get("message")))
        else:
            state.posted.pop("Unschedulable", None)

    async def post_event(
        self, state: GroupState, kind: str, reason: str, message: str, once: bool = True
    ) -> None:
        """An Event on the group, for the supervisor (health prober, autoscaler)."""
        await self._event(state, kind, reason, message, once)

    async def _event(
        self, state: GroupState, kind: str, reason: str, message: str, once: bool = True
    ) -> None:
        """A Kubernetes Event on the group; with `once`, a repeated (reason, message) is not posted again."""
        if once and state.posted.get(reason) == message:
            return
        state.posted[reason] = message
        metadata = state.body.get("metadata", {})
        namespace, name = state.key
        stamp = now_rfc3339()
        event = {
            "apiVersion": "v1",
            "kind": "Event",
            "metadata": {"generateName": f"{name}.", "namespace": namespace},
            "involvedObject": {
                "apiVersion": api.API_VERSION,
                "kind": api.KIND,
                "name": name,
                "namespace": namespace,
                "uid": metadata.get("uid", ""),
            },
            "reason": reason,
            "message": message[:1024],
            "type": kind,
            "source": {"component": "iwg-operator"},
            "reportingComponent": "iwg-operator",
            "firstTimestamp": stamp,
            "lastTimestamp": stamp,
            "count": 1,
        }
        try:
            await self.kube.create(EVENTS, namespace, event)
        except ApiError as error:  # an event is worth a log line, not a failed reconcile
            if not error.namespace_terminating:
                log.warning("event %s on %s/%s not posted: %s", reason, namespace, name, error)


def _key(body: Mapping[str, Any]) -> GroupKey:
    metadata = body.get("metadata", {})
    return str(metadata.get("namespace")), str(metadata.get("name"))


def _rotation(body: Mapping[str, Any]) -> str:
    """The group's `rotate-keys` annotation: the keys it asks for ("": never rotated)."""
    return str((body.get("metadata", {}).get("annotations") or {}).get(labels.ROTATE_KEYS, ""))


def _generation(body: Mapping[str, Any]) -> int:
    return int(body.get("metadata", {}).get("generation") or 1)


def _resource_version(body: Mapping[str, Any]) -> str | None:
    version = body.get("metadata", {}).get("resourceVersion")
    return str(version) if version else None


def _older(version: str | None, than: str | None) -> bool:
    """Whether one resourceVersion of an object precedes another. They compare as integers (Kubernetes >= 1.35,
    KEP-5504: decimal, no leading zeros); a version that is not one is never called older."""
    if not version or not than or not version.isdigit() or not than.isdigit():
        return False
    return (len(version), version) < (len(than), than)


Observed = TypeVar("Observed", planning.ObservedPod, planning.ObservedPodGroup)


def _expected(indexed: list[Observed], present: dict[str, float], gone: dict[str, float]) -> list[Observed]:
    """Objects of an index, corrected by this operator's recent writes the watch has not shown yet: `present`
    (name -> deadline) and `gone` (uid -> deadline) drop what the index shows or what expired, and what is
    expected gone counts as terminating."""
    clock = time.monotonic()
    names = {item.name for item in indexed}
    for name, deadline in list(present.items()):
        if name in names or deadline < clock:
            del present[name]
    live_uids = {item.uid for item in indexed if not item.terminating}
    for uid, deadline in list(gone.items()):
        if uid not in live_uids or deadline < clock:
            del gone[uid]
    return [dataclasses.replace(item, terminating=True) if item.uid in gone else item for item in indexed]


def _replica_rank(pod_name: str) -> tuple[int, int]:
    replica_part, rank_part = pod_name.rsplit("-r", 1)[1].split("-w")
    return int(replica_part), int(rank_part)


def _check_owner(current: Mapping[str, Any], group: builders.Group, kind: str) -> None:
    owners = current.get("metadata", {}).get("ownerReferences") or []
    if not any(owner.get("uid") == group.uid for owner in owners):
        name = current.get("metadata", {}).get("name")
        raise ReconcileRefused(
            f"{kind} {name} exists and is not owned by this group; rename the group or remove it"
        )


def _refused(kind: str, name: str, error: ApiError) -> ReconcileRefused:
    return ReconcileRefused(f"{kind} {name}: {error.message}")


def _ranges(indices: Iterable[int]) -> str:
    ordered = sorted(set(indices))
    parts: list[str] = []
    start = previous = ordered[0] if ordered else 0
    for index in ordered[1:]:
        if index != previous + 1:
            parts.append(f"{start}" if start == previous else f"{start}-{previous}")
            start = index
        previous = index
    if ordered:
        parts.append(f"{start}" if start == previous else f"{start}-{previous}")
    return ",".join(parts)
