"""The Lease rules of iwg_operator.leader, against an in-memory Lease store and a clock the test moves:
a standby never takes a Lease renewed within a lease duration, a lost holder's Lease is taken after one, and a
leader that cannot renew gives up within the renew deadline, before any standby could take it."""

from __future__ import annotations

import asyncio
import copy
from collections.abc import Mapping
from typing import Any

import pytest
from iwg_operator.kube import LEASES, ApiError, Resource
from iwg_operator.leader import ElectionConfig, LeaderElector


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class FakeLeases:
    """get/create/replace with resourceVersion checks, as the API server does; `down` fails every call."""

    def __init__(self) -> None:
        self.lease: dict[str, Any] | None = None
        self.version = 0
        self.down = False
        self.writes: list[str] = []

    def _check(self, resource: Resource) -> None:
        assert resource is LEASES
        if self.down:
            raise ConnectionError("API server unreachable")

    async def get(self, resource: Resource, namespace: str, name: str) -> dict[str, Any] | None:
        self._check(resource)
        return copy.deepcopy(self.lease)

    async def create(self, resource: Resource, namespace: str, body: Mapping[str, Any]) -> dict[str, Any]:
        self._check(resource)
        if self.lease is not None:
            raise ApiError(409, "AlreadyExists", "exists")
        return self._store(body, "create")

    async def replace(
        self, resource: Resource, namespace: str, name: str, body: Mapping[str, Any]
    ) -> dict[str, Any]:
        self._check(resource)
        assert self.lease is not None
        if body["metadata"].get("resourceVersion") != self.lease["metadata"]["resourceVersion"]:
            raise ApiError(409, "Conflict", "the object has been modified")
        return self._store(body, "update")

    def _store(self, body: Mapping[str, Any], verb: str) -> dict[str, Any]:
        self.version += 1
        self.lease = copy.deepcopy(dict(body))
        self.lease["metadata"] = {**body["metadata"], "resourceVersion": str(self.version)}
        self.writes.append(f"{verb} {body['spec']['holderIdentity']}")
        return copy.deepcopy(self.lease)

    @property
    def holder(self) -> str | None:
        return None if self.lease is None else self.lease["spec"]["holderIdentity"]


def elector(store: FakeLeases, identity: str, clock: Clock) -> LeaderElector:
    config = ElectionConfig(namespace="iwg-system", name="iwg-operator", identity=identity)
    return LeaderElector(store, config, clock)  # type: ignore[arg-type]


def test_a_held_lease_is_only_read_until_it_has_not_changed_for_a_lease_duration() -> None:
    async def scenario() -> None:
        clock, store = Clock(), FakeLeases()
        a, b = elector(store, "a", clock), elector(store, "b", clock)
        assert await a.try_acquire_or_renew()
        assert store.writes == ["create a"]
        for _ in range(20):  # a renews every 2 s; b reads in between and never writes
            clock.now += 2
            assert not await b.try_acquire_or_renew()
            assert await a.try_acquire_or_renew()
        assert store.holder == "a" and store.writes.count("update a") == 20
        assert not any(w.endswith(" b") for w in store.writes)
        # a is gone: b takes the Lease only once it has seen it unchanged for 15 s.
        clock.now += 2
        assert not await b.try_acquire_or_renew()  # the last renewal, first seen now
        clock.now += 14.9
        assert not await b.try_acquire_or_renew()
        clock.now += 0.2
        assert await b.try_acquire_or_renew()
        assert store.holder == "b" and store.lease is not None
        assert store.lease["spec"]["leaseTransitions"] == 1

    asyncio.run(scenario())


def test_two_candidates_racing_for_a_free_lease_get_one_holder() -> None:
    async def scenario() -> None:
        clock, store = Clock(), FakeLeases()
        a, b = elector(store, "a", clock), elector(store, "b", clock)
        results = await asyncio.gather(a.try_acquire_or_renew(), b.try_acquire_or_renew())
        assert sorted(results) == [False, True] and store.writes == [f"create {store.holder}"]

    asyncio.run(scenario())


def test_a_released_lease_is_taken_at_once() -> None:
    async def scenario() -> None:
        clock, store = Clock(), FakeLeases()
        a, b = elector(store, "a", clock), elector(store, "b", clock)
        assert await a.try_acquire_or_renew()
        assert not await b.try_acquire_or_renew()
        await a.release()
        assert store.holder == ""
        assert await b.try_acquire_or_renew()

    asyncio.run(scenario())


@pytest.mark.parametrize("failure", ["unreachable", "taken"])
def test_a_leader_that_cannot_renew_stops_within_the_renew_deadline(failure: str) -> None:
    """On the real clock: lease 9 s, renew deadline 4 s, retry 0.5 s. The gaps leave room for a stalled
    process (a loaded machine pauses any process for 2-3 s): renewals that succeed are never late by the renew
    deadline, and the stop still lands before a standby could take the Lease."""

    async def scenario() -> None:
        store = FakeLeases()
        config = ElectionConfig("iwg-system", "iwg-operator", "a", 9.0, 4.0, 0.5)
        a = LeaderElector(store, config)  # type: ignore[arg-type]
        assert await a.try_acquire_or_renew()
        keep = asyncio.create_task(a.keep())
        await asyncio.sleep(1.0)
        assert not keep.done(), "renewals succeed"
        loop = asyncio.get_running_loop()
        broken = loop.time()
        if failure == "unreachable":
            store.down = True
        else:  # another candidate wrote the Lease (a split brain the Lease must end)
            assert store.lease is not None
            store._store({**store.lease, "spec": {**store.lease["spec"], "holderIdentity": "b"}}, "update")
        await asyncio.wait_for(keep, timeout=config.lease_duration + 5)
        stopped = loop.time() - broken
        # Stopped before a standby could take the Lease: within the renew deadline (plus 3 s for a stalled
        # process), inside the lease.
        assert stopped < config.renew_deadline + config.retry_period + 3 < config.lease_duration, stopped

    asyncio.run(scenario())
