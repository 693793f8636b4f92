"""Scale from zero without waiting for a scrape (issue 25): the supervisor of a group at zero keeps a long-poll
open to each driver (autoscaling/activation.py) and scales to one replica as soon as a driver holds a request,
long before its next scrape. Real HTTP: the driver's own app (over the fake replica pool) on a local port, the
real Supervisor over a stand-in for the controller and the API."""

from __future__ import annotations

import asyncio
import base64
import time
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from typing import Any, cast

import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer
from iwg_operator import status
from iwg_operator.api import v1alpha1 as api
from iwg_operator.autoscaling import activation
from iwg_operator.autoscaling.activation import ActivationWatch
from iwg_operator.autoscaling.policy import DriverSample, combine_samples, parse_driver_metrics
from iwg_operator.controller import Controller, GroupState, group_from_body
from iwg_operator.driver_admin import ADMIN_TOKEN_KEY, DriverPod
from iwg_operator.kube import PODS, SECRETS, Resource
from iwg_operator.pod_http import session
from iwg_operator.supervisor import Supervisor, latest_activation
from iwg_worker.driver.activation import MAX_WATCHERS
from iwg_worker.driver.metrics import DriverMetrics
from iwg_worker.driver.pool import ReplicaStartup, ReplicaState

from tests.iwg_worker.driver.fakes import FakePool
from tests.iwg_worker.driver.test_driver_activation import at_zero, until
from tests.iwg_worker.driver.test_driver_routing import TOKEN, embed, metric, serve

pytestmark = pytest.mark.timeout(60)

SCRAPE_PERIOD_S = 30.0  # far above what the test allows: only the long-poll can make it


class Kube:
    """The calls the supervisor makes for a group at zero: its driver pods, and the scale it sets (seen by
    the group's state at once, as the watch would show it)."""

    def __init__(self, state: GroupState) -> None:
        self.state = state
        self.drivers: list[dict[str, Any]] = []
        self.scaled: list[tuple[float, int]] = []

    async def list(
        self, resource: Resource, namespace: str, label_selector: str, field_selector: str | None = None
    ) -> list[dict[str, Any]]:
        return list(self.drivers) if resource is PODS else []

    async def get(self, resource: Resource, namespace: str, name: str) -> dict[str, Any] | None:
        token = base64.b64encode(TOKEN.encode()).decode()  # the group's Secret, for the drain's admin token
        return {"data": {ADMIN_TOKEN_KEY: token}} if resource is SECRETS else None

    async def scale(self, resource: Resource, namespace: str, name: str, replicas: int) -> dict[str, Any]:
        self.scaled.append((time.monotonic(), replicas))
        body = {**self.state.body, "spec": {**self.state.body["spec"], "replicas": replicas}}
        self.state.body, self.state.group = body, group_from_body(body)
        return {}


class Groups:
    """What the supervisor reads of the controller, and the Events and status it writes."""

    def __init__(self, state: GroupState) -> None:
        self.kube = Kube(state)
        self.groups = {state.key: state}
        self.events: list[tuple[str, str]] = []

    def observed(self, key: Any) -> list[Any]:
        return []

    async def write_status(self, state: GroupState, change: Any) -> Mapping[str, Any] | None:
        patch = change(state.current_status)
        state.body = {**state.body, "status": {**state.current_status, **patch}}
        return patch

    async def post_event(
        self, state: GroupState, kind: str, reason: str, message: str, once: bool = True
    ) -> None:
        self.events.append((reason, message))


def group_at_zero(port: int) -> GroupState:
    body = {
        "apiVersion": api.API_VERSION,
        "kind": api.KIND,
        "metadata": {"name": "g", "namespace": "ns", "uid": "u1", "generation": 1},
        "spec": {
            "model": {"task": "embed", "path": "/m"},
            "replicas": 0,
            "driver": {"port": port},
            "autoscaling": {"enabled": True, "minReplicas": 0, "maxReplicas": 2},
        },
    }
    return GroupState(key=("ns", "g"), body=body, group=group_from_body(body))


def idle(groups: Groups) -> bool:
    (state,) = groups.groups.values()
    return any(c.get("reason") == "Idle" for c in state.current_status.get("conditions") or [])


def driver_pod(address: str) -> dict[str, Any]:
    return {
        "metadata": {"name": "g-driver-0"},
        "status": {
            "podIP": address,
            "conditions": [{"type": "Ready", "status": "True"}],
            "containerStatuses": [{"name": "driver", "restartCount": 0, "state": {"running": {}}}],
        },
    }


@asynccontextmanager
async def supervised(
    port: int, period_s: float = SCRAPE_PERIOD_S
) -> AsyncIterator[tuple[Groups, Supervisor]]:
    state = group_at_zero(port)
    groups = Groups(state)
    groups.kube.drivers = [driver_pod("127.0.0.1")]
    supervisor = Supervisor(cast(Controller, groups))
    supervisor.autoscale_interval = period_s
    supervisor.watch(state.key)
    try:
        yield groups, supervisor
    finally:
        await supervisor.close()


