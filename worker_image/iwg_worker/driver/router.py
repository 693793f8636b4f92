"""Routing batches to replicas: least loaded first, one retry on another replica, drain; generation requests
by cached prefix, bounded by load (`pick_generation`).

"Load" is what this driver has in flight on a replica plus, for generation, the requests other drivers have
on it: with several drivers every worker serves all of them, so a driver counting only its own streams would
pile its requests onto a replica the others already fill. The stats poller (`GenerationService.poll_stats`)
reads each engine's count of open requests and tells the router (`observe_engine`); what exceeds this
driver's own count on that replica belongs to the other drivers.

Every queued input's future is resolved exactly once, here: with its result, or with the error that ended
its batch. A reply that arrives after its batch was given up on is dropped by the pool (replies are matched
by request id), so no input is answered twice.

Cache-aware routing (policy ``cacheAware``, generation requests): the replica expected to hold the longest
prefix of the prompt (`PrefixTable`: what this driver sent where) among those under the load bound: no replica
takes a request that would put it above ``ceil((1 + load_bound) x mean)`` open requests (the mean counting
this one). With no prefix held anywhere, the replicas are ranked by rendezvous hashing of the prompt's first
block, so every driver sends a new conversation to the same replica; ties of equal prefixes are broken the
same way. A replica that dies or is drained leaves the table at once. ``leastLoaded``: the fewest open
requests, as for batches.

Drains: the operator drains a replica before a rollout or scale-down takes it (`drain`, `undrain`); a worker
that got SIGTERM (an eviction, a deleted pod) announces its own drain (`MembershipEvent.draining`), and its
replica gets nothing new from then until it leaves, while what it runs finishes. Either kind of drain takes the
replica out of `serving`; the worker's own is not ended by `undrain`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import Callable, Iterator
from typing import Literal

from iwg_worker.driver.batcher import QueuedItem
from iwg_worker.driver.metrics import DriverMetrics
from iwg_worker.driver.pool import (
    Batch,
    BatchFailure,
    InputRejected,
    ItemOutcome,
    MembershipEvent,
    ReplicaFailure,
    ReplicaPool,
    ReplicaState,
)
from iwg_worker.driver.prefix import DEFAULT_BLOCK_SIZE, PrefixTable, PromptBlocks, rendezvous_weight

log = logging.getLogger(__name__)

RoutingPolicy = Literal["cacheAware", "leastLoaded"]


class NoReplica(Exception):
    """No serving replica could take the batch within the grace period."""


class Router:
    def __init__(
        self,
        pool: ReplicaPool,
        metrics: DriverMetrics,
        *,
        max_inflight_per_replica: int = 2,
        batch_timeout_s: float = 60.0,
        no_replica_grace_s: float = 5.0,
        policy: RoutingPolicy = "cacheAware",
        load_bound: float = 0.25,
        table: PrefixTable | None = None,
    ) -> None:
        self._pool = pool
        self._metrics = metrics
        self._max_inflight = max_inflight_per_replica
        self._batch_timeout = batch_timeout_s
        self.no_replica_grace_s = no_replica_grace_s
        self._states: dict[int, ReplicaState] = dict(pool.states())
        self._inflight: dict[int, int] = {}
        self._elsewhere: dict[int, int] = {}  # requests of other drivers on each replica, as last reported
        self._draining: set[int] = set()  # drained by the operator (admin API)
        self._leaving: set[int] = set()  # a worker of the replica announced its own drain (SIGTERM)
        self._changed = asyncio.Event()
        self._listeners: list[Callable[[], None]] = []
        self._batch_seconds = 0.05  # running estimate, for Retry-After
        self.policy: RoutingPolicy = policy
        self.load_bound = load_bound
        self.table = table or PrefixTable()
        self.block_size = DEFAULT_BLOCK_SIZE  # the engines', once a replica reported it
        pool.add_listener(self._on_membership)
        for replica in self._states:
            self._publish(replica)

    # -- state -----------------------------------------------------------------------------------------------

    def serving(self) -> list[int]:
        return sorted(
            r
            for r, s in self._states.items()
            if s is ReplicaState.SERVING and r not in self._draining and r not in self._leaving
        )

    def snapshot(self) -> list[dict[str, object]]:
        return [
            {
                "replica": r,
                "state": self._state_name(r),
                "inflight_batches": self._inflight.get(r, 0),
                "other_drivers_requests": self._elsewhere.get(r, 0),
            }
            for r in sorted(self._states)
        ]

    def retry_after_s(self, queued: int, max_batch_size: int) -> int:
        """Roughly how long the queue takes to drain with the replicas serving now, at least 1 s."""
        replicas = max(1, len(self.serving()))
        batches = queued / max(1, max_batch_size) / replicas
        return max(1, int(batches * self._batch_seconds + 0.999))

    def _state_name(self, replica: int) -> str:
        state = self._states.get(replica, ReplicaState.DEAD)
        if state is ReplicaState.SERVING and (replica in self._draining or replica in self._leaving):
            return "draining"
        return state.value

    def _on_membership(self, event: MembershipEvent) -> None:
        previous = self._states.get(event.replica)
        self._states[event.replica] = event.state
        if event.draining and event.replica not in self._leaving:
            self._leaving.add(event.replica)
            self.forget_prefixes(event.replica)
            log.info(
                "replica %d: draining (its worker is leaving), %d in flight",
                event.replica,
                self.inflight(event.replica),
            )
        elif not event.draining:
            self._leaving.discard(event.replica)
        if event.state is ReplicaState.DEAD:
            # A drained replica that left ends its drain: when its index comes back (a scale-up), it serves.
            self._draining.discard(event.replica)
            self._elsewhere.pop(event.replica, None)
            self.forget_prefixes(event.replica)
        if previous is not event.state:
            log.info("replica %d: %s -> %s %s", event.replica, previous, event.state.value, event.reason)
        self._publish(event.replica)
        self._wake()

    def _publish(self, replica: int) -> None:
        self._metrics.set_replica_state(replica, self._state_name(replica))
        self._metrics.inflight_batches.labels(replica=str(replica)).set(self._inflight.get(replica, 0))
        self._metrics.serving_replicas.set(len(self.serving()))

    def add_listener(self, listener: Callable[[], None]) -> None:
        """Call `listener` after every change of the replicas' states, drains and in-flight counts."""
        self._listeners.append(listener)

    def _wake(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()
        for listener in self._listeners:
            listener()

    # -- choosing ----------------------------------------------------------------------------------------------

    def pick(self, exclude: frozenset[int] = frozenset(), *, respect_limit: bool = True) -> int | None:
        candidates = [
            r
            for r in self.serving()
            if r not in exclude and (not respect_limit or self._inflight.get(r, 0) < self._max_inflight)
        ]
        if not candidates:
            return None
        return min(candidates, key=lambda r: (self._load(r), r))

    def _load(self, replica: int) -> int:
        return self._inflight.get(replica, 0) + self._elsewhere.get(replica, 0)

    def pick_generation(
        self, blocks: PromptBlocks | None, exclude: frozenset[int] = frozenset()
    ) -> int | None:
        """The replica for a generation request whose prompt has `blocks` (module docstring), recorded as
        holding them; None when no replica serves."""
        candidates = [r for r in self.serving() if r not in exclude]
        if not candidates:
            return None
        if self.policy == "leastLoaded" or blocks is None:
            chosen = min(candidates, key=lambda r: (self._load(r), r))
            self._metrics.routing_decisions.labels(replica=str(chosen), reason="least_loaded").inc()
            return chosen
        loads = {r: self._load(r) for r in candidates}
        cap = math.ceil((1.0 + self.load_bound) * (sum(loads.values()) + 1) / len(candidates))

        def rank(r: int) -> tuple[int, int]:  # longest prefix first, then the rendezvous order
            return self.table.match(r, blocks.hashes), rendezvous_weight(blocks.anchor, r)

        ranked = sorted(candidates, key=rank, reverse=True)
        # Never empty: the least loaded replica holds at most (total - 1) / n, so it is under the cap.
        chosen = next(r for r in ranked if loads[r] + 1 <= cap)
        reason = "bound" if chosen != ranked[0] else "prefix" if rank(chosen)[0] > 0 else "hash"
        self._metrics.routing_decisions.labels(replica=str(chosen), reason=reason).inc()
        self.table.record(chosen, blocks.hashes)
        self._metrics.routing_table_blocks.labels(replica=str(chosen)).set(self.table.size(chosen))
        return chosen

    def forget_prefixes(self, replica: int) -> None:
        """What was sent to `replica` is no longer in its cache: it left (died, or drains), or its engine
        evicted every cached block."""
        self.table.forget(replica)
        self._metrics.routing_table_blocks.labels(replica=str(replica)).set(0)

    def follow_blocks(self, replica: int, stored: list[int], evicted: list[int]) -> None:
        """`replica`'s engine reported the prompt blocks it stored (whichever driver sent their requests) and
        those it evicted: the table holds what the engine holds (a replica that left holds nothing)."""
        if replica not in self.serving():
            return
        self.table.record(replica, tuple(stored))
        self.table.discard(replica, evicted)
        self._metrics.routing_table_blocks.labels(replica=str(replica)).set(self.table.size(replica))

    def observe_engine(self, replica: int, open_requests: int, block_size: int | None = None) -> None:
        """`replica`'s engine holds `open_requests` requests of every driver; those beyond this driver's own
        are other drivers' load, counted when choosing until the next report. `block_size`: its engine's
        cache block size, which prompts are hashed by (the table starts again when it changes)."""
        if replica in self._states:
            self._elsewhere[replica] = max(0, open_requests - self._inflight.get(replica, 0))
        if block_size and block_size != self.block_size:
            log.info("routing by prefix blocks of %d tokens (the engine's block size)", block_size)
            self.block_size = block_size
            self.table.clear()

    def has_slot(self) -> bool:
        return self.pick() is not None

    async def wait_for_slot(self, timeout: float) -> bool:
        return await self._wait_until(self.has_slot, timeout)

    async def wait_for_serving(self, timeout: float) -> bool:
        return await self._wait_until(lambda: bool(self.serving()), timeout)

    async def _wait_until(self, condition: Callable[[], bool], timeout: float) -> bool:
        """Wait for membership changes until `condition()` holds; False once `timeout` has passed."""
        deadline = time.monotonic() + timeout
        while not condition():
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return False
            try:
                await asyncio.wait_for(self._changed.wait(), remaining)
            except TimeoutError:
                return False
        return True

    # -- running -----------------------------------------------------------------------------------------------

    async def run(self, batch: Batch, items: list[QueuedItem]) -> None:
        """Run `batch` on the least-loaded replica; if that replica fails, once more on another one."""
        tried: frozenset[int] = frozenset()
        last_error: Exception | None = None
        for attempt in range(2):
            replica = self.pick(tried) if attempt == 0 else self.pick(tried, respect_limit=False)
            if replica is None and attempt == 0 and await self._wait_any_serving(tried):
                replica = self.pick(tried, respect_limit=False)
            if replica is None:
                break
            if attempt == 1:
                self._metrics.retries.inc()
                log.warning("retrying a batch of %d on replica %d after: %s", len(items), replica, last_error)
            tried = tried | {replica}
            try:
                results = await self._execute(replica, batch)
            except ReplicaFailure as exc:
                self._metrics.replica_failures.labels(replica=str(replica)).inc()
                last_error = exc
                continue
            except BatchFailure as exc:
                _fail(items, exc)
                return
            except Exception as exc:  # a bug in the pool must not leave requests hanging
                log.exception("replica %d: unexpected error running a batch", replica)
                _fail(items, BatchFailure(f"{type(exc).__name__}: {exc}"))
                return
            if len(results) != len(items):
                _fail(
                    items, BatchFailure(f"replica {replica} returned {len(results)} results for {len(items)}")
                )
                return
            for item, result in zip(items, results, strict=True):
                if item.future.done():
                    continue
                if isinstance(result, InputRejected):
                    item.future.set_exception(result)
                else:
                    item.future.set_result(result)
            return
        if last_error is None:
            _fail(items, NoReplica("no serving replica"))
        elif len(tried) < 2:
            _fail(items, NoReplica(f"replica failed ({last_error}) and no other replica is serving"))
        else:
            _fail(items, ReplicaFailure(f"two replicas failed this batch; last: {last_error}"))

    async def _wait_any_serving(self, exclude: frozenset[int]) -> bool:
        return await self._wait_until(
            lambda: any(r not in exclude for r in self.serving()), self.no_replica_grace_s
        )

    @contextlib.contextmanager
    def claim(self, replica: int) -> Iterator[None]:
        """Count a batch or a generation stream as in flight on ``replica`` while the block runs."""
        self._inflight[replica] = self._inflight.get(replica, 0) + 1
        self._publish(replica)
        try:
            yield
        finally:
            self._inflight[replica] -= 1
            self._publish(replica)
            self._wake()

    async def _execute(self, replica: int, batch: Batch) -> list[ItemOutcome]:
        with self.claim(replica):
            return await self._execute_claimed(replica, batch)

    async def _execute_claimed(self, replica: int, batch: Batch) -> list[ItemOutcome]:
        self._metrics.batch_size.observe(len(batch.inputs))
        self._metrics.batches.labels(replica=str(replica)).inc()
        started = time.monotonic()
        results = await self._pool.execute(replica, batch, self._batch_timeout)
        elapsed = time.monotonic() - started
        self._metrics.batch_latency.observe(elapsed)
        self._batch_seconds = 0.8 * self._batch_seconds + 0.2 * elapsed
        return list(results)

    # -- drain -------------------------------------------------------------------------------------------------

    def known(self, replica: int) -> bool:
        return replica in self._states

    async def drain(self, replica: int, timeout: float) -> bool:
        """Stop sending new batches to `replica`; True once its in-flight batches have finished."""
        self._draining.add(replica)
        self.forget_prefixes(replica)
        self._publish(replica)
        self._wake()
        log.info("replica %d: draining, %d batch(es) in flight", replica, self._inflight.get(replica, 0))
        drained = await self._wait_until(lambda: self._inflight.get(replica, 0) == 0, timeout)
        log.info("replica %d: %s", replica, "drained" if drained else f"not drained within {timeout:g} s")
        return drained

    def undrain(self, replica: int) -> None:
        log.info("replica %d: undrained", replica)
        self._draining.discard(replica)
        self._publish(replica)
        self._wake()

    def inflight(self, replica: int) -> int:
        return self._inflight.get(replica, 0)


def _fail(items: list[QueuedItem], exc: Exception) -> None:
    for item in items:
        if not item.future.done():
            item.future.set_exception(exc)
