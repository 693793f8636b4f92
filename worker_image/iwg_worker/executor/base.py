"""`Executor`: the one interface to a group's workers, whatever carries the calls.

A group has ``replicas`` data-parallel replicas of ``world_size`` ranks each. Every call names a method (a
string: a `METHOD_REGISTRY` helper or a public worker method) and goes to all ranks of one replica, or of
every replica when ``replica`` is None.

Result shape of `collective_rpc` / `collective_rpc_future`:

- one replica targeted (``replica=r``, or ``replica=None`` with one replica): a list of each rank's result
  in rank order, or the single result of ``unique_reply_rank`` when given (other ranks run the call and
  reply only if they fail);
- ``replica=None`` with several replicas: a list over replicas (in replica order) of the above.

Failures raise (or fail the future with):

- `RPCError`: the method raised on a worker; carries the worker's exception type, message and traceback;
- `RPCTimeoutError`: no complete answer within ``timeout``; names the method and the silent ranks;
- `ReplicaLostError`: a rank of the targeted replica left (goodbye, missed heartbeats, process died)
  while the call was pending; names the method, replica and ranks;
- `ReplicaUnavailableError`: the targeted replica is not serving (not all ranks joined) at call time.
"""

from __future__ import annotations

import asyncio
import functools
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any, Literal

from iwg_worker.executor.streams import GenerationStream, StreamHub

DEFAULT_EXECUTE_TIMEOUT_S = 300.0
DEFAULT_HEALTH_TIMEOUT_S = 10.0


def _ranks(ranks: Iterable[tuple[int, int]]) -> str:
    by_replica: dict[int, list[int]] = {}
    for replica, rank in sorted(ranks):
        by_replica.setdefault(replica, []).append(rank)
    return "; ".join(f"replica {r} ranks {ks}" for r, ks in by_replica.items())


class RPCError(RuntimeError):
    """The called method raised on a worker."""

    def __init__(
        self, method: str, replica: int, rank: int, remote_type: str, message: str, remote_traceback: str
    ) -> None:
        self.method = method
        self.replica = replica
        self.rank = rank
        self.remote_type = remote_type
        self.remote_message = message
        self.remote_traceback = remote_traceback
        text = f"{method!r} failed on replica {replica} rank {rank}: {remote_type}: {message}"
        if remote_traceback:
            text += f"\n--- worker traceback ---\n{remote_traceback.rstrip()}"
        super().__init__(text)


class RPCTimeoutError(TimeoutError):
    def __init__(self, method: str, missing: Iterable[tuple[int, int]], timeout: float) -> None:
        self.method = method
        self.missing = sorted(missing)
        self.timeout = timeout
        super().__init__(f"{method!r} timed out after {timeout:g} s: no reply from {_ranks(self.missing)}")


class ReplicaLostError(RuntimeError):
    def __init__(self, method: str, replica: int, ranks: Iterable[int], reason: str) -> None:
        self.method = method
        self.replica = replica
        self.ranks = sorted(ranks)
        self.reason = reason
        super().__init__(
            f"{method!r} failed: replica {replica} lost ranks {self.ranks} while the call was pending ({reason})"
        )


class ReplicaUnavailableError(RuntimeError):
    def __init__(self, method: str, replica: int, missing_ranks: Iterable[int]) -> None:
        self.method = method
        self.replica = replica
        self.missing_ranks = sorted(missing_ranks)
        super().__init__(
            f"cannot call {method!r}: replica {replica} is not serving (ranks {self.missing_ranks} not joined)"
        )


@dataclass(frozen=True, slots=True)
class Member:
    replica: int
    rank: int
    pod: str
    routing_id: bytes
    capabilities: dict[str, Any]
    joined_at: float


@dataclass(frozen=True, slots=True)
class MembershipEvent:
    """``joined``/``left`` for one rank; ``serving``/``lost`` for a whole replica (rank is None); ``draining``
    for one rank that announced it is leaving (SIGTERM): its replica takes nothing new (`draining_replicas`)."""

    kind: Literal["joined", "left", "serving", "lost", "draining"]
    replica: int
    rank: int | None
    reason: str
    serving: frozenset[int]


MembershipCallback = Callable[[MembershipEvent], None]


@dataclass(slots=True)
class PendingCall:
    """A call on its way: which replies it still waits for, and those it has (result shape: module docstring)."""

    id: int
    method: str
    targets: list[int]  # replicas, in result order
    expected: set[tuple[int, int]]  # (replica, rank) still to reply
    unique_reply_rank: int | None
    world_size: int
    future: Future[Any]
    timeout: float | None
    deadline: float | None = None  # monotonic, for executors that expire calls themselves
    results: dict[tuple[int, int], Any] = field(default_factory=dict)

    @classmethod
    def start(
        cls,
        call_id: int,
        method: str,
        targets: list[int],
        unique_reply_rank: int | None,
        world_size: int,
        timeout: float | None,
        deadline: float | None = None,
    ) -> PendingCall:
        reply_ranks = range(world_size) if unique_reply_rank is None else (unique_reply_rank,)
        expected = {(r, k) for r in targets for k in reply_ranks}
        future: Future[Any] = Future()
        return cls(
            call_id, method, targets, expected, unique_reply_rank, world_size, future, timeout, deadline
        )

    def assemble(self) -> Any:
        per_replica = []
        for replica in self.targets:
            if self.unique_reply_rank is not None:
                per_replica.append(self.results[(replica, self.unique_reply_rank)])
            else:
                per_replica.append([self.results[(replica, rank)] for rank in range(self.world_size)])
        return per_replica[0] if len(self.targets) == 1 else per_replica