async def test_a_group_at_zero_scales_to_one_replica_on_a_held_request_long_before_the_next_scrape() -> None:
    pool = at_zero()
    async with serve(pool, activation_timeout_s=30.0) as (client, driver):
        assert client.server.port is not None
        async with supervised(client.server.port) as (groups, _):
            # The first round (at once) finds the group idle at zero and opens the long-poll; the next
            # scrape would come 30 s later.
            await asyncio.wait_for(until(lambda: idle(groups)), 10)
            await asyncio.wait_for(until(lambda: driver.activation.watchers == 1), 10)
            assert groups.kube.scaled == []
            arrived = time.monotonic()
            held = asyncio.create_task(embed(client, "first request"))
            await asyncio.wait_for(until(lambda: bool(groups.kube.scaled)), 10)
            (at, replicas), *_ = groups.kube.scaled
            print(f"scaled {at - arrived:.3f} s after the hold")
            # Well under a second when the machine is idle; 5 s leaves room for a stalled process and is still
            # far from the next scrape (30 s): only the long-poll can have done it.
            assert replicas == 1 and at - arrived < 5.0, at - arrived
            assert [reason for reason, _ in groups.events] == ["ScaledFromZero"]
            await until(lambda: driver.activation.watchers == 0)  # the poll ended with its answer
            pool.set_state(0, ReplicaState.SERVING)
            status, _, _ = await held
            assert status == 200


async def test_the_watch_holds_one_request_per_driver_and_none_once_the_group_leaves_zero() -> None:
    async with (
        serve(at_zero(), activation_timeout_s=30.0) as (one, first),
        serve(at_zero(), activation_timeout_s=30.0) as (two, second),
        session() as http,
    ):
        assert one.server.port is not None and two.server.port is not None
        watch = ActivationWatch()
        a = DriverPod("a", "127.0.0.1")
        for _ in range(3):  # every autoscaler round at zero: still one poll per driver
            watch.track(http, [a], one.server.port)
            await until(lambda: first.activation.watchers == 1)
        assert watch.open == 1
        watch.track(http, [a], two.server.port)  # the set changed: the old driver's poll is closed
        await until(lambda: second.activation.watchers == 1 and first.activation.watchers == 0)
        watch.stop()  # the group left zero
        await until(lambda: second.activation.watchers == 0)
        assert watch.open == 0 and not watch.woken.is_set()
        await watch.close()


async def test_a_driver_answers_the_long_poll_at_once_when_it_holds_a_request_and_bounds_the_polls() -> None:
    async with serve(at_zero(), activation_timeout_s=30.0) as (client, driver):
        quiet = await client.get("/activation?wait=0.1")
        assert (quiet.status, await quiet.json()) == (200, {"waiting": 0})
        bad = await client.get("/activation?wait=nan")
        assert bad.status == 400 and (await bad.json())["error"]["param"] == "wait"
        polls = [asyncio.create_task(client.get("/activation?wait=30")) for _ in range(MAX_WATCHERS)]
        await until(lambda: driver.activation.watchers == MAX_WATCHERS)
        refused = await client.get("/activation?wait=30")
        assert refused.status == 429 and refused.headers["Retry-After"] == "1"
        held = asyncio.create_task(embed(client, "wakes them all"))
        answers = await asyncio.wait_for(asyncio.gather(*polls), 10)  # at once, far within their 30 s wait
        assert [(r.status, await r.json()) for r in answers] == [(200, {"waiting": 1})] * MAX_WATCHERS
        again = await client.get("/activation?wait=30")  # one held now: answered at once
        assert await again.json() == {"waiting": 1}
        held.cancel()


