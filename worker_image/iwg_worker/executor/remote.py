"""`RemoteExecutor`: the ZMQ side of a group, shared by `MultiprocExecutor` (ipc) and `ClusterExecutor` (tcp).

It binds two sockets that workers connect to: ``rpc`` (ROUTER; calls and pings go out to each worker by its
routing id) and ``response`` (PULL; hellos, heartbeats, replies and goodbyes come in). Callers send calls
themselves under a lock, so a call costs no thread hop on the way out. An I/O thread runs the timers and the
membership, and receives replies for callers that do not wait (futures, asyncio). A caller blocked in
`collective_rpc` receives replies itself while it waits (whichever thread holds the receive lock drains the
response socket and completes every call it finds a reply for), so a blocking call costs no thread hop on the
way back either: the hand-off from an I/O thread to the waiting caller cost more than the rest of a small
call. Other messages a caller receives (hellos, heartbeats, goodbyes) go to the I/O thread, so membership
changes and their callbacks stay on that one thread.

Membership: a worker is a member from its hello (or a heartbeat, so a restarted driver relearns its workers)
until its goodbye, a failed ping (its connection is gone), or ``heartbeat_interval_s * heartbeat_misses``
without hearing from it: a heartbeat, or a reply or streamed output of its (a worker whose output flows is
alive, even when its heartbeats come late: a process starved of CPU on a loaded node sends what it computes
before its heartbeat thread gets a turn). A replica serves while all its ranks are members; when one leaves, the replica's
pending calls fail with `ReplicaLostError` and other replicas keep serving. A member whose hello or heartbeat
says ``capabilities.draining`` (its worker got SIGTERM and finishes what its replica runs before its goodbye)
makes its replica draining (`draining_replicas`, a ``draining`` event): still a member, still serving what it
runs, but the driver sends it nothing new.
"""

from __future__ import annotations

import collections
import concurrent.futures
import itertools
import logging
import select
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Literal, cast

import zmq
from iwg_operator.api import wiring

from iwg_worker import protocol
from iwg_worker.executor.base import (
    Executor,
    Member,
    MembershipCallback,
    MembershipEvent,
    PendingCall,
    ReplicaLostError,
    ReplicaUnavailableError,
    RPCError,
    RPCTimeoutError,
)
from iwg_worker.executor.reply_pipe import ReplyPipeReader
from iwg_worker.security import CurveKeys, ZapAuthenticator, make_server

log = logging.getLogger(__name__)

_TICK_MS = 20


@dataclass(slots=True)
class _MemberState:
    member: Member
    last_seen: float  # monotonic
    reachable: bool  # a ping went through the rpc socket: calls can be routed to it
    draining: bool = False  # its heartbeat said it is leaving (``capabilities.draining``: SIGTERM)
    # Seconds of this driver's own stalls not counted against its silence since its last heartbeat (at most
    # one heartbeat timeout: a driver that stalls again and again still drops a worker that is gone).
    excused: float = 0.0


