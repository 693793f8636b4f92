"""`WorkerProc`: the process around one worker, and `main()` for the ``iwg-worker`` console script.

Start order: wrapper -> init_worker -> init_device (joins torch.distributed when world size > 1) ->
load_model -> sockets -> hello -> busy loop. The busy loop reads calls from ``rpc_broadcast_mq`` (a DEALER
connected to the driver's RPC endpoint; one per driver, see below), runs them one at a time, and hands
replies to the output path (``worker_response_mq``, a PUSH connected to the driver's response endpoint). Under
`MultiprocExecutor` a small reply is written straight into its reply FIFO instead (`executor.reply_pipe`),
when that FIFO has room. A reply is sent straight from the busy loop only when that cannot block (nothing
queued, a non-blocking send succeeds); otherwise the output thread sends it, so sending never holds up the
next execution. The output thread also sends the
heartbeats. Errors become structured replies and the loop keeps serving.

Stopping. SIGINT (and a local executor's shutdown, or its death: `parent_watch`): the in-flight call finishes
(heartbeats go on meanwhile, however long it runs, with ``capabilities.draining`` set from the next one, so the
drivers send the replica nothing new), a goodbye is sent (no heartbeat after
it), the process exits 0. SIGTERM (an evicted or deleted pod) drains first, as a generation
server must: a heartbeat goes to every driver at once with ``capabilities.draining`` set, so the drivers send
the replica nothing new (one rank draining drains its replica), and the worker serves on (calls, the engine's
streams) until its replica runs no generation request and, on a sharded replica, two heartbeat intervals
have passed (what a driver sent before it read the news runs too), or ``drain_timeout_s``
(`wiring.WORKER_DRAIN_S`) has passed, when what still runs is cut; then the goodbye, exit 0. A worker without a
generation engine (one call at a time) stops after its in-flight call, as on SIGINT.

Several drivers: the endpoints may be comma-separated lists (paired by position), and a tcp host name is
resolved to every address it has (the operator gives the drivers' headless Service, one address per driver
pod), again every heartbeat (a lookup that fails keeps the drivers the name gave last). The worker keeps one
link (a DEALER and a PUSH) per driver, serves the calls of every link in turn and replies on the link the
call came from; heartbeats, goodbyes and streamed output go to every link (a driver drops stream items of
requests it does not know). A link whose address left the name is closed.

Links are independent: nothing sent to one driver waits for another. Every send is non-blocking; a message
its socket has no room for waits in that link's own backlog (at most ``MAX_BACKLOG`` messages, in order), and
a driver that takes nothing for the driver timeout, or is lost, has its messages dropped (counted in
``iwg_worker_dropped_messages_total``) instead of held: a dead driver costs the others nothing.

Driver loss: a driver pings every member once per heartbeat interval. When no ping has come on a link for
``heartbeat_interval_s * DEFAULT_HEARTBEAT_MISSES`` (counted from the link's opening when no ping ever came)
the worker logs that the driver is lost and keeps its model loaded; ZMQ reconnects the link's sockets to the
same address, the heartbeats that keep going out introduce the worker to the driver that comes up there, and
its first ping ends the loss.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import queue
import select
import signal
import socket
import sys
import threading
import time
import traceback
import uuid
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any, cast
from urllib.parse import urlsplit

import zmq
from iwg_operator.api import wiring
from iwg_operator.api.v1alpha1 import resolve_model_path
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from iwg_worker import parent_watch, protocol
from iwg_worker.executor import reply_pipe, shm_ring
from iwg_worker.health_server import HealthServer
from iwg_worker.method_registry import UnknownMethodError
from iwg_worker.security import CurveKeys, make_client
from iwg_worker.worker_base import WorkerConfig
from iwg_worker.worker_wrapper import WorkerWrapperBase

log = logging.getLogger("iwg_worker.worker_proc")

DEFAULT_WORKER_CLS = "iwg_worker.torch_worker.TorchWorker"
LIVENESS_TIMEOUT_S = 30.0
OVERFLOW_WAIT_S = 10.0
MAX_BACKLOG = 1024  # messages a link holds for a driver that is slow to take them (beyond ZMQ's own queue)
BACKLOG_RETRY_S = 0.005  # how soon the output thread tries a backlog again
CLOSE_FLUSH_S = 1.0  # how long a closing worker keeps trying to hand its backlogs (goodbyes) to live drivers
DRAIN_POLL_S = 0.05  # how often a draining worker looks whether its replica still runs anything
# A rank of a sharded replica that drains stays at least this many heartbeat intervals, even with nothing
# running: a request a driver sent before it read the draining heartbeat still arrives at rank 0 (which tells
# the other ranks at its next step) and must run to its end, not be cut after its first tokens by this rank's
# goodbye. An unsharded worker leaves at once: such a request finds it gone before any output and the driver
# retries it on another replica (a stay there delayed a scale to zero's leaving replica past its undrain).
DRAIN_SETTLE_HEARTBEATS = 2


def process_age_s() -> float | None:
    """Seconds since this process started, as the kernel counts them (/proc; None where there is none)."""
    try:
        fields = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
        uptime = float(Path("/proc/uptime").read_text().split()[0])
        return max(0.0, uptime - int(fields[19]) / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return None


@dataclass(frozen=True, slots=True)
class WorkerProcConfig:
    worker: WorkerConfig
    rpc_endpoint: str
    response_endpoint: str
    curve_dir: str | None = None
    insecure_tcp: bool = False
    health_host: str = "127.0.0.1"
    health_port: int = wiring.DEFAULT_HEALTH_PORT
    heartbeat_interval_s: float = wiring.DEFAULT_HEARTBEAT_INTERVAL_S
    pod_name: str = ""
    incarnation: int = 0  # wiring.INCARNATION: which creation of this rank the pod is
    worker_cls: str = DEFAULT_WORKER_CLS
    worker_extension_cls: str | None = None
    ring_path: str = ""  # a MultiprocExecutor's ring to read calls from, with:
    ring_reader: int = 0
    ring_wake: str = ""
    ring_spin_s: float = shm_ring.DEFAULT_SPIN_S
    reply_pipe: str = ""  # a MultiprocExecutor's FIFO for small replies
    drain_timeout_s: float = wiring.WORKER_DRAIN_S  # after SIGTERM, the longest a generation worker drains
    send_queue: int = wiring.DEFAULT_SEND_QUEUE  # ZMQ's send high-water mark of each link's sockets

    def __post_init__(self) -> None:
        rpc, response = self.rpc_endpoint.split(","), self.response_endpoint.split(",")
        if len(rpc) != len(response):
            raise ValueError(
                f"{wiring.RPC_ENDPOINT} lists {len(rpc)} endpoints and {wiring.RESPONSE_ENDPOINT} {len(response)}: "
                "one of each per driver"
            )
        for name, endpoint in [(wiring.RPC_ENDPOINT, e) for e in rpc] + [
            (wiring.RESPONSE_ENDPOINT, e) for e in response
        ]:
            if not endpoint.startswith(("tcp://", "ipc://", "inproc://")):
                raise ValueError(f"{name} must be tcp://host:port or ipc://path, got {endpoint!r}")
            if endpoint.startswith("tcp://") and not self.curve_dir and not self.insecure_tcp:
                raise ValueError(f"{name} is tcp but {wiring.CURVE_DIR} is not set: tcp needs CURVE")
        if self.heartbeat_interval_s <= 0:
            raise ValueError(f"{wiring.HEARTBEAT_INTERVAL} must be > 0, got {self.heartbeat_interval_s}")
        if self.send_queue < 1:
            raise ValueError(f"{wiring.SEND_QUEUE} must be >= 1, got {self.send_queue}")

    @classmethod
    def from_env(cls, environ: dict[str, str] | None = None) -> WorkerProcConfig:
        env = dict(os.environ if environ is None else environ)

        def need(name: str) -> str:
            value = env.get(name)
            if not value:
                raise ValueError(f"environment variable {name} is required")
            return value

        def integer(name: str, default: int) -> int:
            raw = env.get(name)
            if not raw:
                return default
            try:
                return int(raw)
            except ValueError:
                raise ValueError(f"environment variable {name} must be an integer, got {raw!r}") from None

        def fraction(name: str) -> float | None:
            raw = env.get(name)
            if not raw:
                return None
            try:
                value = float(raw)
            except ValueError:
                value = -1.0
            if not 0.0 < value <= 1.0:
                raise ValueError(f"environment variable {name} must be a number in (0, 1], got {raw!r}")
            return value

        try:
            heartbeat = float(env.get(wiring.HEARTBEAT_INTERVAL) or wiring.DEFAULT_HEARTBEAT_INTERVAL_S)
        except ValueError:
            raise ValueError(f"environment variable {wiring.HEARTBEAT_INTERVAL} must be a number") from None
        worker = WorkerConfig(
            task=env.get(wiring.MODEL_TASK) or "none",  # type: ignore[arg-type]  # validated by WorkerConfig
            model_path=str(resolve_model_path(raw_path))
            if (raw_path := env.get(wiring.MODEL_PATH, ""))
            else "",
            served_name=env.get(wiring.SERVED_NAME, ""),
            device=env.get(wiring.DEVICE) or "auto",  # type: ignore[arg-type]
            dtype=env.get(wiring.DTYPE) or "auto",  # type: ignore[arg-type]
            engine=env.get(wiring.ENGINE) or "auto",  # type: ignore[arg-type]
            enforce_eager=env.get(wiring.ENFORCE_EAGER) == "1",
            chat_template=env.get(wiring.CHAT_TEMPLATE) or None,
            group=env.get(wiring.GROUP) or "local",
            replica=integer(wiring.REPLICA, 0),
            rank=integer(wiring.RANK, 0),
            world_size=integer(wiring.WORLD_SIZE, 1),
            kv_cache_blocks=integer(wiring.KV_CACHE_BLOCKS, 0) or None,
            kv_cache_memory_fraction=fraction(wiring.KV_CACHE_MEMORY_FRACTION),
        )
        return cls(
            worker=worker,
            rpc_endpoint=need(wiring.RPC_ENDPOINT),
            response_endpoint=need(wiring.RESPONSE_ENDPOINT),
            curve_dir=env.get(wiring.CURVE_DIR) or None,
            insecure_tcp=env.get(wiring.INSECURE_TCP) == "1",
            health_host=env.get(wiring.POD_IP) or "127.0.0.1",
            health_port=integer(wiring.HEALTH_PORT, wiring.DEFAULT_HEALTH_PORT),
            heartbeat_interval_s=heartbeat,
            pod_name=env.get(wiring.POD_NAME) or f"{os.uname().nodename}-{os.getpid()}",
            incarnation=integer(wiring.INCARNATION, 0),
            worker_cls=env.get(wiring.WORKER_CLS) or DEFAULT_WORKER_CLS,
            worker_extension_cls=env.get(wiring.WORKER_EXTENSION_CLS) or None,
            ring_path=env.get(shm_ring.ENV_PATH, ""),
            ring_reader=integer(shm_ring.ENV_READER, 0),
            ring_wake=env.get(shm_ring.ENV_WAKE, ""),
            ring_spin_s=integer(shm_ring.ENV_SPIN_US, round(shm_ring.DEFAULT_SPIN_S * 1e6)) / 1e6,
            reply_pipe=env.get(reply_pipe.ENV_PATH, ""),
            send_queue=integer(wiring.SEND_QUEUE, wiring.DEFAULT_SEND_QUEUE),
        )


def driver_endpoints(
    rpc_endpoints: str,
    response_endpoints: str,
    last_named: dict[tuple[str, str], list[tuple[str, str]]] | None = None,
) -> list[tuple[str, str]]:
    """Every driver the endpoints name, as (rpc, response) pairs: a tcp host name resolves to one pair per
    address it has; an address, ipc or inproc is itself. A name that does not resolve gives what it named the
    last time it did (`last_named`, kept up to date here), or none: a failed lookup (a DNS server restarting or
    too slow to answer) says nothing about the drivers, and closing their links would fail every call they have
    in flight on this worker."""
    pairs: list[tuple[str, str]] = []
    for rpc_endpoint, response_endpoint in zip(
        rpc_endpoints.split(","), response_endpoints.split(","), strict=True
    ):
        if not rpc_endpoint.startswith("tcp://"):
            pairs.append((rpc_endpoint, response_endpoint))
            continue
        rpc, response = urlsplit(rpc_endpoint), urlsplit(response_endpoint)
        name = (rpc_endpoint, response_endpoint)
        try:
            infos = socket.getaddrinfo(rpc.hostname, None, type=socket.SOCK_STREAM)
        except (socket.gaierror, UnicodeError):
            pairs.extend((last_named or {}).get(name, ()))
            continue
        named = []
        for address in sorted({str(info[4][0]) for info in infos}):
            host = f"[{address}]" if ":" in address else address
            named.append((f"tcp://{host}:{rpc.port}", f"tcp://{host}:{response.port}"))
        if last_named is not None:
            last_named[name] = named
        pairs.extend(named)
    return list(dict.fromkeys(pairs))


def _request_ids(call: protocol.Call) -> list[str]:
    """The ids of the generation requests an ``engine_add`` call carries."""
    requests = call.args[0] if call.args else None
    if not isinstance(requests, list):
        return []
    return [r["id"] for r in requests if isinstance(r, dict) and isinstance(r.get("id"), str)]


def _cancelled_ids(call: protocol.Call) -> list[str]:
    """The ids of the generation requests an ``engine_cancel`` call names."""
    ids = call.args[0] if call.args else None
    if not isinstance(ids, list):
        return []
    return [rid for rid in ids if isinstance(rid, str)]


@dataclass(eq=False, slots=True)
class _DriverLink:
    """One driver: calls and pings come in on ``rpc`` (DEALER), hello, heartbeats, replies and goodbye go out
    on ``response`` (PUSH). Created and closed by the busy loop; ``response``, ``backlog``, ``stalled_since``
    and ``dropped`` are used under the send lock."""

    endpoints: tuple[str, str]
    rpc: zmq.Socket[bytes]
    response: zmq.Socket[bytes]
    opened_at: float = field(default_factory=time.monotonic)
    last_ping: float | None = None
    lost: bool = False
    last_call: int | None = None
    closed: bool = False
    backlog: deque[list[Any]] = field(default_factory=deque)  # waiting for room on ``response``, in order
    stalled_since: float | None = None  # since when ``response`` has had no room (None: it takes messages)
    dropped: int = 0
    dropping: bool = False  # dropped since it last took a message (logged once per episode)


class _Metrics:
    def __init__(self, wrapper: WorkerWrapperBase) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter("iwg_worker_requests", "Calls served", ["method"], registry=self.registry)
        self.errors = Counter("iwg_worker_errors", "Calls that raised", ["method"], registry=self.registry)
        self.rejected = Counter(
            "iwg_worker_rejected_messages", "Malformed messages dropped", registry=self.registry
        )
        self.dropped = Counter(
            "iwg_worker_dropped_messages",
            "Outgoing messages dropped for a driver that was lost or took nothing for the driver timeout",
            registry=self.registry,
        )
        self.step = Histogram(
            "iwg_worker_step_seconds",
            "Call duration",
            ["method"],
            registry=self.registry,
            buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
        )
        self._children: dict[str, tuple[Any, Any, Any]] = {}
        free = Gauge("iwg_worker_device_memory_free_bytes", "Free device memory", registry=self.registry)
        total = Gauge("iwg_worker_device_memory_total_bytes", "Total device memory", registry=self.registry)
        free.set_function(lambda: float(wrapper.require_worker().get_memory_info()[0]))
        total.set_function(lambda: float(wrapper.require_worker().get_memory_info()[1]))

    def for_method(self, method: str) -> tuple[Any, Any, Any]:
        """(requests, errors, step) children for one method label, looked up once."""
        children = self._children.get(method)
        if children is None:
            children = self._children[method] = (
                self.requests.labels(method),
                self.errors.labels(method),
                self.step.labels(method),
            )
        return children


class WorkerProc:
    def __init__(self, config: WorkerProcConfig) -> None:
        self.config = config
        self.replica = config.worker.replica
        self.rank = config.worker.rank
        self.wrapper = WorkerWrapperBase(rpc_rank=0)
        self.wrapper.init_worker(
            [
                {
                    "worker_cls": config.worker_cls,
                    "worker_extension_cls": config.worker_extension_cls,
                    "config": config.worker,
                }
            ]
        )
        self.metrics = _Metrics(self.wrapper)
        self._stopping = threading.Event()
        # SIGTERM's drain: asked for (set by the signal handler alone), started (its deadline, busy loop).
        self._drain_requested = False
        self._drain_deadline: float | None = None
        self._drain_settled_at = 0.0  # before it, a drain does not end even with nothing running
        self._drain_check_at = 0.0
        self._beat_now = False  # the output thread sends a heartbeat at its next turn (the drain's news)
        self._loop_tick = time.monotonic()
        self._in_flight: tuple[str, float | None] | None = None
        self._driver_timeout_s = config.heartbeat_interval_s * wiring.DEFAULT_HEARTBEAT_MISSES
        self._model_loaded = False
        self._load_began = self._load_done = time.monotonic()
        self.health = HealthServer(
            config.health_host, config.health_port, self._liveness, self._readiness, self.metrics.registry
        )
        self.health.start()
        worker = self.wrapper.require_worker()
        self._load_began = time.monotonic()
        worker.init_device()
        worker.load_model()
        self._load_done = time.monotonic()
        self._model_loaded = True
        # The model's and libraries' objects live as long as the process: out of the collector's sight, a full
        # collection no longer walks them (0.7-0.9 s with SmolLM2 loaded, every thread stopped: a missed
        # heartbeat at short intervals, a pause in every stream). vLLM's EngineCore does the same.
        gc.collect()
        gc.freeze()

        self._context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self.routing_id = f"{self.replica}/{self.rank}/{uuid.uuid4().hex[:8]}".encode()
        self._keys = CurveKeys.load(config.curve_dir) if config.curve_dir else None
        self._send_lock = threading.Lock()
        # What each driver name resolved to last (a failed lookup keeps it: `driver_endpoints`).
        self._named: dict[tuple[str, str], list[tuple[str, str]]] = {}
        # The drivers to link to (the resolver thread's latest answer) and the links (the busy loop's; a new
        # list on every change, so other threads read a consistent one without a lock).
        self._wanted: tuple[tuple[str, str], ...] = tuple(
            driver_endpoints(config.rpc_endpoint, config.response_endpoint, self._named)
        )
        self.links: list[_DriverLink] = []
        # Messages whose sender found the send lock taken: the next holder of the lock moves them to their
        # links' backlogs before anything else, so each link's messages keep their order.
        self._outbox: queue.SimpleQueue[tuple[_DriverLink, list[Any]]] = queue.SimpleQueue()
        self._wake = threading.Event()  # the output thread has an outbox or a backlog to look at
        self._sync_links()
        self.ring = (
            shm_ring.RingReader(config.ring_path, config.ring_reader, config.ring_wake, config.ring_spin_s)
            if config.ring_path
            else None
        )
        self.reply_pipe = reply_pipe.ReplyPipeWriter(config.reply_pipe) if config.reply_pipe else None
        self._overflowed: dict[int, protocol.Call] = {}  # calls too large for the ring, before their marker
        # Generation requests by the driver link that started them: a step's items go to their own driver,
        # and a driver's requests are cancelled when it is lost (no reader is left for them).
        self._stream_links: dict[str, _DriverLink] = {}
        self._stream_lock = threading.Lock()
        streams = Gauge(
            "iwg_worker_streams",
            "Generation requests this worker streams to a driver",
            registry=self.metrics.registry,
        )
        streams.set_function(lambda: float(len(self._stream_links)))
        self._output_closing = False
        self._said_goodbye = False  # close() has sent (or queued) the goodbyes: no heartbeat may follow
        self._output_thread = threading.Thread(target=self._output_loop, name="iwg-output", daemon=True)
        self._output_thread.start()
        if any(e.startswith("tcp://") for e in config.rpc_endpoint.split(",")):
            resolver = threading.Thread(target=self._resolve_loop, name="iwg-resolver", daemon=True)
            resolver.start()
        worker.set_stream_sink(self._emit_stream)
        log.info(
            "worker replica %d rank %d/%d ready on %s (%s), health on :%d",
            self.replica,
            self.rank,
            config.worker.world_size,
            worker.check_health().get("device"),
            config.worker.task,
            self.health.port,
        )

    # -- probes ----------------------------------------------------------------------------------------

    def _liveness(self) -> tuple[bool, dict[str, Any]]:
        now = time.monotonic()
        in_flight = self._in_flight
        loop_age = now - self._loop_tick
        if in_flight is not None:
            _method, deadline = in_flight
            alive = deadline is None or time.time() < deadline + LIVENESS_TIMEOUT_S
        else:
            alive = loop_age < LIVENESS_TIMEOUT_S
        report = self.wrapper.require_worker().check_health()
        alive = alive and bool(report.get("device_available"))
        return alive, {
            "alive": alive,
            "busy_loop_age_s": round(loop_age, 3),
            "in_flight": in_flight[0] if in_flight else None,
            "drivers": [
                {
                    "endpoint": link.endpoints[0],
                    "ping_age_s": None if link.last_ping is None else round(now - link.last_ping, 3),
                    "connected": link.last_ping is not None and not link.lost,
                    "lost": link.lost,
                    "backlog": len(link.backlog),
                    "dropped": link.dropped,
                }
                for link in self.links
            ],
            "replica": self.replica,
            "rank": self.rank,
            "worker": report,
        }

    def _readiness(self) -> tuple[bool, dict[str, Any]]:
        draining = self._stopping.is_set() or self._drain_deadline is not None
        ready = self._model_loaded and not draining
        return ready, {"ready": ready, "model_loaded": self._model_loaded, "draining": draining}

    # -- output path -----------------------------------------------------------------------------------

    def _hello(self, kind: str) -> list[Any]:
        worker = self.wrapper.require_worker()
        health = worker.check_health()
        return protocol.encode_hello(
            protocol.Hello(
                kind=kind,
                group=self.config.worker.group,
                replica=self.replica,
                rank=self.rank,
                world_size=self.config.worker.world_size,
                pod=self.config.pod_name,
                routing_id=self.routing_id,
                capabilities={
                    "task": self.config.worker.task,
                    "served_name": self.config.worker.served_name,
                    "device": health.get("device"),
                    "cpu": health.get("cpu"),
                    "health_port": self.health.port,
                    "pid": os.getpid(),
                    "incarnation": self.config.incarnation,
                    "startup": self._startup(),
                    # Draining after SIGTERM, or stopping after SIGINT (it runs what it has, then leaves): no new
                    # requests for this replica (drivers that know the key).
                    **(
                        {"draining": True}
                        if self._drain_deadline is not None or self._stopping.is_set()
                        else {}
                    ),
                },
            )
        )

    def _startup(self) -> dict[str, float | None]:
        """How this process started, in seconds before now (the driver splits a cold start with it): since the
        process started (the kernel's count; None off Linux), since its model began loading, since it had."""
        now = time.monotonic()
        return {
            "age_s": process_age_s(),
            "load_began_s_ago": now - self._load_began,
            "load_done_s_ago": now - self._load_done,
        }

    def _emit(self, frames: list[Any], link: _DriverLink) -> None:
        """Send ``frames`` to ``link``'s driver, or hold them in its backlog; never waits (any thread). When
        the send lock is taken, the message goes to the outbox, which the lock's next holder empties first."""
        if not self._send_lock.acquire(blocking=False):
            self._outbox.put((link, frames))
            self._wake.set()
            return
        try:
            self._drain_outbox()
            self._offer(link, frames)
            held = bool(link.backlog)
        finally:
            self._send_lock.release()
        if held:
            self._wake.set()

    def _drain_outbox(self) -> None:
        """Offer the outbox's messages, oldest first (under the send lock)."""
        while not self._outbox.empty():
            try:
                link, frames = self._outbox.get_nowait()
            except queue.Empty:
                return
            self._offer(link, frames)

    def _not_reading(self, link: _DriverLink, now: float) -> bool:
        stalled = link.stalled_since is not None and now - link.stalled_since > self._driver_timeout_s
        return link.lost or stalled

    def _offer(self, link: _DriverLink, frames: list[Any]) -> None:
        """Send without waiting, behind the link's backlog; no room: into the backlog, unless the driver is
        lost or took nothing for the driver timeout, or the backlog is full: then the message is dropped
        (under the send lock)."""
        if link.closed:
            return
        now = time.monotonic()
        if not link.backlog:
            try:
                link.response.send_multipart(frames, flags=zmq.NOBLOCK, copy=False)
            except zmq.Again:
                if link.stalled_since is None:
                    link.stalled_since = now
            else:
                self._took(link)
                return
        if len(link.backlog) >= MAX_BACKLOG or self._not_reading(link, now):
            self._drop(link, 1)
            return
        link.backlog.append(frames)

    def _flush(self, link: _DriverLink) -> None:
        """Send what the link's backlog holds while its socket has room; drop it all when the driver is lost
        or took nothing for the driver timeout (under the send lock)."""
        if link.closed:
            link.backlog.clear()
            return
        while link.backlog:
            try:
                link.response.send_multipart(link.backlog[0], flags=zmq.NOBLOCK, copy=False)
            except zmq.Again:
                if link.stalled_since is None:
                    link.stalled_since = time.monotonic()
                break
            link.backlog.popleft()
            self._took(link)
        if link.backlog and self._not_reading(link, time.monotonic()):
            self._drop(link, len(link.backlog))
            link.backlog.clear()

    def _took(self, link: _DriverLink) -> None:
        link.stalled_since = None
        if link.dropping:
            link.dropping = False
            log.info("driver on %s takes messages again (%d dropped so far)", link.endpoints[0], link.dropped)

    def _drop(self, link: _DriverLink, count: int) -> None:
        link.dropped += count
        self.metrics.dropped.inc(count)
        if not link.dropping:
            link.dropping = True
            log.warning(
                "driver on %s is %s; dropping messages to it until it takes them again",
                link.endpoints[0],
                "lost" if link.lost else f"taking nothing for over {self._driver_timeout_s:.1f} s",
            )

    def _emit_reply(self, frames: list[Any], link: _DriverLink) -> None:
        """A reply: through the reply FIFO when there is one and the reply is one small frame (replies are
        matched by id, so it may overtake messages on the socket), else as `_emit`."""
        pipe = self.reply_pipe
        if pipe is not None and len(frames) == 1 and pipe.send(frames[0]):
            return
        self._emit(frames, link)

    def _emit_stream(self, items: list[dict[str, Any]]) -> None:
        """One engine step's output of every running request (called on the engine's thread): one message to
        each driver with items of its own requests (an item of a request no link is known for goes to all).
        Sent under the stream lock: a request's final item is on its way before its owner is gone from
        ``_stream_links``, which a drain counts (its goodbye must come after every final item)."""
        by_link: dict[int, tuple[_DriverLink | None, list[dict[str, Any]]]] = {}
        with self._stream_lock:
            for item in items:
                ended = item.get("finish_reason") is not None or item.get("error") is not None
                rid: str = item["id"]
                owner = self._stream_links.pop(rid, None) if ended else self._stream_links.get(rid)
                by_link.setdefault(id(owner), (owner, []))[1].append(item)
            for owner, owned in by_link.values():
                frames = protocol.encode_stream(self.replica, self.rank, owned)
                for link in [owner] if owner is not None else self.links:
                    self._emit(frames, link)

    def _own_streams(self, call: protocol.Call, link: _DriverLink) -> None:
        """Remember which driver starts the generation requests of an ``engine_add`` call."""
        with self._stream_lock:
            for rid in _request_ids(call):
                self._stream_links[rid] = link

    def _disown(self, request_ids: Iterable[str]) -> None:
        """Forget requests the engine refused (they never stream) or cancelled (they stream no more)."""
        with self._stream_lock:
            for rid in request_ids:
                self._stream_links.pop(rid, None)

    def _cancel_streams_of(self, link: _DriverLink) -> None:
        """A driver is gone: its generation requests stop on this worker (their cache is freed)."""
        with self._stream_lock:
            ids = [rid for rid, owner in self._stream_links.items() if owner is link]
            for rid in ids:
                del self._stream_links[rid]
        if ids:
            log.warning(
                "cancelling %d generation requests of the lost driver on %s", len(ids), link.endpoints[0]
            )
            try:
                self.wrapper.execute_method("engine_cancel", (ids,), {})
            except Exception:
                log.exception("cancelling the lost driver's generation requests failed")

    def _output_loop(self) -> None:
        """Heartbeats, and the messages their senders could not hand over at once: outbox and backlogs. Every
        send is non-blocking, so no link waits for another."""
        interval = self.config.heartbeat_interval_s
        next_beat = time.monotonic() + interval
        while True:
            wait = next_beat - time.monotonic()
            if any(link.backlog for link in self.links):
                wait = min(wait, BACKLOG_RETRY_S)
            self._wake.wait(max(0.0, wait))
            self._wake.clear()  # before the outbox is read: a message put after this wakes the next turn
            closing = self._output_closing
            with self._send_lock:
                self._drain_outbox()
                for link in self.links:
                    self._flush(link)
            if closing:
                self._flush_before_close()
                return
            if self._beat_now or time.monotonic() >= next_beat:
                self._beat_now = False
                beat = self._hello("heartbeat")
                next_beat = time.monotonic() + interval
                for link in self.links:
                    self._watch_driver(link)
                with self._send_lock:
                    # Until the goodbye: a worker stopping (SIGINT) still finishes its in-flight call, and a
                    # driver that heard no heartbeat for its timeout would count it lost and fail that call.
                    # After it, none: the driver would take the worker back.
                    if self._said_goodbye:
                        continue
                    for link in self.links:
                        self._offer(link, beat)

    def _flush_before_close(self) -> None:
        """Give the backlogs (the goodbyes among them) up to ``CLOSE_FLUSH_S`` to go out."""
        deadline = time.monotonic() + CLOSE_FLUSH_S
        while time.monotonic() < deadline:
            with self._send_lock:
                self._drain_outbox()
                for link in self.links:
                    self._flush(link)
                if not any(link.backlog for link in self.links):
                    return
            time.sleep(BACKLOG_RETRY_S)

    def _watch_driver(self, link: _DriverLink) -> None:
        """Log a driver's loss (no ping for the driver timeout; counted from the link's opening while none
        ever came) and its return (a ping again); the model stays loaded either way. Runs on the output thread
        once per heartbeat."""
        last = link.last_ping if link.last_ping is not None else link.opened_at
        silent = time.monotonic() - last
        if not link.lost and silent > self._driver_timeout_s:
            link.lost = True
            if link.last_ping is None:
                log.warning(
                    "no driver has reached this worker on %s in %.1f s; counting it as lost (messages that "
                    "find no room there are dropped) until one pings",
                    link.endpoints[0],
                    silent,
                )
            else:
                log.warning(
                    "driver lost: no ping for %.1f s on %s; keeping the model loaded and waiting for a driver "
                    "there",
                    silent,
                    link.endpoints[0],
                )
            self._cancel_streams_of(link)
        elif link.lost and link.last_ping is not None and silent <= self._driver_timeout_s:
            link.lost = False
            log.info("driver reached this worker again on %s; serving it", link.endpoints[0])

    # -- driver links ----------------------------------------------------------------------------------

    def _resolve_loop(self) -> None:
        """Resolve the drivers' names once per heartbeat; the busy loop links to what they name."""
        while not self._stopping.wait(self.config.heartbeat_interval_s):
            self._wanted = tuple(
                driver_endpoints(self.config.rpc_endpoint, self.config.response_endpoint, self._named)
            )

    def _sync_links(self) -> list[_DriverLink]:
        """Open a link to each driver newly named, close those no longer named (busy loop thread)."""
        wanted = self._wanted
        links = self.links
        if set(wanted) == {link.endpoints for link in links}:  # the links keep their own order
            return links
        kept = [link for link in links if link.endpoints in wanted]
        for link in links:
            if link.endpoints not in wanted:
                log.info("driver at %s is no longer named; closing its link", link.endpoints[0])
                with self._send_lock:
                    link.closed = True
                    link.backlog.clear()
                    link.rpc.close(linger=0)
                    link.response.close(linger=0)
                self._cancel_streams_of(link)
        known = {link.endpoints for link in kept}
        added = [self._open_link(pair) for pair in wanted if pair not in known]
        self.links = kept + added
        for link in added:
            self._emit(self._hello("hello"), link)
        return self.links

    def _open_link(self, endpoints: tuple[str, str]) -> _DriverLink:
        rpc = self._context.socket(zmq.DEALER)
        rpc.routing_id = self.routing_id
        rpc.rcvtimeo = 100  # a waiting busy loop wakes up for SIGTERM, new drivers and a fresh liveness tick
        response = self._context.socket(zmq.PUSH)
        for sock, endpoint in zip((rpc, response), endpoints, strict=True):
            sock.linger = 2000
            sock.sndhwm = self.config.send_queue
            if endpoint.startswith("tcp://["):
                sock.ipv6 = True
            if self._keys is not None and endpoint.startswith("tcp://"):
                make_client(sock, self._keys)
            sock.connect(endpoint)
        return _DriverLink(endpoints, rpc, response)

    # -- busy loop -------------------------------------------------------------------------------------

    def worker_busy_loop(self) -> None:
        if self.ring is not None:
            self._ring_busy_loop(self.ring)
            return
        polled: list[_DriverLink] | None = None
        poller = zmq.Poller()
        by_socket: dict[zmq.Socket[bytes], _DriverLink] = {}
        while self._keep_serving():
            self._loop_tick = time.monotonic()
            links = self._sync_links()
            if links is not polled:
                polled, poller = links, zmq.Poller()
                by_socket = {link.rpc: link for link in links}
                for link in links:
                    poller.register(link.rpc, zmq.POLLIN)
            if not links:
                self._stopping.wait(0.1)  # no driver named yet
                continue
            if len(links) == 1:
                # One driver: wait in the socket itself (a poller costs more than the rest of a small call).
                link = links[0]
                with contextlib.suppress(zmq.Again):  # rcvtimeo: see _open_link
                    self._take(link, 0)
                continue
            for sock, _event in poller.poll(100):
                with contextlib.suppress(zmq.Again):
                    self._take(by_socket[sock], zmq.NOBLOCK)

    def _take(self, link: _DriverLink, flags: int) -> None:
        message = self._decode(self._recv_socket(link, flags), link)
        if isinstance(message, protocol.Call):
            self._serve(message, link)
        elif message is not None:
            self._reject_kind(message)

    def _recv_socket(self, link: _DriverLink, flags: int) -> list[Any]:
        sock = link.rpc
        frames: list[Any] = [sock.recv(flags)]  # the header is small: a copy beats a zmq.Frame
        while sock.getsockopt(zmq.RCVMORE):
            frames.append(sock.recv(copy=False))  # tensor frames arrive without a copy
        return frames

    def _decode(self, frames: list[Any], link: _DriverLink) -> protocol.Message | None:
        """The message, or None after counting and logging a malformed one; pings are taken here."""
        try:
            message = protocol.decode(frames)
        except protocol.ProtocolError as exc:
            self.metrics.rejected.inc()
            log.warning("rejected a malformed message (%d frames): %s", len(frames), exc)
            return None
        if isinstance(message, protocol.Ping):
            link.last_ping = time.monotonic()
            return None
        return message

    def _reject_kind(self, message: protocol.Message) -> None:
        self.metrics.rejected.inc()
        log.warning("rejected a %s message on the request path", type(message).__name__)

    def _ring_busy_loop(self, ring: shm_ring.RingReader) -> None:
        """Calls come from the shared-memory ring, in order; the socket brings pings and the calls too large
        for the ring (each in the place of its ``overflow`` marker in the ring).

        After a message the loop polls the ring for ``spin_s``, then sleeps on the ring's wake-up FIFO and
        the socket (at most 100 ms, to notice SIGTERM and keep the liveness tick fresh), so an idle worker
        uses no CPU to speak of. The ring's executor is the one driver: one link, never re-resolved."""
        link = self.links[0]
        sock = link.rpc
        # Sleep in the kernel on the FIFO and the socket's signalling descriptor. That descriptor only says
        # "look" (edge-like), so the loop reads the socket's EVENTS before every sleep, and after every wake.
        poller = select.poll()
        poller.register(ring.wake_fd, select.POLLIN)
        poller.register(cast(int, sock.getsockopt(zmq.FD)), select.POLLIN)

        def sleep(timeout: float) -> bool:
            if cast(int, sock.getsockopt(zmq.EVENTS)) & zmq.POLLIN:
                return True
            return bool(poller.poll(round(timeout * 1000)))

        active = time.monotonic()
        while self._keep_serving():
            now = self._loop_tick = time.monotonic()
            try:
                message = ring.poll()
            except shm_ring.RingReadError as exc:
                self.metrics.rejected.inc()
                log.warning("rejected a malformed message in the ring: %s", exc)
                continue
            if message is not None:
                self._serve_ring(message, ring)
                active = time.monotonic()
                continue
            if cast(int, sock.getsockopt(zmq.EVENTS)) & zmq.POLLIN:
                self._take_socket_message(link)
                continue
            held = ring.release_held()
            if now - active < ring.spin_s:
                os.sched_yield()  # polling, but any other runnable process of this core goes first
                continue
            if ring.wait(0.001 if held else 0.1, also=sleep):  # held chunks: look again soon
                active = time.monotonic()

    def _take_socket_message(self, link: _DriverLink) -> None:
        try:
            frames = self._recv_socket(link, zmq.NOBLOCK)
        except zmq.Again:
            return
        message = self._decode(frames, link)
        if isinstance(message, protocol.Call):
            if len(self._overflowed) >= 64:
                self._overflowed.pop(next(iter(self._overflowed)))
            self._overflowed[message.id] = message  # runs when the ring reaches its marker
        elif message is not None:
            self._reject_kind(message)

    def _serve_ring(self, message: shm_ring.RingMessage, ring: shm_ring.RingReader) -> None:
        link = self.links[0]
        decoded = self._decode(message.frames, link)
        # Tensors decoded from the ring are views of it; without any, the chunk goes back before the call.
        released = message.release()
        if isinstance(decoded, protocol.Call):
            self._serve(decoded, link)
        elif isinstance(decoded, protocol.Overflow):
            call = self._await_overflowed(decoded.id, link)
            if call is not None:
                self._serve(call, link)
        elif decoded is not None:
            self._reject_kind(decoded)
        del decoded
        if not released and not message.release():
            ring.hold(message)  # a result still being sent, or a tensor the worker kept: later

    def _await_overflowed(self, call_id: int, link: _DriverLink) -> protocol.Call | None:
        """Call ``call_id``, which the executor sent on the socket right after its ring marker."""
        deadline = time.monotonic() + OVERFLOW_WAIT_S
        while call_id not in self._overflowed:
            left = deadline - time.monotonic()
            if left <= 0 or self._stopping.is_set():
                self.metrics.rejected.inc()
                log.warning("call %d was announced in the ring but did not come on the socket", call_id)
                return None
            if link.rpc.poll(round(min(left, 0.1) * 1000)):
                self._take_socket_message(link)
        return self._overflowed.pop(call_id)

    def _serve(self, call: protocol.Call, link: _DriverLink) -> None:
        link.last_call = call.id
        replies = call.reply_rank is None or call.reply_rank == self.rank
        if call.deadline is not None and time.time() > call.deadline:
            error = protocol.RemoteErrorInfo(
                "DeadlineExceeded", f"call {call.method!r} arrived after its deadline", ""
            )
            self._emit_reply(protocol.encode_reply(call.id, self.replica, self.rank, error=error), link)
            return
        label = call.method
        tracks_streams = call.method == "engine_add" and replies  # the answering rank is the one that streams
        if tracks_streams:
            self._own_streams(call, link)
        self._in_flight = (call.method, call.deadline)
        started = time.perf_counter()
        try:
            result = self.wrapper.execute_method(call.method, call.args, call.kwargs)
        except Exception as exc:
            if isinstance(exc, UnknownMethodError):
                label = "<unknown>"
            self.metrics.for_method(label)[1].inc()
            log.exception("call %r (id %d) failed", call.method, call.id)
            error = protocol.RemoteErrorInfo(type(exc).__name__, str(exc), traceback.format_exc())
            if (
                tracks_streams
            ):  # the driver fails these requests; anything that did start streams to every link
                self._disown(_request_ids(call))
            self._emit_reply(protocol.encode_reply(call.id, self.replica, self.rank, error=error), link)
            return
        finally:
            self._in_flight = None
            requests, _errors, step = self.metrics.for_method(label)
            requests.inc()
            step.observe(time.perf_counter() - started)
        if call.method == "engine_cancel":
            # A cancelled request sends no final item, which would otherwise be what forgets its owner.
            self._disown(_cancelled_ids(call))
        if tracks_streams and isinstance(result, list):
            self._disown(
                answer["id"]
                for answer in result
                if isinstance(answer, dict) and not answer.get("ok") and isinstance(answer.get("id"), str)
            )
        if replies:
            try:
                frames = protocol.encode_reply(call.id, self.replica, self.rank, result=result)
            except TypeError as exc:
                error = protocol.RemoteErrorInfo(
                    "TypeError", f"result of {call.method!r} cannot be sent: {exc}", traceback.format_exc()
                )
                frames = protocol.encode_reply(call.id, self.replica, self.rank, error=error)
            self._emit_reply(frames, link)

    # -- lifecycle -------------------------------------------------------------------------------------

    def request_stop(self, *_: Any) -> None:
        """Stop after the in-flight call (SIGINT)."""
        self._stopping.set()

    def request_drain(self) -> None:
        """Drain, then stop (SIGTERM; module docstring). Only sets a flag, so a signal handler may call it: the
        busy loop starts the drain (`_keep_serving`)."""
        self._drain_requested = True

    def _keep_serving(self) -> bool:
        """Whether the busy loop goes on: until a stop, or the end of a drain (busy loop thread)."""
        if self._drain_requested and self._drain_deadline is None and not self._stopping.is_set():
            self._start_drain()
        if self._stopping.is_set():
            return False
        if self._drain_deadline is None:
            return True
        now = time.monotonic()
        if now < self._drain_check_at:
            return True
        self._drain_check_at = now + DRAIN_POLL_S
        running = self._running_requests()
        if (running or now < self._drain_settled_at) and now < self._drain_deadline:
            return True
        if running:
            log.warning(
                "drain: %d generation request(s) still running after %.0f s; leaving now cuts them",
                running,
                self.config.drain_timeout_s,
            )
        else:
            log.info("drain: this replica runs nothing any more; leaving")
        self._stopping.set()
        return False

    def _start_drain(self) -> None:
        if self.config.worker.task != "generate":
            log.info("SIGTERM: no generation requests to drain; leaving")
            self._stopping.set()  # one call at a time: the busy loop is between calls, so it leaves now
            return
        now = time.monotonic()
        self._drain_deadline = now + self.config.drain_timeout_s
        if self.config.worker.world_size > 1:
            self._drain_settled_at = now + DRAIN_SETTLE_HEARTBEATS * self.config.heartbeat_interval_s
        self._beat_now = True  # tell the drivers now, not at the next heartbeat
        self._wake.set()
        log.info(
            "SIGTERM: draining (the drivers send this replica nothing new); leaving once it runs nothing, "
            "at most %.0f s from now",
            self.config.drain_timeout_s,
        )

    def _running_requests(self) -> int:
        """The generation requests this worker's replica still runs: those its engine holds (every rank of a
        sharded replica schedules the same ones) or this rank streams (0 when the engine cannot say)."""
        with self._stream_lock:
            streaming = len(self._stream_links)
        try:
            stats = self.wrapper.execute_method("engine_stats", (), {})
            held = int(stats["requests_running"]) + int(stats["requests_waiting"])
        except Exception:
            log.exception("drain: the engine's count of requests is not available; counting none")
            return 0
        return max(streaming, held)

    def run(self) -> int:
        try:
            self.worker_busy_loop()
        finally:
            self.close("stopping")
        return 0

    def close(self, reason: str) -> None:
        self._stopping.set()
        self._said_goodbye = True  # before the goodbyes: the output thread offers no heartbeat after them
        links = self.links
        for link in links:
            self._emit(
                protocol.encode_goodbye(
                    self.replica, self.rank, reason, link.last_call, self.config.incarnation
                ),
                link,
            )
        self._output_closing = True
        self._wake.set()
        self._output_thread.join(timeout=5)
        if self.ring is not None:
            self.ring.close()
        if self.reply_pipe is not None:
            self.reply_pipe.close()
        with self._send_lock:
            for link in links:
                link.closed = True
                link.rpc.close(linger=0)
                link.response.close(linger=2000)  # the goodbye still goes out
        self._context.term()
        self.health.stop()
        self.wrapper.require_worker().shutdown()
        log.info("worker replica %d rank %d stopped: %s", self.replica, self.rank, reason)


def _write_termination_message(message: str, path: str = wiring.TERMINATION_MESSAGE_PATH) -> None:
    """Where the kubelet reads why the container ended (it creates the file; elsewhere there is none)."""
    if os.path.isfile(path):
        with contextlib.suppress(OSError), open(path, "w") as out:
            out.write(message[:4096])


def _install_signal_handlers(proc: WorkerProc) -> None:
    def on_sigterm(_signum: int, _frame: FrameType | None) -> None:
        proc.request_drain()  # logged by the busy loop, which starts the drain

    def on_sigint(signum: int, _frame: FrameType | None) -> None:
        log.info("signal %d: finishing the in-flight call, then leaving", signum)
        proc.request_stop()

    signal.signal(signal.SIGTERM, on_sigterm)
    signal.signal(signal.SIGINT, on_sigint)


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(
        level=os.environ.get("IWG_LOG_LEVEL", "INFO"),
        format="%(asctime)s %(levelname)s %(name)s [pid %(process)d] %(message)s",
    )
    try:
        config = WorkerProcConfig.from_env()
    except ValueError as exc:
        log.error("bad configuration: %s", exc)
        return 2
    # torch.distributed reads RANK/WORLD_SIZE; derive them from the group identity when not given.
    os.environ.setdefault(wiring.TORCH_RANK, str(config.worker.rank))
    os.environ.setdefault(wiring.TORCH_WORLD_SIZE, str(config.worker.world_size))
    stop_early = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop_early.set())
    signal.signal(signal.SIGINT, lambda *_: stop_early.set())
    parent = parent_watch.expected_parent()
    # Started by a local executor (iwg serve): end with it, at once (no driver is left to drain to).
    if parent is not None:
        parent_watch.ParentWatch(parent, on_orphaned=lambda: os.kill(os.getpid(), signal.SIGINT)).start()
    try:
        proc = WorkerProc(config)
    except Exception as exc:
        log.exception("worker failed to start")
        reason = f"{wiring.START_FAILURE_PREFIX}{type(exc).__name__}: {exc}"
        _write_termination_message(reason)
        # Also the log's last words: the pod's FallbackToLogsOnError message is the log's end.
        log.error("%s", reason)
        return 1
    _install_signal_handlers(proc)
    if stop_early.is_set():
        proc.request_stop()
    code = proc.run()
    # Everything is closed explicitly by now; skip the interpreter's teardown, which with torch (and a
    # gloo group) takes seconds and would eat into the pod's termination grace period.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    sys.exit(main())