async def test_the_time_to_first_answer_goes_to_the_status_and_an_event_once() -> None:
    pool = at_zero()
    async with serve(pool, activation_timeout_s=30.0) as (client, driver):
        assert client.server.port is not None
        async with supervised(client.server.port, period_s=0.2) as (groups, _):
            (state,) = groups.groups.values()
            await asyncio.wait_for(until(lambda: idle(groups)), 5)
            held = asyncio.create_task(embed(client, "first request"))
            await asyncio.wait_for(until(lambda: bool(groups.kube.scaled)), 5)
            await asyncio.sleep(0.5)  # the replica's cold start
            now = time.monotonic()  # its worker's hello: started 0.4 s ago, loaded its model in 0.25 s
            pool.startups[0] = ReplicaStartup(now - 0.4, now - 0.3, now - 0.05)
            pool.set_state(0, ReplicaState.SERVING)
            assert (await held)[0] == 200
            assert 0.5 <= metric(driver, "iwg_last_activation_seconds") < 5
            assert abs(metric(driver, "iwg_last_activation_timestamp_seconds") - time.time()) < 5
            await asyncio.wait_for(until(lambda: "lastActivation" in state.current_status), 5)
            activation = state.current_status["lastActivation"]
            assert activation["seconds"] == round(metric(driver, "iwg_last_activation_seconds"), 3)
            assert activation["at"] == status.rfc3339(metric(driver, "iwg_last_activation_timestamp_seconds"))
            phases = activation["phases"]
            assert list(phases) == ["podStart", "workerStart", "modelLoad", "ready", "firstAnswer"]
            assert phases["modelLoad"] == pytest.approx(0.25, abs=0.002)
            assert sum(phases.values()) == pytest.approx(activation["seconds"], abs=0.01)
            await asyncio.sleep(0.5)  # more rounds: the same activation is not reported again
            reasons = [reason for reason, _ in groups.events]
            assert reasons == ["ScaledFromZero", "ActivatedFromZero"], groups.events
            assert f"first answer {activation['seconds']:.2f} s after" in groups.events[1][1]
            assert f"model load {phases['modelLoad']:.2f} s" in groups.events[1][1]


def test_the_latest_activation_of_any_driver_is_read_and_written_once() -> None:
    metrics = DriverMetrics()
    assert parse_driver_metrics(metrics.render().decode(), 1.0).last_activation is None  # none yet
    metrics.last_activation_seconds.set(7.25)
    metrics.last_activation_time.set(1_800_000_000.0)
    for phase, seconds in (("pod_start", 3.0), ("worker_start", 1.0), ("model_load", 2.0), ("ready", 0.25)):
        metrics.last_activation_phase_seconds.labels(phase=phase).set(seconds)
    partial = latest_activation({}, parse_driver_metrics(metrics.render().decode(), 1.0))
    assert partial is not None and "phases" not in partial  # a part missing: none written
    metrics.last_activation_phase_seconds.labels(phase="first_answer").set(1.0)
    one = parse_driver_metrics(metrics.render().decode(), 1.0)
    older = DriverSample(2.0, 0.0, 0.0, last_activation=(1_700_000_000.0, 1.0))
    both = combine_samples({"a#0": one, "b#0": older})
    assert both.last_activation == (1_800_000_000.0, 7.25)
    entry = latest_activation({}, both)
    phases = {"podStart": 3.0, "workerStart": 1.0, "modelLoad": 2.0, "ready": 0.25, "firstAnswer": 1.0}
    assert entry == {"at": "2027-01-15T08:00:00Z", "seconds": 7.25, "phases": phases}
    assert latest_activation({"lastActivation": entry}, both) is None  # written already: no second Event
    assert latest_activation({}, None) is None


async def test_a_driver_that_answers_without_waiting_is_not_asked_in_a_busy_loop(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    asked = 0

    async def at_once(request: web.Request) -> web.Response:
        nonlocal asked
        asked += 1
        return web.json_response({"waiting": 0})

    app = web.Application()
    app.router.add_get("/activation", at_once)
    monkeypatch.setattr(activation, "MIN_POLL_S", 0.2)
    async with TestServer(app) as server, session() as http:
        assert server.port is not None
        watch = ActivationWatch()
        started = time.monotonic()
        watch.track(http, [DriverPod("a", "127.0.0.1")], server.port)
        await asyncio.wait_for(until(lambda: asked >= 1), 10)
        await asyncio.sleep(2.0)
        await watch.close()
        elapsed = time.monotonic() - started
    # One ask at once, then at most one per MIN_POLL_S (a busy loop would ask thousands of times).
    assert 1 <= asked <= elapsed / activation.MIN_POLL_S + 2, (asked, elapsed)


async def test_replicas_the_autoscaler_drains_for_a_scale_to_zero_are_the_reconcilers_to_undrain() -> None:
    # The reconciler undrains the drained replicas a plan keeps (a scale-up that came before their pods went):
    # it must know of the autoscaler's drains too, or a held request finds the kept pod drained for good.
    async with serve(FakePool(replicas=1), activation_timeout_s=30.0) as (client, driver):
        assert client.server.port is not None
        async with supervised(client.server.port, period_s=0.2) as (groups, _):
            (state,) = groups.groups.values()
            await groups.kube.scale(PODS, "ns", "g", 1)
            state.body["spec"]["autoscaling"].update(
                scaleToZeroAfterSeconds=1, scaleDownStabilizationSeconds=0
            )
            state.group = group_from_body(state.body)
            await asyncio.wait_for(until(lambda: groups.kube.scaled[-1][1] == 0), 10)
            assert driver.router.serving() == []  # drained in the driver before replicas went to 0
            assert state.drained == {0}