class Executor(ABC):
    replicas: int = 1
    world_size: int = 1
    output_rank: int = 0

    @abstractmethod
    def collective_rpc_future(
        self,
        method: str,
        args: tuple[Any, ...] | list[Any] = (),
        kwargs: dict[str, Any] | None = None,
        timeout: float | None = None,
        unique_reply_rank: int | None = None,
        replica: int | None = None,
    ) -> Future[Any]:
        """Send the call and return at once; the future holds the result (shape: module docstring)."""

    def collective_rpc(
        self,
        method: str,
        args: tuple[Any, ...] | list[Any] = (),
        kwargs: dict[str, Any] | None = None,
        timeout: float | None = None,
        unique_reply_rank: int | None = None,
        replica: int | None = None,
    ) -> Any:
        """Blocking call; raises the errors listed in the module docstring."""
        return self._wait(self._send_waited(method, args, kwargs, timeout, unique_reply_rank, replica))

    def _send_waited(self, *call: Any) -> Future[Any]:
        """Send a call whose caller will block in `_wait` (hook: an executor may skip work a future needs)."""
        return self.collective_rpc_future(*call)

    def _wait(self, future: Future[Any]) -> Any:
        """Block until the call completes (hook: an executor may receive replies on the waiting thread)."""
        return future.result()

    async def collective_rpc_async(
        self,
        method: str,
        args: tuple[Any, ...] | list[Any] = (),
        kwargs: dict[str, Any] | None = None,
        timeout: float | None = None,
        unique_reply_rank: int | None = None,
        replica: int | None = None,
    ) -> Any:
        """`collective_rpc` for asyncio callers: awaits without blocking the event loop."""
        future = self.collective_rpc_future(method, args, kwargs, timeout, unique_reply_rank, replica)
        return await asyncio.wrap_future(future)

    @functools.cached_property
    def streams(self) -> StreamHub:
        """The streamed generation requests of this executor, by request id."""
        return StreamHub()

    async def open_stream(
        self, request: dict[str, Any], replica: int, timeout: float = DEFAULT_HEALTH_TIMEOUT_S
    ) -> tuple[GenerationStream, dict[str, Any]]:
        """Start one generation request on ``replica``'s engine: its stream and the engine's answer
        (``{id, ok, prompt_tokens}`` or ``{id, ok: false, error}``: refused, and no stream is left open)."""
        stream = GenerationStream(request["id"], replica, asyncio.get_running_loop())
        self.streams.register(stream)
        try:
            answers = await self.collective_rpc_async(
                "engine_add",
                ([request],),
                timeout=timeout,
                unique_reply_rank=self.output_rank,
                replica=replica,
            )
        except BaseException:
            self.streams.unregister(stream.request_id)
            raise
        answer: dict[str, Any] = answers[0]
        if not answer.get("ok"):
            self.streams.unregister(stream.request_id)
        return stream, answer

    async def cancel_streams(
        self, request_ids: list[str], replica: int, timeout: float = DEFAULT_HEALTH_TIMEOUT_S
    ) -> None:
        """Stop requests on ``replica``'s engine (their cache is freed at its next step)."""
        for request_id in request_ids:
            self.streams.unregister(request_id)
        await self.collective_rpc_async(
            "engine_cancel",
            (request_ids,),
            timeout=timeout,
            unique_reply_rank=self.output_rank,
            replica=replica,
        )

    def execute_model(
        self,
        batch: dict[str, Any],
        timeout: float | None = DEFAULT_EXECUTE_TIMEOUT_S,
        replica: int | None = None,
    ) -> Any:
        """Run one batch on a replica; the output rank's result."""
        return self.collective_rpc(
            "execute_model", (batch,), timeout=timeout, unique_reply_rank=self.output_rank, replica=replica
        )

    def check_health(self, timeout: float = DEFAULT_HEALTH_TIMEOUT_S, replica: int | None = None) -> Any:
        """Every rank's `WorkerBase.check_health` report (shape as `collective_rpc`)."""
        return self.collective_rpc("check_health", timeout=timeout, replica=replica)

    def serving_replicas(self) -> frozenset[int]:
        """Replicas whose every rank has joined and is alive."""
        return frozenset(range(self.replicas))

    def draining_replicas(self) -> frozenset[int]:
        """Replicas a rank of which announced that it is leaving (its worker got SIGTERM): they finish what
        they run, and should be sent nothing new. None by default (executors whose workers never announce)."""
        return frozenset()

    def subscribe(self, callback: MembershipCallback) -> Callable[[], None]:
        """Call ``callback(event)`` on every membership change; returns the unsubscribe function.

        Callbacks run on the executor's I/O thread: keep them short and thread-safe (from asyncio, use
        ``loop.call_soon_threadsafe``)."""
        return lambda: None

    def _address_call(self, method: str, replica: int | None, unique_reply_rank: int | None) -> list[int]:
        """Check a call's method name and addressing before anything is sent; the replicas it goes to."""
        if not isinstance(method, str) or not method:
            raise TypeError(f"method must be a method name (str), got {method!r}")
        targets = self._target_replicas(replica)
        self._check_reply_rank(unique_reply_rank)
        return targets

    def _target_replicas(self, replica: int | None) -> list[int]:
        if replica is None:
            return list(range(self.replicas))
        if not 0 <= replica < self.replicas:
            raise ValueError(f"replica must be in [0, {self.replicas}), got {replica}")
        return [replica]

    def _check_reply_rank(self, unique_reply_rank: int | None) -> None:
        if unique_reply_rank is not None and not 0 <= unique_reply_rank < self.world_size:
            raise ValueError(f"unique_reply_rank must be in [0, {self.world_size}), got {unique_reply_rank}")

    @abstractmethod
    def shutdown(self) -> None:
        """Stop the workers this executor owns and release its sockets; pending calls fail."""

    def __enter__(self) -> Executor:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.shutdown()