class RemoteExecutor(Executor):
    def __init__(
        self,
        rpc_endpoint: str,
        response_endpoint: str,
        replicas: int = 1,
        world_size: int = 1,
        keys: CurveKeys | None = None,
        group: str = "",
        heartbeat_interval_s: float = wiring.DEFAULT_HEARTBEAT_INTERVAL_S,
        heartbeat_misses: int = wiring.DEFAULT_HEARTBEAT_MISSES,
        reply_pipe: ReplyPipeReader | None = None,
    ) -> None:
        """``reply_pipe``: a FIFO that local workers write small replies into (`reply_pipe`), read beside
        the response socket."""
        if replicas < 1 or world_size < 1:
            raise ValueError(f"replicas and world_size must be >= 1, got {replicas} and {world_size}")
        self.replicas = replicas
        self.world_size = world_size
        self.group = group
        self.heartbeat_interval_s = heartbeat_interval_s
        self.heartbeat_timeout_s = heartbeat_interval_s * heartbeat_misses
        self._context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self._zap = ZapAuthenticator(self._context, keys.peer_public) if keys is not None else None
        self._rpc = self._context.socket(zmq.ROUTER)
        self._rpc.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self._rpc.setsockopt(zmq.ROUTER_HANDOVER, 1)
        self._response = self._context.socket(zmq.PULL)
        for sock in (self._rpc, self._response):
            sock.linger = 0
            if keys is not None:
                make_server(sock, keys)
        self._response.rcvtimeo = _TICK_MS  # a caller receiving for itself looks up once a tick
        self._rpc.bind(rpc_endpoint)
        self._response.bind(response_endpoint)
        self.rpc_endpoint: str = self._rpc.get_string(zmq.LAST_ENDPOINT)
        self.response_endpoint: str = self._response.get_string(zmq.LAST_ENDPOINT)
        self._reply_pipe = reply_pipe
        # A caller receiving for itself sleeps here, on the reply FIFO and the response socket's descriptor.
        self._inputs = select.poll()
        self._inputs.register(cast(int, self._response.getsockopt(zmq.FD)), select.POLLIN)
        if reply_pipe is not None:
            self._inputs.register(reply_pipe.fd, select.POLLIN)

        self._lock = threading.Lock()  # membership and pending calls
        self._send_lock = threading.Lock()  # the rpc socket
        # The response socket; reentrant because a membership callback may itself make a blocking call.
        self._receive_lock = threading.RLock()
        self._deferred: collections.deque[protocol.Message] = collections.deque()  # for the I/O thread
        self._caller_receiving = False
        self._caller_received_at = 0.0  # monotonic
        self._io_resting = False
        self._io_wake = threading.Event()
        self._changed = threading.Condition(self._lock)
        # Call ids go on from the clock (microseconds), not from 1: a driver that restarted must never take an
        # id that its predecessor used, as a worker may still send replies to the old calls, or name one as
        # the last call it ran in a goodbye, to the new driver at the same address.
        self._ids = itertools.count(time.time_ns() // 1000)
        self._pending: dict[int, PendingCall] = {}
        self._members: dict[tuple[int, int], _MemberState] = {}
        # (replica, rank) -> the newest incarnation seen of it (wiring.INCARNATION), kept after it leaves: an
        # older one (a replaced process that came back) is refused. `_refused` keeps the log to one line each.
        self._incarnations: dict[tuple[int, int], int] = {}
        self._refused: set[tuple[tuple[int, int], bytes]] = set()
        # (replica, rank) -> the routing id of the process that last said goodbye as it: that process stops, so
        # a heartbeat of it that comes in after its goodbye must not make it a member (and its replica serving)
        # again. A process that starts anew (a restarted container) has another routing id.
        self._departed: dict[tuple[int, int], bytes] = {}
        self._routes: dict[int, tuple[bytes, ...]] = {}  # serving replica -> routing ids by rank
        self._serving: frozenset[int] = frozenset()
        self._subscribers: list[MembershipCallback] = []
        self._closed = threading.Event()
        self._expiry_checked_at = time.monotonic()  # the I/O thread's last look at the members' silence
        self._io_thread = threading.Thread(target=self._io_loop, name="iwg-executor-io", daemon=True)
        self._io_thread.start()

    # -- public ----------------------------------------------------------------------------------------

    def serving_replicas(self) -> frozenset[int]:
        return self._serving

    def draining_replicas(self) -> frozenset[int]:
        with self._lock:
            return frozenset(key[0] for key, state in self._members.items() if state.draining)

    def members(self) -> list[Member]:
        with self._lock:
            return [s.member for s in self._members.values()]

    def subscribe(self, callback: MembershipCallback) -> Callable[[], None]:
        with self._lock:
            self._subscribers.append(callback)

        def unsubscribe() -> None:
            with self._lock:
                if callback in self._subscribers:
                    self._subscribers.remove(callback)

        return unsubscribe

    def wait_until_serving(self, replicas: Iterable[int] | None = None, timeout: float = 120.0) -> None:
        """Block until the given replicas (all by default) serve; `TimeoutError` names the missing ranks."""
        wanted = set(range(self.replicas) if replicas is None else replicas)
        deadline = time.monotonic() + timeout
        with self._changed:
            while not wanted <= self._serving:
                left = deadline - time.monotonic()
                if left <= 0 or self._closed.is_set():
                    missing = sorted(
                        (r, k) for r in wanted for k in range(self.world_size) if (r, k) not in self._members
                    )
                    raise TimeoutError(
                        f"replicas {sorted(wanted - self._serving)} not serving; missing {missing}"
                    )
                self._changed.wait(min(left, 0.5))

    def _send_waited(self, *call: Any) -> Future[Any]:
        return self._send_call(*call)  # the caller receives for itself: no need to wake the I/O thread

    def _wait(self, future: Future[Any]) -> Any:
        self._receive_until_done(future)
        return future.result()

    def _receive_until_done(self, future: Future[Any]) -> None:
        """Wait for ``future`` by receiving replies on this thread while no other thread is receiving.

        Deadlines, lost members and shutdown are the I/O thread's, and it completes the future for them; this
        thread looks at the future at least once a tick, so it never waits longer than the I/O thread would
        let it."""
        while not future.done():
            if not self._closed.is_set() and self._receive_lock.acquire(blocking=False):
                self._caller_receiving = True
                try:
                    if self._reply_pipe is None:
                        while not future.done() and not self._closed.is_set():
                            try:
                                frames = self._recv_frames(0)  # waits up to a tick (the socket's RCVTIMEO)
                            except zmq.Again:
                                continue
                            self._accept(frames, defer_membership=True)
                    else:
                        self._receive_both(future)
                    # Leave the socket seen empty (an EVENTS query marks it so, like a failed receive), so the
                    # next message signals the I/O thread's descriptor again.
                    if (
                        not self._closed.is_set()
                        and cast(int, self._response.getsockopt(zmq.EVENTS)) & zmq.POLLIN
                    ):
                        self._drain(defer_membership=True)
                finally:
                    self._caller_received_at = time.monotonic()
                    self._caller_receiving = False
                    self._receive_lock.release()
                if self._pending or self._deferred:
                    self._io_wake.set()  # others wait on replies, or membership news: the I/O thread's turn
            else:
                # Another thread is receiving (and will complete this call too), or the executor is closing.
                concurrent.futures.wait([future], timeout=_TICK_MS / 1000)

    def _receive_both(self, future: Future[Any]) -> None:
        """`_receive_until_done`'s loop with a reply FIFO: take what it holds, then what the socket holds,
        then sleep on both (a tick at most). The socket's descriptor only says "look": the EVENTS query
        before every sleep re-arms it."""
        assert self._reply_pipe is not None
        pipe = self._reply_pipe
        response = self._response
        while not future.done() and not self._closed.is_set():
            for message in pipe.read():
                self._accept([message], defer_membership=True)
            if future.done():
                return
            if cast(int, response.getsockopt(zmq.EVENTS)) & zmq.POLLIN:
                self._drain(defer_membership=True)
                continue
            self._inputs.poll(_TICK_MS)

    def collective_rpc_future(
        self,
        method: str,
        args: tuple[Any, ...] | list[Any] = (),
        kwargs: dict[str, Any] | None = None,
        timeout: float | None = None,
        unique_reply_rank: int | None = None,
        replica: int | None = None,
    ) -> Future[Any]:
        future = self._send_call(method, args, kwargs, timeout, unique_reply_rank, replica)
        if self._io_resting:
            self._io_wake.set()  # nobody waits on this call: the I/O thread receives its reply
        return future

    def _send_call(
        self,
        method: str,
        args: tuple[Any, ...] | list[Any],
        kwargs: dict[str, Any] | None,
        timeout: float | None,
        unique_reply_rank: int | None,
        replica: int | None,
    ) -> Future[Any]:
        targets = self._address_call(method, replica, unique_reply_rank)
        if self._closed.is_set():
            raise RuntimeError("executor is shut down")
        pending = PendingCall.start(
            0,
            method,
            targets,
            unique_reply_rank,
            self.world_size,
            timeout,
            deadline=None if timeout is None else time.monotonic() + timeout,
        )
        future = pending.future
        deadline = None if timeout is None else time.time() + timeout
        # Ids are taken and sent under one lock, so every worker receives its calls in id order: a goodbye's
        # ``last_call`` then tells exactly which pending calls that worker ran.
        with self._send_lock:
            call_id = pending.id = next(self._ids)
            frames = protocol.encode_call(call_id, method, args, kwargs, unique_reply_rank, deadline)
            with self._lock:
                routes = []
                for r in targets:
                    route = self._routes.get(r)
                    if route is None:
                        missing = [k for k in range(self.world_size) if (r, k) not in self._members]
                        raise ReplicaUnavailableError(method, r, missing or list(range(self.world_size)))
                    routes.append((r, route))
                self._pending[call_id] = pending
            self._deliver(call_id, method, frames, routes)
        return future

    def _deliver(
        self, call_id: int, method: str, frames: list[Any], routes: list[tuple[int, tuple[bytes, ...]]]
    ) -> None:
        """Send a call's frames to every rank of the routed replicas (the caller holds the send lock); a
        failed send fails the call. `MultiprocExecutor` writes through its shared-memory ring instead."""
        for r, route in routes:
            for rank, routing_id in enumerate(route):
                try:
                    self._rpc.send_multipart([routing_id, *frames], flags=zmq.NOBLOCK, copy=False)
                except zmq.ZMQError as exc:
                    # Unreachable or a full queue: this replica cannot take the call now.
                    self._fail_pending(call_id, ReplicaLostError(method, r, [rank], f"send failed: {exc}"))
                    return

    def shutdown(self) -> None:
        if self._closed.is_set():
            return
        self._closed.set()
        self._io_thread.join(timeout=5)
        with self._lock:
            pending = list(self._pending.values())
            self._pending.clear()
        for p in pending:
            if not p.future.done():
                p.future.set_exception(
                    RuntimeError(f"{p.method!r}: executor shut down while the call was pending")
                )
        self.streams.fail_all(RuntimeError("the executor shut down while the request was generating"))
        with self._send_lock:
            self._rpc.close(linger=0)
        with self._receive_lock:  # a caller receiving on it lets go within a tick of seeing the shutdown
            self._response.close(linger=0)
        if self._zap is not None:
            self._zap.stop()
        self._context.term()

    # -- I/O thread ------------------------------------------------------------------------------------

    def _io_loop(self) -> None:
        # The thread waits on the response socket's signalling file descriptor, not on the socket, so a
        # caller can receive on the socket meanwhile (a ZMQ socket is used by one thread at a time: the
        # receive lock). The descriptor is edge-like: readable means "look", and whoever holds the lock
        # drains the socket until it is empty, which re-arms it. While callers receive for themselves, the
        # thread does not watch the descriptor (it would wake with every reply and take the GIL from the
        # caller); a caller wakes it when it stops receiving while other calls are still pending.
        poller = zmq.Poller()
        poller.register(self._response.getsockopt(zmq.FD), zmq.POLLIN)
        if self._reply_pipe is not None:
            poller.register(self._reply_pipe.fd, zmq.POLLIN)
        next_ping = next_tick = time.monotonic()
        while not self._closed.is_set():
            self._io_resting = True  # before looking at the pending calls: see collective_rpc_future
            if self._caller_receiving or (
                not self._pending and time.monotonic() - self._caller_received_at < _TICK_MS / 1000
            ):
                self._io_wake.wait(_TICK_MS / 1000)
                self._io_wake.clear()
                self._io_resting = False
            else:
                self._io_resting = False
                try:
                    poller.poll(_TICK_MS)
                except zmq.ZMQError:
                    break
            if self._receive_lock.acquire(timeout=_TICK_MS / 1000):
                try:
                    if not self._closed.is_set():
                        self._drain()
                finally:
                    self._receive_lock.release()
            while self._deferred:
                self._handle(self._deferred.popleft())
            now = time.monotonic()
            if now < next_tick:
                continue  # timers run once a tick, not after every reply: the caller waits for the GIL
            next_tick = now + _TICK_MS / 1000
            if now >= next_ping:
                self._ping_members()
                next_ping = now + self.heartbeat_interval_s
            self._retry_unreachable()
            self._expire_members(now)
            self._expire_calls(now)
            self._on_tick()

    def _on_tick(self) -> None:
        """Hook for subclasses (process monitoring); runs on the I/O thread every tick."""

    def _drain(self, defer_membership: bool = False) -> None:
        """Receive until the socket is empty, and take what the reply FIFO holds (the caller holds the
        receive lock)."""
        if self._reply_pipe is not None:
            for message in self._reply_pipe.read():
                self._accept([message], defer_membership)
        for _ in range(1000):  # then the I/O thread's timers get a turn; the rest waits at most a tick
            try:
                frames = self._recv_frames(zmq.NOBLOCK)
            except zmq.Again:
                return
            self._accept(frames, defer_membership)

    def _recv_frames(self, flags: int) -> list[Any]:
        # The header is small: a copy costs less than a zmq.Frame. Tensor frames arrive without a copy.
        frames: list[Any] = [self._response.recv(flags)]
        while self._response.getsockopt(zmq.RCVMORE):
            frames.append(self._response.recv(copy=False))
        return frames

    def _accept(self, frames: list[Any], defer_membership: bool) -> None:
        """Replies complete their calls on the receiving thread; other messages are handled on the I/O
        thread (here, or queued for it when a caller received them)."""
        try:
            message = protocol.decode(frames)
        except protocol.ProtocolError as exc:
            log.warning("rejected a malformed message from a worker: %s", exc)
            return
        if isinstance(message, protocol.Reply):
            self._heard_from(message.replica, message.rank)
            self._on_reply(message)
        elif isinstance(message, protocol.Stream):
            self._heard_from(message.replica, message.rank)
            self.streams.deliver(message.replica, message.items)
        elif defer_membership:
            self._deferred.append(message)
        else:
            self._handle(message)

    def _heard_from(self, replica: int, rank: int) -> None:
        """A reply or streamed output of a member: as good as a heartbeat (any receiving thread; a float set
        under the GIL, read by the I/O thread's expiry)."""
        state = self._members.get((replica, rank))
        if state is not None:
            state.last_seen = max(state.last_seen, time.monotonic())

    def _handle(self, message: protocol.Message) -> None:
        if isinstance(message, protocol.Reply):
            self._on_reply(message)
        elif isinstance(message, protocol.Hello):
            self._on_hello(message)
        elif isinstance(message, protocol.Goodbye):
            if message.incarnation < self._incarnations.get((message.replica, message.rank), 0):
                log.info(
                    "ignored the goodbye of replica %d rank %d's replaced incarnation %d: %s",
                    message.replica, message.rank, message.incarnation, message.reason,
                )  # fmt: skip
                return
            key = (message.replica, message.rank)
            if (state := self._members.get(key)) is not None:
                self._departed[key] = state.member.routing_id
            self._member_left(
                message.replica, message.rank, f"goodbye: {message.reason}", last_call=message.last_call
            )
        else:
            log.warning("rejected a %s message on the response socket", type(message).__name__)

    def _on_reply(self, reply: protocol.Reply) -> None:
        with self._lock:
            pending = self._pending.get(reply.id)
            if pending is None:
                return
            key = (reply.replica, reply.rank)
            if reply.error is not None:
                del self._pending[reply.id]
            elif key in pending.expected:
                pending.expected.discard(key)
                pending.results[key] = reply.result
                if pending.expected:
                    return
                del self._pending[reply.id]
            else:
                return
        if pending.future.done():
            return
        if reply.error is not None:
            e = reply.error
            pending.future.set_exception(
                RPCError(pending.method, reply.replica, reply.rank, e.type, e.message, e.traceback)
            )
        else:
            pending.future.set_result(pending.assemble())

    def _on_hello(self, hello: protocol.Hello) -> None:
        key = (hello.replica, hello.rank)
        problem = None
        if not 0 <= hello.replica < self.replicas:
            problem = f"replica {hello.replica} outside [0, {self.replicas})"
        elif not 0 <= hello.rank < self.world_size or hello.world_size != self.world_size:
            problem = f"rank {hello.rank} of world size {hello.world_size}; this group has world size {self.world_size}"
        elif self.group and hello.group != self.group:
            problem = f"group {hello.group!r} is not {self.group!r}"
        if problem:
            log.warning("ignored %s from pod %r: %s", hello.kind, hello.pod, problem)
            return
        incarnation = _incarnation(hello.capabilities)
        newest = self._incarnations.get(key, 0)
        if incarnation < newest:
            # Fenced: the pod was replaced (a newer incarnation said hello), so this process was cut off (a
            # partitioned node, a stopped process) and is not the rank any more; it never becomes a member.
            if (key, hello.routing_id) not in self._refused:
                self._refused.add((key, hello.routing_id))
                log.warning(
                    "refused %s from pod %r (replica %d rank %d): incarnation %d is older than %d, which replaced it",
                    hello.kind, hello.pod, hello.replica, hello.rank, incarnation, newest,
                )  # fmt: skip
            return
        if self._departed.get(key) == hello.routing_id:
            log.debug("ignored a %s of replica %d rank %d after its goodbye", hello.kind, *key)
            return
        self._incarnations[key] = incarnation
        now = time.monotonic()
        state = self._members.get(key)
        if state is not None and state.member.routing_id == hello.routing_id:
            state.last_seen = now
            state.excused = 0.0
            self._note_draining(key, state, hello)
            return
        if state is not None:
            self._member_left(hello.replica, hello.rank, f"replaced by pod {hello.pod!r}")
        member = Member(
            hello.replica, hello.rank, hello.pod, hello.routing_id, hello.capabilities, time.time()
        )
        state = _MemberState(member, now, reachable=False)
        with self._lock:
            self._members[key] = state
        self._note_draining(key, state, hello)
        self._try_reach(key)

    def _note_draining(self, key: tuple[int, int], state: _MemberState, hello: protocol.Hello) -> None:
        """A member's first hello or heartbeat that says it drains (a worker leaving after SIGTERM) makes its
        replica draining; it stays so until the member leaves (I/O thread)."""
        if state.draining or hello.capabilities.get("draining") is not True:
            return
        with self._lock:
            state.draining = True
            serving = self._serving
        log.info(
            "replica %d rank %d (pod %s) is draining: its replica gets nothing new, finishes what it runs",
            key[0], key[1], hello.pod,
        )  # fmt: skip
        self._publish([MembershipEvent("draining", key[0], key[1], f"pod {hello.pod} draining", serving)])

    def _try_reach(self, key: tuple[int, int]) -> None:
        state = self._members.get(key)
        if state is None or state.reachable:
            return
        try:
            with self._send_lock:
                self._rpc.send_multipart(
                    [state.member.routing_id, *protocol.encode_ping(time.time())], flags=zmq.NOBLOCK
                )
        except zmq.ZMQError:
            return  # its rpc connection is not up yet; retried every tick
        events = []
        with self._lock:
            state.reachable = True
            events.append(MembershipEvent("joined", key[0], key[1], f"pod {state.member.pod}", self._serving))
            events.extend(self._recompute_serving(key[0], "all ranks joined"))
        self._publish(events)

    def _retry_unreachable(self) -> None:
        for key in [k for k, s in self._members.items() if not s.reachable]:
            self._try_reach(key)

    def _ping_members(self) -> None:
        frames = protocol.encode_ping(time.time())
        for key, state in list(self._members.items()):
            if not state.reachable:
                continue
            try:
                with self._send_lock:
                    self._rpc.send_multipart([state.member.routing_id, *frames], flags=zmq.NOBLOCK)
            except zmq.ZMQError as exc:
                if exc.errno == zmq.EHOSTUNREACH:
                    self._member_left(key[0], key[1], "connection lost")

    def _expire_members(self, now: float) -> None:
        paused = now - self._expiry_checked_at
        self._expiry_checked_at = now
        if paused > self.heartbeat_interval_s:
            # This thread did not run for that long: the process stalled (a loaded machine, a throttled or paused
            # container, a long GIL hold). The workers' silence in that time is ours, not theirs, and what they
            # sent may still be on its way in; as Cassandra's failure detector ignores a local pause, each member
            # then has two heartbeat intervals left to be heard, however long the stall was. The excuse is bounded
            # by one timeout per heartbeat, so a driver that stalls over and over still drops a worker that is gone.
            heard_by = now - max(0.0, self.heartbeat_timeout_s - 2 * self.heartbeat_interval_s)
            for state in list(self._members.values()):
                credit = min(heard_by - state.last_seen, self.heartbeat_timeout_s - state.excused)
                if credit > 0:
                    state.excused += credit
                    state.last_seen += credit
        for key, state in list(self._members.items()):
            silent = now - state.last_seen
            if silent > self.heartbeat_timeout_s:
                self._member_left(key[0], key[1], f"no heartbeat for {silent:.1f} s")

    def _expire_calls(self, now: float) -> None:
        expired = []
        with self._lock:
            for call_id, p in list(self._pending.items()):
                if p.deadline is not None and now >= p.deadline:
                    expired.append(p)
                    del self._pending[call_id]
        for p in expired:
            if not p.future.done():
                p.future.set_exception(RPCTimeoutError(p.method, p.expected, p.timeout or 0.0))

    def _member_left(
        self, replica: int, rank: int, reason: str, last_call: int | Literal[False] | None = False
    ) -> None:
        """Remove a member and fail the pending calls of its replica that it cannot have completed.

        ``last_call`` comes with a goodbye (the worker ran every call up to that id, replied to them before
        saying goodbye, and runs nothing after); it is False when the worker vanished, in which case every
        call still waiting on it, or whose success depends on ranks that do not reply, fails."""
        key = (replica, rank)
        failed: list[PendingCall] = []
        events: list[MembershipEvent] = []
        with self._lock:
            state = self._members.pop(key, None)
            if state is None:
                return
            log.warning("replica %d rank %d (pod %s) left: %s", replica, rank, state.member.pod, reason)
            events.append(MembershipEvent("left", replica, rank, reason, self._serving))
            events.extend(self._recompute_serving(replica, f"rank {rank} left: {reason}"))
            for call_id, p in list(self._pending.items()):
                if replica not in p.targets:
                    continue
                if last_call is False:
                    lost = key in p.expected or p.unique_reply_rank not in (None, rank)
                else:
                    lost = last_call is None or call_id > last_call
                if lost:
                    failed.append(p)
                    del self._pending[call_id]
        for p in failed:
            if not p.future.done():
                p.future.set_exception(ReplicaLostError(p.method, replica, [rank], reason))
        self.streams.fail_replica(replica, ReplicaLostError("generate", replica, [rank], reason))
        self._publish(events)

    def _recompute_serving(self, replica: int, reason: str) -> list[MembershipEvent]:
        """Update routes and the serving set for one replica; caller holds the lock."""
        states = [self._members.get((replica, k)) for k in range(self.world_size)]
        serving_now = all(s is not None and s.reachable for s in states)
        was_serving = replica in self._serving
        if serving_now:
            self._routes[replica] = tuple(s.member.routing_id for s in states if s is not None)
        else:
            self._routes.pop(replica, None)
        if serving_now == was_serving:
            return []
        self._serving = self._serving | {replica} if serving_now else self._serving - {replica}
        self._changed.notify_all()
        log.info("replica %d %s (%s)", replica, "serving" if serving_now else "lost", reason)
        return [MembershipEvent("serving" if serving_now else "lost", replica, None, reason, self._serving)]

    def _publish(self, events: list[MembershipEvent]) -> None:
        if not events:
            return
        with self._lock:
            subscribers = list(self._subscribers)
        for event in events:
            for callback in subscribers:
                try:
                    callback(event)
                except Exception:
                    log.exception("membership subscriber %r failed", callback)

    def _fail_pending(self, call_id: int, error: Exception) -> None:
        with self._lock:
            pending = self._pending.pop(call_id, None)
        if pending is not None and not pending.future.done():
            pending.future.set_exception(error)


def _incarnation(capabilities: dict[str, Any]) -> int:
    """A hello's incarnation (0: none given, as from `iwg serve` and workers of earlier versions)."""
    value = capabilities.get("incarnation")
    return value if isinstance(value, int) and not isinstance(value, bool) else 0
