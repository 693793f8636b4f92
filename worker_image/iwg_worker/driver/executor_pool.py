"""`ExecutorPool`: the driver's `ReplicaPool` on top of a runtime executor (ClusterExecutor in a pod,
MultiprocExecutor under `iwg serve`).

A batch becomes one `execute_model` call on one replica (`collective_rpc_future(..., replica=r,
unique_reply_rank=output_rank)`), awaited without blocking the event loop. The executor fails a pending call
when a rank of its replica leaves (goodbye, missed heartbeats, process exit) or its deadline passes; both
become `ReplicaFailure`, which the router retries elsewhere. A reply that arrives after that is dropped by
the executor (replies are matched by call id), so a retried batch is never answered twice.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Sequence
from typing import Any

import numpy as np

from iwg_worker.driver.pool import (
    Batch,
    BatchFailure,
    EmbedResult,
    InputRejected,
    ItemOutcome,
    ItemResult,
    MembershipEvent,
    MembershipListener,
    ReplicaFailure,
    ReplicaStartup,
    ReplicaState,
)
from iwg_worker.executor.base import (
    Executor,
    ReplicaLostError,
    ReplicaUnavailableError,
    RPCError,
    RPCTimeoutError,
)
from iwg_worker.executor.base import MembershipEvent as ExecutorEvent
from iwg_worker.executor.streams import GenerationStream, StreamFailed
from iwg_worker.protocol import REPLICA_FAILURE, EncodeError, unencodable

log = logging.getLogger(__name__)


class ExecutorPool:
    def __init__(self, executor: Executor, loop: asyncio.AbstractEventLoop | None = None) -> None:
        self.executor = executor
        self._loop = loop or asyncio.get_running_loop()
        self._listeners: list[MembershipListener] = []
        self._joined: dict[int, set[int]] = {}  # replica -> ranks that have joined
        self._unsubscribe = executor.subscribe(self._from_io_thread)
        for replica in executor.serving_replicas():
            self._joined[replica] = set(range(executor.world_size))

    # -- membership --------------------------------------------------------------------------------------------

    def states(self) -> dict[int, ReplicaState]:
        """Replicas that have been seen (joined at least one rank); an index no worker ever claimed is not
        listed, so IWG_REPLICAS can be an upper bound (room to scale up) without phantom dead replicas."""
        serving = self.executor.serving_replicas()
        seen = set(serving) | set(self._joined)
        return {r: self._state(r, serving) for r in sorted(seen)}

    def _state(self, replica: int, serving: frozenset[int]) -> ReplicaState:
        if replica in serving:
            return ReplicaState.SERVING
        return ReplicaState.JOINING if self._joined.get(replica) else ReplicaState.DEAD

    def add_listener(self, listener: MembershipListener) -> None:
        self._listeners.append(listener)

    def _from_io_thread(self, event: ExecutorEvent) -> None:
        # The executor calls back on its I/O thread; the router lives on the event loop.
        with contextlib.suppress(RuntimeError):  # the loop is closed: the driver is shutting down
            self._loop.call_soon_threadsafe(self._on_event, event)

    def _on_event(self, event: ExecutorEvent) -> None:
        ranks = self._joined.setdefault(event.replica, set())
        if event.kind == "joined" and event.rank is not None:
            ranks.add(event.rank)
        elif event.kind == "left" and event.rank is not None:
            ranks.discard(event.rank)
        # The serving set as of this event, not as of now: a replica lost and back before the loop ran this
        # still reads DEAD then SERVING, so the router ends an admin drain of the pod that went.
        state = self._state(event.replica, event.serving)
        draining = event.replica in self.executor.draining_replicas()
        for listener in self._listeners:
            listener(MembershipEvent(event.replica, state, f"{event.kind}: {event.reason}", draining))

    # -- batches -----------------------------------------------------------------------------------------------

    async def execute(self, replica: int, batch: Batch, timeout: float) -> Sequence[ItemOutcome]:
        try:
            return await self._execute(replica, batch, timeout)
        except EncodeError as exc:
            # One input that cannot travel must not fail the others: send the batch without it.
            rejected = {i: why for i, x in enumerate(batch.inputs) if (why := unencodable(x)) is not None}
            if not rejected:  # the batch's parameters themselves cannot travel
                raise BatchFailure(f"the batch cannot be sent to the workers: {exc}") from exc
            kept = [i for i in range(len(batch.inputs)) if i not in rejected]
            results: list[ItemOutcome] = []
            if kept:
                sub = Batch(batch.task, tuple(batch.inputs[i] for i in kept))
                results = list(await self._execute(replica, sub, timeout))
            outcomes = dict(zip(kept, results, strict=True))
            return [
                outcomes[i]
                if i in outcomes
                else InputRejected(f"it cannot be sent to the workers: {rejected[i]}")
                for i in range(len(batch.inputs))
            ]

    async def _execute(self, replica: int, batch: Batch, timeout: float) -> list[ItemResult]:
        payload = _payload(batch)
        try:
            future = self.executor.collective_rpc_future(
                "execute_model",
                (payload,),
                timeout=timeout,
                unique_reply_rank=self.executor.output_rank,
                replica=replica,
            )
            reply = await asyncio.wrap_future(future)
        except (ReplicaLostError, ReplicaUnavailableError, RPCTimeoutError) as exc:
            raise ReplicaFailure(str(exc)) from exc
        except RPCError as exc:
            raise BatchFailure(f"{exc.remote_type}: {exc.remote_message}") from exc
        except RuntimeError as exc:  # executor shut down under the call
            raise ReplicaFailure(str(exc)) from exc
        try:
            return _results(batch, reply)
        except (KeyError, TypeError, ValueError) as exc:
            raise BatchFailure(f"replica {replica} sent a reply of an unexpected shape: {exc}") from exc

    # -- streams -----------------------------------------------------------------------------------------------

    async def open_stream(
        self, replica: int, request: dict[str, Any], timeout: float
    ) -> tuple[AsyncIterator[dict[str, Any]], dict[str, Any]]:
        try:
            stream, answer = await self.executor.open_stream(request, replica, timeout)
        except (ReplicaLostError, ReplicaUnavailableError, RPCTimeoutError, RuntimeError) as exc:
            raise ReplicaFailure(str(exc)) from exc
        return _stream_items(stream), answer

    async def cancel_streams(self, replica: int, request_ids: list[str], timeout: float) -> None:
        with contextlib.suppress(Exception):  # the replica may be gone, which frees its cache anyway
            await self.executor.cancel_streams(request_ids, replica, timeout)

    async def engine_stats(
        self, replica: int, timeout: float, blocks_since: list[int] | None = None
    ) -> dict[str, Any]:
        stats: dict[str, Any] = await self.executor.collective_rpc_async(
            "engine_stats",
            () if blocks_since is None else (blocks_since,),
            timeout=timeout,
            unique_reply_rank=self.executor.output_rank,
            replica=replica,
        )
        return stats

    def startup(self, replica: int) -> ReplicaStartup | None:
        """From the hello of `replica`'s output rank: its ``startup`` capability gives seconds before the hello,
        the member's ``joined_at`` when the hello came (this driver's wall clock, turned monotonic here)."""
        members = getattr(self.executor, "members", None)
        if members is None:
            return None
        for member in members():
            if member.replica == replica and member.rank == self.executor.output_rank:
                said = member.capabilities.get("startup")
                if not isinstance(said, dict):
                    return None
                heard = time.monotonic() - max(0.0, time.time() - member.joined_at)
                return ReplicaStartup(
                    *(_before(heard, said.get(k)) for k in ("age_s", "load_began_s_ago", "load_done_s_ago"))
                )
        return None

    async def close(self) -> None:
        self._unsubscribe()
        await asyncio.to_thread(self.executor.shutdown)


async def _stream_items(stream: GenerationStream) -> AsyncIterator[dict[str, Any]]:
    try:
        async for item in stream:
            yield item
    except StreamFailed as exc:
        # The worker says its replica failed (its engine as a whole, e.g. a lost rank), not the request.
        if exc.code == REPLICA_FAILURE:
            raise ReplicaFailure(str(exc), reason="engine_failed") from exc
        raise BatchFailure(str(exc)) from exc
    except (ReplicaLostError, RuntimeError) as exc:
        raise ReplicaFailure(str(exc)) from exc


def _payload(batch: Batch) -> dict[str, Any]:
    return {"inputs": list(batch.inputs)}


def _as_array(value: Any) -> np.ndarray[Any, Any]:
    if hasattr(value, "numpy"):  # a torch tensor decoded from the wire
        return np.asarray(value.numpy())
    return np.asarray(value)


def _results(batch: Batch, reply: Any) -> list[ItemResult]:
    if not isinstance(reply, dict):
        raise TypeError(f"execute_model returned {type(reply).__name__}, not a map")
    n = len(batch.inputs)
    embeddings = _as_array(reply["embeddings"]).astype(np.float32, copy=False)
    if embeddings.ndim != 2 or embeddings.shape[0] != n:
        raise ValueError(f"embeddings of shape {embeddings.shape} for {n} inputs")
    counts = reply.get("prompt_tokens")
    tokens = [int(c) for c in _as_array(counts).reshape(-1)] if counts is not None else [0] * n
    return [EmbedResult(embeddings[i], tokens[i]) for i in range(n)]


def _before(heard: float, seconds: Any) -> float | None:
    """``seconds`` before ``heard``, where ``seconds`` is a number of seconds a worker could mean."""
    if isinstance(seconds, bool) or not isinstance(seconds, int | float) or not 0 <= seconds < 1e7:
        return None
    return heard - float(seconds)
