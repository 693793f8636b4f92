"""Leader election for two or more operator replicas: a coordination.k8s.io/v1 Lease, as client-go's
leaderelection package holds one (the same record, the same three durations, the same rules).

Only the leader runs Kopf: the handlers, the reconciler and the supervisor (prober, autoscaler). A standby
starts nothing of that; it reads the Lease every retry period and writes nothing until the Lease has not
changed for a whole lease duration (its holder is gone) or was released. The leader renews every retry period;
one that has not renewed within the renew deadline exits at once (`exit_now`), before any standby can take the
Lease (lease duration > renew deadline), and its container restarts as a standby. On a graceful stop the
leader releases the Lease, so that a rolling update hands over at once instead of after a lease duration.

The election runs in a thread with its own event loop and its own API client, so that a busy Kopf loop (a few
hundred groups reconciling) delays no renewal.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import sys
import threading
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import urlsplit

from iwg_operator.kube import LEASES, ApiError, Connection, KubeApi

log = logging.getLogger("iwg_operator.leader")

ENV_POD_NAME = "IWG_OPERATOR_POD_NAME"
DEFAULT_LEASE_NAME = "iwg-operator"


@dataclass(frozen=True)
class ElectionConfig:
    namespace: str
    name: str
    identity: str
    # client-go's defaults (and kube-controller-manager's): a lease of 15 s, renewed every 2 s, given up when
    # not renewed for 10 s.
    lease_duration: float = 15.0
    renew_deadline: float = 10.0
    retry_period: float = 2.0

    def __post_init__(self) -> None:
        if not self.lease_duration > self.renew_deadline > self.retry_period > 0:
            raise ValueError("need lease duration > renew deadline > retry period > 0")


def default_identity() -> str:
    """The pod's name (the chart sets it), else host name and a random suffix, as client-go's callers do."""
    return os.environ.get(ENV_POD_NAME) or f"{socket.gethostname()}_{uuid.uuid4()}"


def micro_time(at: float | None = None) -> str:
    """A Lease's MicroTime: RFC 3339 with microseconds."""
    moment = datetime.fromtimestamp(time.time() if at is None else at, UTC)
    return moment.strftime("%Y-%m-%dT%H:%M:%S.%fZ")


class LeaderElector:
    """One candidate's view of the Lease: try to acquire, renew, release."""

    def __init__(self, kube: KubeApi, config: ElectionConfig, clock: Callable[[], float] = time.monotonic):
        self.kube = kube
        self.config = config
        self.clock = clock
        self._observed: Mapping[str, Any] | None = None  # the Lease's spec as last read
        self._observed_at = 0.0  # when it last changed, by our clock (never the holder's: clocks skew)
        self._resource_version: str | None = None

    @property
    def observed_holder(self) -> str | None:
        return None if self._observed is None else self._observed.get("holderIdentity")

    def _observe(self, lease: Mapping[str, Any]) -> None:
        spec = dict(lease.get("spec") or {})
        if spec != self._observed:
            self._observed, self._observed_at = spec, self.clock()
        self._resource_version = lease.get("metadata", {}).get("resourceVersion")

    def _spec(self, acquire_time: str, transitions: int) -> dict[str, Any]:
        return {
            "holderIdentity": self.config.identity,
            "leaseDurationSeconds": int(self.config.lease_duration),
            "acquireTime": acquire_time,
            "renewTime": micro_time(),
            "leaseTransitions": transitions,
        }

    async def try_acquire_or_renew(self) -> bool:
        """One round of client-go's tryAcquireOrRenew: True when this candidate holds the Lease after it."""
        cfg = self.config
        lease = await self.kube.get(LEASES, cfg.namespace, cfg.name)
        if lease is None:
            body = {
                "apiVersion": LEASES.api_version,
                "kind": LEASES.kind,
                "metadata": {"name": cfg.name, "namespace": cfg.namespace},
                "spec": self._spec(micro_time(), 0),
            }
            try:
                self._observe(await self.kube.create(LEASES, cfg.namespace, body))
            except ApiError as error:
                if error.status == 409:  # another candidate created it first
                    return False
                raise
            return True
        self._observe(lease)
        spec = self._observed or {}
        holder = spec.get("holderIdentity") or ""
        duration = float(spec.get("leaseDurationSeconds") or cfg.lease_duration)
        ours = holder == cfg.identity
        if holder and not ours and self._observed_at + duration > self.clock():
            return False  # held, and renewed within a lease duration as far as we have seen
        transitions = int(spec.get("leaseTransitions") or 0)
        acquired = str(spec.get("acquireTime") or "") if ours else micro_time()
        body = {
            "apiVersion": LEASES.api_version,
            "kind": LEASES.kind,
            "metadata": {
                "name": cfg.name,
                "namespace": cfg.namespace,
                "resourceVersion": self._resource_version,
            },
            "spec": self._spec(acquired or micro_time(), transitions if ours else transitions + 1),
        }
        try:
            self._observe(await self.kube.replace(LEASES, cfg.namespace, cfg.name, body))
        except ApiError as error:
            if error.status == 409:  # someone else wrote it since we read it
                return False
            raise
        return True

    async def acquire(self) -> None:
        """Returns once this candidate holds the Lease; until then it reads the Lease every retry period."""
        reported: str | None = None
        while True:
            try:
                if await self.try_acquire_or_renew():
                    log.warning("leader election: %s leads (lease %s/%s)", self.config.identity,
                                self.config.namespace, self.config.name)  # fmt: skip
                    return
                if self.observed_holder != reported:
                    reported = self.observed_holder
                    log.warning("leader election: standing by, %s leads", reported)
            except Exception as error:  # the API server unreachable, a 403: try again
                log.warning("leader election: cannot read or write the lease: %s", error)
            await asyncio.sleep(self.config.retry_period)

    async def keep(self) -> None:
        """Renews every retry period; returns when the Lease could not be renewed within the renew deadline
        (or another candidate holds it): the caller must stop leading at once."""
        cfg = self.config
        renewed = self.clock()
        while True:
            await asyncio.sleep(cfg.retry_period)
            while True:
                left = renewed + cfg.renew_deadline - self.clock()
                if left <= 0:
                    log.error("leader election: lease not renewed within %.0f s", cfg.renew_deadline)
                    return
                started = self.clock()
                try:
                    if await asyncio.wait_for(self.try_acquire_or_renew(), timeout=left):
                        renewed = started
                        break
                    log.error("leader election: %s holds the lease now", self.observed_holder)
                    return
                except Exception as error:
                    log.warning("leader election: renewing the lease: %r", error)
                await asyncio.sleep(
                    min(cfg.retry_period, max(0.0, renewed + cfg.renew_deadline - self.clock()))
                )

    async def release(self) -> None:
        """Gives the Lease up (holder cleared, duration 1 s) if this candidate still holds it, as client-go's
        ReleaseOnCancel: a standby takes over at its next retry instead of a lease duration later."""
        cfg = self.config
        lease = await self.kube.get(LEASES, cfg.namespace, cfg.name)
        if lease is None or (lease.get("spec") or {}).get("holderIdentity") != cfg.identity:
            return
        spec = dict(lease["spec"])
        spec.update(holderIdentity="", leaseDurationSeconds=1, renewTime=micro_time())
        body = {**lease, "spec": spec}
        await self.kube.replace(LEASES, cfg.namespace, cfg.name, body)
        log.warning("leader election: %s released the lease", cfg.identity)


