"""Scale to zero under `iwg serve`: a group that starts with no replica and brings one up on the first request.

`ZeroPool` is the driver's `ReplicaPool` while no executor runs: it knows no replica, so the driver holds
requests (activation.py). `LocalScaler` plays the operator's autoscaler on one machine, with its decisions
(`iwg_operator.autoscaling.scaler.GroupScaler` on the driver's own metrics): as soon as the driver holds a
request (`Activation.watch`, the long-poll the operator keeps open in a cluster) it starts one replica's
workers (a fresh executor, `make_executor`, in a thread) and hands them to the pool, whose SERVING replica
releases the held requests in arrival order; after `spec.autoscaling.scaleToZeroAfterSeconds` with no
request it drains the replica in the driver (in-flight requests finish; a request arriving meanwhile is held)
and stops its workers. Only one replica: the local group runs between 0 and 1.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

from iwg_operator.api.v1alpha1 import AutoscalingSpec
from iwg_operator.autoscaling.policy import parse_driver_metrics
from iwg_operator.autoscaling.scaler import GroupScaler

from iwg_worker.driver.executor_pool import ExecutorPool
from iwg_worker.driver.pool import (
    Batch,
    ItemOutcome,
    MembershipEvent,
    MembershipListener,
    ReplicaFailure,
    ReplicaPool,
    ReplicaStartup,
    ReplicaState,
)
from iwg_worker.driver.service import Driver

log = logging.getLogger(__name__)

SAMPLE_INTERVAL_S = 0.5  # how often the idle clock reads the driver's metrics while a replica runs
RETRY_START_S = 5.0  # after a start that failed, the next try on a held request


class ZeroPool:
    """A `ReplicaPool` whose replicas are those of the pool it was last given (none at first)."""

    def __init__(self) -> None:
        self._inner: ReplicaPool | None = None
        self._listeners: list[MembershipListener] = []
        self.closed = False

    @property
    def running(self) -> bool:
        return self._inner is not None

    def states(self) -> dict[int, ReplicaState]:
        return self._inner.states() if self._inner is not None else {}

    def add_listener(self, listener: MembershipListener) -> None:
        self._listeners.append(listener)

    def _forward(self, event: MembershipEvent) -> None:
        for listener in self._listeners:
            listener(event)

    def attach(self, inner: ReplicaPool) -> None:
        """Serve through `inner`'s replicas (started, serving): each is announced in its current state."""
        inner.add_listener(self._forward)
        self._inner = inner
        for replica, state in inner.states().items():
            self._forward(MembershipEvent(replica, state, "started from zero"))

    async def detach(self) -> None:
        """Stop the workers (`inner.close`); its replicas leave (DEAD) first, so nothing new is sent to them."""
        inner, self._inner = self._inner, None
        if inner is None:
            return
        for replica in inner.states():
            self._forward(MembershipEvent(replica, ReplicaState.DEAD, "scaled to zero"))
        await inner.close()

    def _current(self) -> ReplicaPool:
        if self._inner is None:
            raise ReplicaFailure("no replica runs (scaled to zero)")
        return self._inner

    async def execute(self, replica: int, batch: Batch, timeout: float) -> Sequence[ItemOutcome]:
        return await self._current().execute(replica, batch, timeout)

    async def open_stream(
        self, replica: int, request: dict[str, Any], timeout: float
    ) -> tuple[AsyncIterator[dict[str, Any]], dict[str, Any]]:
        return await self._current().open_stream(replica, request, timeout)

    async def cancel_streams(self, replica: int, request_ids: list[str], timeout: float) -> None:
        if self._inner is not None:
            await self._inner.cancel_streams(replica, request_ids, timeout)

    async def engine_stats(
        self, replica: int, timeout: float, blocks_since: list[int] | None = None
    ) -> dict[str, Any]:
        return await self._current().engine_stats(replica, timeout, blocks_since)

    def startup(self, replica: int) -> ReplicaStartup | None:
        return self._inner.startup(replica) if self._inner is not None else None

    async def close(self) -> None:
        self.closed = True
        await self.detach()


class LocalScaler:
    """Between 0 and 1 replica on this machine, on the operator's decisions (see the module's docstring)."""

    def __init__(
        self,
        driver: Driver,
        pool: ZeroPool,
        make_executor: Callable[[], Any],
        spec: AutoscalingSpec,
        drain_timeout_s: float,
        pool_of: Callable[[Any], ReplicaPool] = ExecutorPool,
    ) -> None:
        self.driver = driver
        self.pool = pool
        self.make_executor = make_executor  # blocking: run in a thread; returns once its replica serves
        self.pool_of = pool_of
        self.spec = spec
        self.drain_timeout_s = drain_timeout_s
        self.scaler = GroupScaler()

    async def run(self) -> None:
        while True:
            try:
                if not self.pool.running:
                    await self._from_zero()
                else:
                    await asyncio.sleep(SAMPLE_INTERVAL_S)
                    await self._maybe_to_zero()
            except asyncio.CancelledError:
                raise
            except Exception:  # never let one bad round end the scaling
                log.exception("scale to zero")
                await asyncio.sleep(SAMPLE_INTERVAL_S)

    def _decide(self, replicas: int) -> int | None:
        sample = parse_driver_metrics(self.driver.metrics.render().decode(), time.monotonic())
        return self.scaler.decide(sample, None, replicas, self.spec).replicas

    async def _from_zero(self) -> None:
        if await self.driver.activation.watch(30.0) == 0:
            self._decide(0)  # keeps the idle clock's memory of the driver's counters current
            return
        if not self._decide(0):  # held, but no replica wanted (yet): `watch` would answer at once again
            await asyncio.sleep(SAMPLE_INTERVAL_S)
            return
        log.info("a request is held with no replica: starting one")
        started = time.monotonic()
        start = asyncio.ensure_future(asyncio.to_thread(self.make_executor))
        try:
            executor = await asyncio.shield(start)
        except asyncio.CancelledError:  # stopping while the workers start: stop them once they have
            with contextlib.suppress(Exception):
                await self.pool_of(await start).close()
            raise
        except Exception as error:  # held requests wait on (up to their activation timeout); try again
            log.error("starting a replica from zero failed: %s", error)
            await asyncio.sleep(RETRY_START_S)
            return
        inner = self.pool_of(executor)
        if self.pool.closed:  # the driver stopped while the workers started
            await inner.close()
            return
        self.pool.attach(inner)
        log.info("replica 0 serving %.1f s after the first held request", time.monotonic() - started)

    async def _maybe_to_zero(self) -> None:
        if self._decide(1) != 0:
            return
        log.info(
            "no request for %d s (scaleToZeroAfterSeconds): draining and stopping replica 0",
            self.spec.scale_to_zero_after_seconds,
        )
        for replica in self.pool.states():
            await self.driver.router.drain(replica, self.drain_timeout_s)
        await self.pool.detach()
        self.scaler = GroupScaler()


@contextlib.asynccontextmanager
async def scaling(scaler: LocalScaler) -> AsyncIterator[None]:
    """`scaler` runs while the block does."""
    task = asyncio.create_task(scaler.run(), name="iwg serve: scale to zero")
    try:
        yield
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
