"""The supervisor applies a health round: the pods the prober gave up on are deleted, an Event says why, and
iwg_operator_pods_replaced_total counts each deleted pod once under its reason (in process, no cluster)."""

from __future__ import annotations

from typing import Any

import pytest
from iwg_operator import builders, metrics
from iwg_operator.api import v1alpha1 as api
from iwg_operator.controller import GroupState
from iwg_operator.health.prober import Replacement, RoundResult
from iwg_operator.planning import ObservedPod
from iwg_operator.supervisor import Supervisor


class Controller:
    """What `Supervisor._probe` uses of the controller, recording what it was asked to do."""

    def __init__(self) -> None:
        self.deleted: list[str] = []
        self.events: list[tuple[str, str]] = []

    def observed(self, key: Any) -> list[ObservedPod]:
        return []

    async def retire_pod_group(self, state: GroupState, replica: int) -> None:
        pass

    async def delete_unhealthy(self, state: GroupState, pods: tuple[ObservedPod, ...]) -> None:
        self.deleted.extend(p.name for p in pods)

    async def post_event(
        self, state: GroupState, kind: str, reason: str, message: str, once: bool = True
    ) -> None:
        self.events.append((reason, message))


class Prober:
    restart_count = 1

    def __init__(self, result: RoundResult) -> None:
        self.result = result

    async def round(self, *args: Any) -> RoundResult:
        return self.result

    def recent_restarts(self, window: int) -> list[Any]:
        return []


def pod(replica: int, rank: int) -> ObservedPod:
    return ObservedPod(
        name=f"g-r{replica}-w{rank}", group="g", replica=replica, rank=rank, revision="r1", phase="Running",
        uid=f"u{replica}-{rank}", node="node-a",
    )  # fmt: skip


def replaced(reason: str) -> float:
    return metrics.REGISTRY.get_sample_value("iwg_operator_pods_replaced_total", {"reason": reason}) or 0.0


@pytest.mark.parametrize(("device_fault", "reason"), [(False, "unhealthy"), (True, "device_fault")])
async def test_each_replaced_pod_is_counted_once_under_its_reason(device_fault: bool, reason: str) -> None:
    controller = Controller()
    supervisor = Supervisor(controller)  # type: ignore[arg-type]

    async def write(*args: Any, **kwargs: Any) -> None:
        pass

    supervisor._write = write  # type: ignore[method-assign]
    body = {"model": {"task": "generate", "path": "/models/m"}, "worldSize": 2}
    group = builders.Group(name="g", namespace="ns", uid="uid-1", spec=api.parse_spec(body))
    state = GroupState(key=("ns", "g"), body={"status": {}}, group=group)
    ranks = (pod(0, 0), pod(0, 1))
    result = RoundResult(replacements=[Replacement(ranks, "no answer", ranks[1], device_fault)])
    before = {r: replaced(r) for r in ("unhealthy", "device_fault", "device-fault")}
    try:
        await supervisor._probe(state, Prober(result))  # type: ignore[arg-type]
    finally:
        await supervisor.close()
    assert controller.deleted == ["g-r0-w0", "g-r0-w1"]
    assert "WorkerUnhealthy" in [r for r, _ in controller.events]
    after = {r: replaced(r) for r in before}
    assert {r: after[r] - before[r] for r in before} == {
        "unhealthy": 0.0 if device_fault else 2.0,
        "device_fault": 2.0 if device_fault else 0.0,
        "device-fault": 0.0,
    }
