"""Requests held while no replica serves (a group scaled to zero, or starting): the driver's activator.

With an activation timeout (``DriverConfig.activation_timeout_s`` > 0, ``IWG_ACTIVATION_TIMEOUT_S``), a
request that arrives while no replica serves waits here instead of failing: at most ``max_waiting`` of them
(beyond that, 429 with ``Retry-After``), each for at most the timeout (then 503 naming it). Once a replica
serves, the waiting requests are released in arrival order (each then takes its usual path: the batcher for
embeddings, a replica's engine for generation). A request whose client leaves while waiting (its handler is
cancelled) leaves the queue at once. Without a timeout (0) nothing is held: a request waits the router's short
grace (``no_replica_grace_s``) for a replica to serve, then is answered 503 ``no_replica``.

``iwg_activation_waiting`` counts the requests waiting here (the autoscaler's signal to scale from zero);
``iwg_activation_seconds`` observes, for each request that waited, the time from its arrival to its first
answer (its first token when streamed). ``iwg_last_activation_seconds`` is the latest activation's time to
first answer: from the oldest request held to the first answer of any of them, once a replica served
(``iwg_last_activation_timestamp_seconds``: when that answer came, Unix time; both 0 before any); the
autoscaler writes it to the group's status (``lastActivation``). The same activation in its parts
(``iwg_activation_phase_seconds`` and ``iwg_last_activation_phase_seconds``, label ``phase``), from the
serving replica's worker's hello (`ReplicaStartup`): ``pod_start`` (first request held to the worker process's
start), ``worker_start`` (to its model load's start), ``model_load``, ``ready`` (to serving) and
``first_answer`` (serving to the first answer). Each part starts where the one before ends and none is below
zero (a worker that started before the first request was held has no pod_start), so they add up to the whole;
without the worker's word (an older worker) only ``first_answer`` is observed.

``GET /activation?wait=S`` (app.py) tells the operator at once: it answers as soon as a request is held (at
once when one is now), or after ``S`` seconds (at most ``MAX_WATCH_S``) with nothing held. The autoscaler keeps
one such long-poll open to each driver of a group at zero replicas, so it scales from zero without waiting
for its next scrape; at most ``MAX_WATCHERS`` are open at a time (beyond them 429: the scrape still sees the
held requests).
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable

from iwg_worker.driver.metrics import DriverMetrics
from iwg_worker.driver.openai_api import ApiError, queue_full_error
from iwg_worker.driver.pool import ReplicaStartup
from iwg_worker.driver.router import Router

PHASES = ("pod_start", "worker_start", "model_load", "ready", "first_answer")

MAX_WATCHERS = 16
MAX_WATCH_S = 60.0


class Activation:
    def __init__(
        self,
        router: Router,
        metrics: DriverMetrics,
        timeout_s: float,
        max_waiting: int,
        startup_of: Callable[[int], ReplicaStartup | None] = lambda _: None,
    ) -> None:
        self.router = router
        self.startup_of = startup_of
        self.metrics = metrics
        self.timeout_s = timeout_s
        self.max_waiting = max_waiting
        self._waiters: deque[tuple[float, asyncio.Future[None]]] = deque()  # (arrival, waiter), oldest first
        # The arrival of the oldest request of the last release, until one request of it is answered: the
        # activation that `answered` measures.
        self._released_from: float | None = None
        self._released_at = 0.0  # when that release came (a replica serving)
        self._startup: ReplicaStartup | None = None  # how the replica serving then started
        self._watchers: set[asyncio.Future[None]] = set()
        self._given_back: str | None = None  # why this driver holds nothing more (it is stopping)
        router.add_listener(self._release)

    @property
    def enabled(self) -> bool:
        return self.timeout_s > 0

    @property
    def waiting(self) -> int:
        return len(self._waiters)

    @property
    def watchers(self) -> int:
        """Open `watch` long-polls."""
        return len(self._watchers)

    async def hold(self) -> float | None:
        """Return once a replica serves: None at once when one serves now, else the monotonic time this request
        arrived (it waited). 429 when ``max_waiting`` requests wait already, 503 when the timeout passes.
        With activation off, None at once."""
        if self.router.serving():
            return None
        if not self.enabled:
            return None  # the request's own path answers 503 no_replica (after the router's grace)
        if self._given_back is not None:
            self.metrics.rejected.labels(reason="driver_stopping").inc()
            raise _given_back_error(self._given_back)
        if len(self._waiters) >= self.max_waiting:
            self.metrics.rejected.labels(reason="queue_full").inc()
            raise queue_full_error(f"{len(self._waiters)} requests held while a replica starts")
        arrived = time.monotonic()
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append((arrived, waiter))
        self._publish()
        for watcher in self._watchers:
            if not watcher.done():
                watcher.set_result(None)
        try:
            await asyncio.wait_for(waiter, self.timeout_s)
        except TimeoutError:
            self.metrics.rejected.labels(reason="activation_timeout").inc()
            raise ApiError(
                503,
                f"No replica of this model started serving within the activation timeout of "
                f"{self.timeout_s:g} s (spec.autoscaling.activationTimeoutSeconds); retry later.",
                type="service_unavailable",
                code="activation_timeout",
                headers={"Retry-After": "1"},
            ) from None
        finally:
            if not waiter.done():
                waiter.cancel()
            self._waiters = deque(w for w in self._waiters if w[1] is not waiter)
            self._publish()
        return arrived

    def give_back(self, why: str) -> int:
        """Answer every held request, and any that would be held from now on, 503 with ``Retry-After: 1``
        (code ``driver_stopping``: a client that retries, as the openai client does, reaches a driver still
        serving, which holds it again), instead of keeping it until this driver's process ends and cuts it.
        The driver calls it when it stops with requests still held. Returns how many were held."""
        self._given_back = why
        held = 0
        while self._waiters:
            _, waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_exception(_given_back_error(why))
                held += 1
        self.metrics.rejected.labels(reason="driver_stopping").inc(held)
        self._publish()
        return held

    async def watch(self, wait_s: float) -> int:
        """The number of requests held: at once when any is, else as soon as one is, or 0 after `wait_s`
        (at most ``MAX_WATCH_S``). 429 when ``MAX_WATCHERS`` watches are open already."""
        if self._waiters:
            return len(self._waiters)
        if len(self._watchers) >= MAX_WATCHERS:
            raise queue_full_error(f"{len(self._watchers)} activation watches open")
        watcher: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._watchers.add(watcher)
        try:
            await asyncio.wait_for(watcher, min(max(wait_s, 0.0), MAX_WATCH_S))
        except TimeoutError:
            pass
        finally:
            self._watchers.discard(watcher)
        return len(self._waiters)

    def answered(self, arrived: float | None) -> None:
        """A request that waited (`hold` returned `arrived`) got its first answer. The first one answered
        after a release completes that activation: from the first request held to this first answer."""
        if arrived is None:
            return
        now = time.monotonic()
        self.metrics.activation_seconds.observe(now - arrived)
        if self._released_from is not None:
            self.metrics.last_activation_seconds.set(now - self._released_from)
            self.metrics.last_activation_time.set(time.time())
            for phase, seconds in activation_phases(
                self._released_from, self._startup, self._released_at, now
            ):
                self.metrics.activation_phase_seconds.labels(phase=phase).observe(seconds)
                self.metrics.last_activation_phase_seconds.labels(phase=phase).set(seconds)
            self._released_from = None

    def _release(self) -> None:
        """Every waiting request, oldest first, once a replica serves (their tasks resume in this order)."""
        if not self.router.serving():
            return
        if self._waiters:
            self._released_from = self._waiters[0][0]
            self._released_at = time.monotonic()
            serving = self.router.serving()
            self._startup = self.startup_of(serving[0]) if serving else None
        while self._waiters:
            _, waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
        self._publish()

    def _publish(self) -> None:
        self.metrics.activation_waiting.set(len(self._waiters))


def _given_back_error(why: str) -> ApiError:
    return ApiError(
        503,
        f"This driver is stopping ({why}) and no replica served the request it held; retry, and another "
        "driver of the group holds it.",
        type="service_unavailable",
        code="driver_stopping",
        headers={"Retry-After": "1"},
    )


def activation_phases(
    held: float, startup: ReplicaStartup | None, serving: float, answered: float
) -> list[tuple[str, float]]:
    """An activation's parts (see the module's docstring): from the first request ``held`` to the replica
    ``serving`` through its worker's ``startup``, then to the first answer (monotonic times)."""
    points = (startup.process_started, startup.load_began, startup.load_done) if startup else ()
    if len(points) != 3 or any(p is None for p in points):
        return [("first_answer", max(0.0, answered - serving))]
    marks = [held]
    for point in points:  # each within [the mark before, serving]
        marks.append(min(max(float(point or 0.0), marks[-1]), max(serving, marks[-1])))
    marks.append(max(serving, marks[-1]))
    marks.append(max(answered, marks[-1]))
    return [(phase, marks[i + 1] - marks[i]) for i, phase in enumerate(PHASES)]
