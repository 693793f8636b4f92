"""Two writers share a group's status (the reconciler and the supervisor), against the real API server: with
their writes forced to interleave, neither puts back what the other changed, and a watch that lags behind the
operator's own writes makes it write nothing again (issue 30 item 7, issue 24 item 1)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest
from iwg_operator import status
from iwg_operator.api import v1alpha1 as api
from iwg_operator.controller import Controller, GroupState, now_rfc3339
from iwg_operator.credentials import from_kubeconfig
from iwg_operator.kube import Connection, KubeApi
from iwg_operator.planning import Desired, ObservedPod, plan_pods
from iwg_operator.supervisor import SCALING_ACTIVE, Supervisor
from kubernetes import client

pytestmark = pytest.mark.cluster

DESIRED = Desired(replicas=1, world_size=1, revision="r1", max_unavailable=1)


class GatedKube(KubeApi):
    """The operator's client, except that a status write may be held until the test lets it go: the write
    was computed, and waits (in the real operator: for a connection, behind other requests) while the other
    writer's lands."""

    def __init__(self, connection: Connection) -> None:
        super().__init__(connection)
        self.gates: list[asyncio.Event] = []
        self.held = 0

    async def patch_status(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        if self.gates:
            gate = self.gates.pop(0)
            self.held += 1
            await gate.wait()
        return await super().patch_status(*args, **kwargs)

    async def hold_next(self) -> asyncio.Event:
        gate = asyncio.Event()
        self.gates.append(gate)
        return gate


def worker(ready: bool) -> ObservedPod:
    return ObservedPod(
        name="g-r0-w0", group="g", replica=0, rank=0, revision="r1", phase="Running", ready=ready, node="n",
        uid="u0",
    )  # fmt: skip


def reconciled(state: GroupState, ready: bool) -> status.Status:
    """The status a reconcile pass computes from what it knows (as Controller.reconcile does)."""
    pods = [worker(ready)]
    return status.group_status(
        "g", state.generation, DESIRED, pods, plan_pods(DESIRED, pods), state.current_status, now_rfc3339()
    )


def conditions_on_server(custom: client.CustomObjectsApi, namespace: str) -> dict[str, dict[str, Any]]:
    body = custom.get_namespaced_custom_object(api.GROUP, api.VERSION, namespace, api.PLURAL, "g")
    return {c["type"]: c for c in (body.get("status") or {}).get("conditions") or []}


@pytest.fixture
async def writers(
    iwg_crd: dict[str, Any], control_plane: Any, k8s: Any, namespace: str
) -> AsyncIterator[tuple[Controller, Supervisor, GatedKube, GroupState]]:
    """A group on the server, its state as the handlers would hold it, the reconciler and the supervisor."""
    custom = client.CustomObjectsApi(k8s)
    manifest = {
        "apiVersion": api.API_VERSION,
        "kind": api.KIND,
        "metadata": {"name": "g", "namespace": namespace},
        "spec": {"model": {"task": "embed", "path": "/models/m"}, "replicas": 1},
    }
    body = custom.create_namespaced_custom_object(api.GROUP, api.VERSION, namespace, api.PLURAL, manifest)
    kube = GatedKube(Connection.from_credentials(from_kubeconfig([control_plane.kubeconfig])))
    controller = Controller(kube)
    supervisor = Supervisor(controller)
    controller.observe_group(body)
    state = controller.groups[(namespace, "g")]
    try:
        yield controller, supervisor, kube, state
    finally:
        await supervisor.close()
        await controller.close()


async def until_held(kube: GatedKube, count: int) -> None:
    for _ in range(200):
        if kube.held >= count:
            return
        await asyncio.sleep(0.01)
    raise AssertionError("the held write never reached the client")


async def test_a_supervisor_write_computed_before_the_group_became_ready_cannot_put_ready_false_back(
    writers: tuple[Controller, Supervisor, GatedKube, GroupState], k8s: Any, namespace: str
) -> None:
    controller, supervisor, kube, state = writers
    await controller._write_status(state, reconciled(state, ready=False))
    assert conditions_on_server(client.CustomObjectsApi(k8s), namespace)["Ready"]["status"] == "False"

    # The autoscaler's round computes its condition from the status it knows (Ready False) ...
    gate = await kube.hold_next()
    before = status.previous_conditions(state.current_status)
    scaling = status.condition(
        SCALING_ACTIVE, False, "MetricsUnavailable", "no driver", 1, before, now_rfc3339()
    )
    autoscaler = asyncio.create_task(supervisor._write(state, {}, scaling))
    await until_held(kube, 1)
    # ... the pods turn ready and the reconciler's write lands first ...
    await controller._write_status(state, reconciled(state, ready=True))
    # ... then the autoscaler's.
    gate.set()
    await autoscaler

    on_server = conditions_on_server(client.CustomObjectsApi(k8s), namespace)
    assert on_server["Ready"]["status"] == "True", on_server
    assert on_server[SCALING_ACTIVE]["reason"] == "MetricsUnavailable", on_server
    assert state.current_status["conditions"] == list(on_server.values()), "the operator knows what it wrote"


async def test_a_reconciler_write_computed_before_the_supervisors_cannot_remove_its_condition(
    writers: tuple[Controller, Supervisor, GatedKube, GroupState], k8s: Any, namespace: str
) -> None:
    controller, supervisor, kube, state = writers
    await controller._write_status(state, reconciled(state, ready=False))

    # The reconciler computes a status from what it knows (no condition of the supervisor's yet) ...
    gate = await kube.hold_next()
    reconciler = asyncio.create_task(controller._write_status(state, reconciled(state, ready=True)))
    await until_held(kube, 1)
    # ... the health prober's budget runs out and its condition lands first ...
    before = status.previous_conditions(state.current_status)
    exhausted = status.condition(
        "RestartBudgetExhausted", True, "RestartBudgetExhausted", "2 replacements", 1, before, now_rfc3339()
    )
    await supervisor._write(state, {"restartCount": 2}, exhausted, write_when_absent=False)
    # ... then the reconciler's.
    gate.set()
    await reconciler

    custom = client.CustomObjectsApi(k8s)
    on_server = conditions_on_server(custom, namespace)
    assert on_server["Ready"]["status"] == "True", on_server
    assert on_server["RestartBudgetExhausted"]["status"] == "True", on_server
    body = custom.get_namespaced_custom_object(api.GROUP, api.VERSION, namespace, api.PLURAL, "g")
    assert body["status"]["restartCount"] == 2 and body["status"]["phase"] == "Running", body["status"]


async def test_a_watch_event_older_than_the_operators_own_write_causes_no_write(
    writers: tuple[Controller, Supervisor, GatedKube, GroupState], k8s: Any, namespace: str
) -> None:
    """At scale the watch delivers a group's events seconds late: the event of the operator's first write
    arrives after its second. A pass computed from that older status would write a third time (and move
    lastTransitionTime, though nothing changed)."""
    controller, supervisor, kube, state = writers
    custom = client.CustomObjectsApi(k8s)
    await controller._write_status(state, reconciled(state, ready=False))
    first = custom.get_namespaced_custom_object(api.GROUP, api.VERSION, namespace, api.PLURAL, "g")
    await controller._write_status(state, reconciled(state, ready=True))
    ready_since = conditions_on_server(custom, namespace)["Ready"]["lastTransitionTime"]
    writes = kube.requests.writes()

    controller.observe_group(first)  # the first write's event, delivered late
    await asyncio.sleep(1.1)  # a second later: a new lastTransitionTime would show
    await controller._write_status(state, reconciled(state, ready=True))
    scaling = status.condition(
        SCALING_ACTIVE,
        False,
        "MetricsUnavailable",
        "no driver",
        1,
        status.previous_conditions(None),
        now_rfc3339(),
    )
    await supervisor._write(state, {}, scaling)  # one write of its own: its condition is new
    await supervisor._write(state, {}, scaling)  # none: nothing changed

    assert kube.requests.writes() == writes + 1, kube.requests.counts
    assert conditions_on_server(custom, namespace)["Ready"]["lastTransitionTime"] == ready_since
