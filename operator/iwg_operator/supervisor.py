"""Per-group supervision beside the reconciler: the health prober and the autoscaler, one task per group.

The handlers start it for every accepted group and stop it when the group goes. It reads what the reconciler
knows (spec, pods from the index, the latest status) and acts only through deletes of failed pods, the
group's spec.replicas, its status counters, engine and conditions, and Events. Probes, scrapes and drains each
have their own connection pool (iwg_operator.pod_http), so none of them waits for another's connections.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import Mapping
from typing import Any

from iwg_operator import metrics, status
from iwg_operator.autoscaling.activation import ActivationWatch
from iwg_operator.autoscaling.policy import DriverSample
from iwg_operator.autoscaling.scaler import GroupScaler, ScaleDecision
from iwg_operator.controller import Controller, GroupKey, GroupState, now_rfc3339
from iwg_operator.driver_admin import DriverPod, admin_token, drain_in_drivers, driver_addresses
from iwg_operator.health.policy import avoid_after_fault, current_avoided
from iwg_operator.health.prober import (
    RESTART_BUDGET_EXHAUSTED,
    GroupProber,
    describe,
    restarts_from_status,
)
from iwg_operator.kube import GROUPS
from iwg_operator.pod_http import PodClients

log = logging.getLogger("iwg_operator.supervisor")

SCALING_ACTIVE = "ScalingActive"
ENV_AUTOSCALE_INTERVAL = "IWG_AUTOSCALE_INTERVAL_S"
DEFAULT_AUTOSCALE_INTERVAL_S = 5.0


class Supervisor:
    def __init__(self, controller: Controller) -> None:
        self.controller = controller
        self.autoscale_interval = float(os.environ.get(ENV_AUTOSCALE_INTERVAL, DEFAULT_AUTOSCALE_INTERVAL_S))
        self._tasks: dict[GroupKey, asyncio.Task[None]] = {}
        self.clients = PodClients()

    def watch(self, key: GroupKey) -> None:
        task = self._tasks.get(key)
        if task is None or task.done():
            self._tasks[key] = asyncio.create_task(self._run(key), name=f"supervise {key[0]}/{key[1]}")

    def forget(self, key: GroupKey) -> None:
        task = self._tasks.pop(key, None)
        if task is not None:
            task.cancel()

    async def close(self) -> None:
        tasks = list(self._tasks.values())
        self._tasks.clear()
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        await self.clients.close()

    # ------------------------------------------------------------------ the loop

    async def _run(self, key: GroupKey) -> None:
        state = self.controller.groups.get(key)
        known = (state.current_status if state else {}) or {}
        # The restart budget and backoff go on where the previous operator left them (status.recentRestarts).
        prober = GroupProber(
            restart_count=int(known.get("restartCount") or 0),
            restarts=restarts_from_status(known.get("recentRestarts")),
        )
        scaler = GroupScaler()
        # At zero replicas: wakes the autoscaler as soon as a driver holds a request.
        watch = ActivationWatch()
        next_probe = next_scale = time.monotonic()
        try:
            while True:
                state = self.controller.groups.get(key)
                if state is None:
                    return
                now = time.monotonic()
                try:
                    if state.group is not None and now >= next_probe:
                        next_probe = now + state.group.spec.health.period_seconds
                        with metrics.reconcile("health"):
                            await self._probe(state, prober)
                    if state.group is not None and now >= next_scale:
                        next_scale = now + self.autoscale_interval
                        if state.group.spec.autoscaling.enabled:
                            with metrics.reconcile("autoscale"):
                                await self._autoscale(state, scaler, watch)
                        else:
                            watch.stop()
                except asyncio.CancelledError:
                    raise
                except Exception as error:  # never let one bad round end the supervision of a group
                    log.warning("supervising %s/%s: %s", *key, error)
                wait = max(0.05, min(next_probe, next_scale) - time.monotonic())
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(watch.woken.wait(), wait)
                if watch.woken.is_set():  # a driver holds a request: the autoscaler's round now
                    watch.woken.clear()
                    next_scale = time.monotonic()
        finally:
            watch.stop()

    # ------------------------------------------------------------------ health

    async def _probe(self, state: GroupState, prober: GroupProber) -> None:
        group = state.group
        assert group is not None
        spec = group.spec
        pods = self.controller.observed(state.key)
        result = await prober.round(self.clients.probes, pods, spec.health, spec.world_size)
        for replacement in result.replacements:
            message = describe(replacement, spec.world_size)
            log.info("%s/%s: %s", *state.key, message)
            if replacement.device_fault and replacement.failed_pod.node:
                node = replacement.failed_pod.node
                # In the status, not in memory: replacements made after an operator restart avoid it too.
                avoided = avoid_after_fault(state.current_status.get("avoidedNodes"), node, now_rfc3339())
                await self._write(state, {"avoidedNodes": avoided})
                await self.controller.post_event(
                    state,
                    "Warning",
                    "DeviceFault",
                    f"{replacement.failed_pod.name} reported a device fault on node {node}; "
                    f"replacements avoid {node}",
                    once=False,
                )
            if spec.health.restart_policy == "Replica":
                # Under gang placement the replica's PodGroup goes first and comes back with its new pods.
                await self.controller.retire_pod_group(state, replacement.failed_pod.replica)
            await self.controller.delete_unhealthy(state, replacement.pods)
            metrics.pod_replaced(
                "device_fault" if replacement.device_fault else "unhealthy", len(replacement.pods)
            )
            await self.controller.post_event(state, "Warning", "WorkerUnhealthy", message, once=False)
        if result.exhausted:
            await self.controller.post_event(state, "Warning", "RestartBudgetExhausted", result.exhausted)
        budget = status.condition(
            RESTART_BUDGET_EXHAUSTED,
            result.exhausted is not None,
            "RestartBudgetExhausted" if result.exhausted else "WithinBudget",
            result.exhausted or "replacements are within spec.health.maxRestarts",
            group.generation,
            status.previous_conditions(state.current_status),
            now_rfc3339(),
        )
        counted = int((state.current_status or {}).get("restartCount") or 0)
        fields: dict[str, Any] = (
            {"restartCount": prober.restart_count} if prober.restart_count != counted else {}
        )
        fields["engine"] = result.engine  # None removes it (a merge patch); written only when it changed
        # Written only when it changed: a replacement, or one leaving the window (an empty list stays absent).
        recent = prober.recent_restarts(spec.health.restart_window_seconds)
        if recent or state.current_status.get("recentRestarts"):
            fields["recentRestarts"] = recent
        listed = state.current_status.get("avoidedNodes") or []
        unexpired = current_avoided(listed, now_rfc3339())
        if len(unexpired) != len(listed):
            fields["avoidedNodes"] = unexpired  # expired entries leave the status
        await self._write(state, fields, budget, write_when_absent=False)

    # ------------------------------------------------------------------ autoscaling

    async def _autoscale(self, state: GroupState, scaler: GroupScaler, watch: ActivationWatch) -> None:
        group = state.group
        assert group is not None
        spec = group.spec
        current = spec.replicas
        drivers = await driver_addresses(self.controller.kube, group.namespace, group.name)
        sample, error = None, "no driver is ready"
        if drivers:
            try:
                sample = await scaler.scrape(self.clients.scrapes, drivers, spec.driver.port)
            except Exception as scrape_error:
                error = str(scrape_error)
        decision = scaler.decide(sample, error, current, spec.autoscaling)
        if decision.replicas is not None and decision.replicas != current:
            decision = await self._scale(state, decision, current, drivers)
        if (current if decision.replicas is None else decision.replicas) == 0:
            watch.track(self.clients.activations, drivers, spec.driver.port)
        else:
            watch.stop()
        metrics.autoscaler_decision(_direction(decision.replicas, current))
        activation = latest_activation(state.current_status, sample)
        before = status.previous_conditions(state.current_status)
        scaling = status.condition(
            SCALING_ACTIVE,
            decision.replicas is not None,
            decision.reason,
            decision.message,
            group.generation,
            before,
            now_rfc3339(),
        )
        await self._write(state, {"lastActivation": activation} if activation else {}, scaling)
        if activation:
            await self.controller.post_event(
                state,
                "Normal",
                "ActivatedFromZero",
                f"first answer {activation['seconds']:.2f} s after the first request held with no replica "
                f"serving (answered at {activation['at']}){_phases_text(activation.get('phases'))}",
                once=False,
            )

    async def _scale(
        self, state: GroupState, decision: ScaleDecision, current: int, drivers: list[DriverPod]
    ) -> ScaleDecision:
        group = state.group
        assert group is not None and decision.replicas is not None
        desired = decision.replicas
        if desired < current and not drivers:
            return ScaleDecision(
                None, "DrainFailed", f"holding at {current}: no ready driver to drain replicas"
            )
        if desired < current:
            try:
                # Every driver that runs, not only the ready ones read: each may route requests it holds.
                routing = await driver_addresses(
                    self.controller.kube, group.namespace, group.name, routing=True
                )
                token = await admin_token(self.controller.kube, group.namespace, group.name)
                await drain_in_drivers(
                    self.clients.drains,
                    routing,
                    group.spec.driver.port,
                    token,
                    range(desired, current),
                    group.spec.rollout.drain_timeout_seconds,
                )
            except Exception as error:
                return ScaleDecision(None, "DrainFailed", f"holding at {current}: drain failed: {error}")
        await self.controller.kube.scale(GROUPS, group.namespace, group.name, desired)
        if desired < current:
            # The reconciler's record: it does not drain them again, and undrains them when a scale-up keeps
            # their pods after all (the driver would otherwise hold their index drained until the pods went).
            state.drained.update(range(desired, current))
        counters = {
            "scaleCount": int((state.current_status or {}).get("scaleCount") or 0) + 1,
            "lastScaleTime": now_rfc3339(),
        }
        await self._write(state, counters)
        await self.controller.post_event(
            state,
            "Normal",
            decision.event,
            f"replicas {current} -> {desired}: {decision.message}",
            once=False,
        )
        return decision

    # ------------------------------------------------------------------ status

    async def _write(
        self,
        state: GroupState,
        fields: Mapping[str, Any],
        condition: dict[str, Any] | None = None,
        write_when_absent: bool = True,
    ) -> None:
        """Counters and one condition of ours, merged into the status as last read and written with its
        resourceVersion (Controller.write_status): a concurrent write by the reconciler is read again, never
        overwritten. Nothing is written when nothing changed; a False condition that was never True is left
        out unless asked.
        """

        def change(current: Mapping[str, Any]) -> dict[str, Any]:
            patch: dict[str, Any] = {k: v for k, v in fields.items() if current.get(k) != v}
            if condition is None:
                return patch
            existing = list(current.get("conditions") or [])
            old = next((c for c in existing if c.get("type") == condition["type"]), None)
            wanted = old is not None or write_when_absent or condition["status"] == "True"
            if wanted and (old is None or _differs(old, condition)):
                patch["conditions"] = status.set_conditions(
                    existing, [condition], {condition["type"]}, now_rfc3339()
                )
            return patch

        await self.controller.write_status(state, change)


# The parts of an activation as the drivers name them, and as status.lastActivation.phases does.
ACTIVATION_PHASES = {
    "pod_start": "podStart",
    "worker_start": "workerStart",
    "model_load": "modelLoad",
    "ready": "ready",
    "first_answer": "firstAnswer",
}


def _phases_text(phases: Mapping[str, float] | None) -> str:
    """The Event's words for lastActivation.phases: ": pod start 1.20 s, ..." (nothing without them)."""
    if not phases:
        return ""
    parts = [(p.replace("_", " "), phases[c]) for p, c in ACTIVATION_PHASES.items() if c in phases]
    return ": " + ", ".join(f"{name} {seconds:.2f} s" for name, seconds in parts)


def latest_activation(current: Mapping[str, Any], sample: DriverSample | None) -> dict[str, Any] | None:
    """status.lastActivation from the drivers' latest activation, when it is newer than the one written."""
    if sample is None or sample.last_activation is None:
        return None
    at, seconds = sample.last_activation
    when = status.rfc3339(at)
    known = (current.get("lastActivation") or {}).get("at")
    if known is not None and str(known) >= when:
        return None
    entry: dict[str, Any] = {"at": when, "seconds": round(seconds, 3)}
    phases = dict(sample.last_activation_phases)
    if all(phase in phases for phase in ACTIVATION_PHASES):
        entry["phases"] = {camel: round(phases[phase], 3) for phase, camel in ACTIVATION_PHASES.items()}
    return entry


def _differs(old: Mapping[str, Any], new: Mapping[str, Any]) -> bool:
    return any(old.get(k) != new.get(k) for k in ("status", "reason", "message", "observedGeneration"))


def _direction(desired: int | None, current: int) -> str:
    if desired is None or desired == current:
        return "hold"
    return "up" if desired > current else "down"