def exit_now() -> None:
    """Stop leading the only way that cannot hang: end the process (kube-controller-manager does the same).
    The operator keeps no state of its own on the groups (no finalizer, no annotation): nothing to undo."""
    sys.stderr.write("leader election: leadership lost, exiting\n")
    sys.stderr.flush()
    os._exit(1)


class Election:
    """The elector in a thread of its own: `leading` is set once this process holds the Lease; from then on
    the thread renews it and calls `on_lost` when it cannot."""

    def __init__(
        self,
        config: ElectionConfig,
        connect: Callable[[], Connection] = Connection.from_environment,
        on_lost: Callable[[], None] = exit_now,
    ) -> None:
        self.config = config
        self.connect = connect
        self.on_lost = on_lost
        self.leading = threading.Event()
        self.heartbeat = (
            time.monotonic()
        )  # the thread's loop turns (the standby's liveness endpoint reads it)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._released = threading.Event()
        self._thread = threading.Thread(target=self._main, name="leader-election", daemon=True)

    def start(self) -> Election:
        self._thread.start()
        return self

    def alive(self) -> bool:
        return self._thread.is_alive() and time.monotonic() - self.heartbeat < 3 * self.config.lease_duration

    def release(self, timeout: float = 5.0) -> None:
        """After a graceful stop: stop renewing and give the Lease up (waits at most `timeout`)."""
        loop, stop = self._loop, self._stop
        if loop is not None and stop is not None and self._thread.is_alive():
            loop.call_soon_threadsafe(stop.set)
            self._released.wait(timeout)

    def _main(self) -> None:
        asyncio.run(self._run())

    async def _beat(self) -> None:
        while True:
            self.heartbeat = time.monotonic()
            await asyncio.sleep(1.0)

    async def _run(self) -> None:
        self._loop, self._stop = asyncio.get_running_loop(), asyncio.Event()
        beat = asyncio.create_task(self._beat())
        kube = KubeApi(self.connect(), max_connections=2, timeout=self.config.renew_deadline)
        elector = LeaderElector(kube, self.config)
        try:
            await elector.acquire()
            self.leading.set()
            keep = asyncio.create_task(elector.keep())
            stop = asyncio.create_task(self._stop.wait())
            await asyncio.wait({keep, stop}, return_when=asyncio.FIRST_COMPLETED)
            if keep.done():
                self.on_lost()
                return
            keep.cancel()
            try:
                await asyncio.wait_for(elector.release(), timeout=self.config.retry_period)
            except Exception as error:
                log.warning("leader election: releasing the lease: %r", error)
        finally:
            beat.cancel()
            await kube.close()
            self._released.set()


def serve_standby_liveness(url: str, election: Election) -> ThreadingHTTPServer:
    """The liveness endpoint while standing by (Kopf serves it once this process leads): 200 while the
    election thread runs. Close it before Kopf binds the same address."""
    parts = urlsplit(url)
    path = parts.path or "/"

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            ok = self.path.split("?")[0] == path and election.alive()
            body = b'{"leader": false}' if ok else b"{}"
            self.send_response(200 if ok else 503)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *_: Any) -> None:
            pass

    server = ThreadingHTTPServer((parts.hostname or "0.0.0.0", parts.port or 80), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, name="standby-liveness", daemon=True).start()
    return server
