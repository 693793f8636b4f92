"""What the driver needs from the workers: a pool of replicas it can send batches to.

The router and batcher are written against `ReplicaPool`, not against an executor, so they can be tested with
an in-process fake and run on top of whichever executor holds the workers (ClusterExecutor in a pod,
MultiprocExecutor under `iwg serve`).
"""

from __future__ import annotations

import enum
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol

import numpy as np
import numpy.typing as npt

Task = Literal["embed", "generate"]


class ReplicaState(enum.Enum):
    JOINING = "joining"  # some ranks have said hello, not all
    SERVING = "serving"  # every rank joined and heartbeating
    DEAD = "dead"  # a rank left or missed heartbeats; pending batches on it fail


@dataclass(frozen=True)
class Batch:
    """Inputs that travel to one replica together (embeddings; generation streams per request)."""

    task: Task
    inputs: tuple[str | tuple[int, ...], ...]


@dataclass(frozen=True)
class EmbedResult:
    embedding: npt.NDArray[np.float32]
    prompt_tokens: int


ItemResult = EmbedResult


class InputRejected(Exception):
    """One input of a batch could not be sent (e.g. it cannot be encoded on the wire); the batch's other
    inputs ran without it. Only the request holding this input fails, with a 400."""


ItemOutcome = ItemResult | InputRejected


class ReplicaFailure(Exception):
    """The replica died, left or did not answer in time: the batch may be retried on another replica.
    ``reason`` says how it showed (the label of ``iwg_request_retries_total``): ``replica_lost`` (the executor
    lost it, or it did not answer), ``engine_failed`` (its engine failed every request it ran, e.g. a
    collective whose peer rank died: the worker's ``replica_failure`` code), ``engine_unavailable`` (its
    engine refused new work: stopping or failed)."""

    def __init__(self, message: str, reason: str = "replica_lost") -> None:
        super().__init__(message)
        self.reason = reason


class BatchFailure(Exception):
    """The replica answered with an error (e.g. an exception in execute_model): retrying would fail again."""


@dataclass(frozen=True)
class MembershipEvent:
    replica: int
    state: ReplicaState
    reason: str = ""
    draining: bool = False  # a rank of the replica is leaving (its worker got SIGTERM): send it nothing new


MembershipListener = Callable[[MembershipEvent], None]


@dataclass(frozen=True)
class ReplicaStartup:
    """When a replica's worker (its rank 0) started, began loading its model and had loaded it, on this driver's
    monotonic clock (from what the worker's hello said; None where it did not say)."""

    process_started: float | None
    load_began: float | None
    load_done: float | None


class ReplicaPool(Protocol):
    """The replicas of one group. Replica ids are the group's replica indices (0..R-1)."""

    def states(self) -> dict[int, ReplicaState]:
        """Every replica the pool knows of, and its state now."""
        ...

    def add_listener(self, listener: MembershipListener) -> None:
        """Call `listener` (on the event loop's thread) whenever a replica changes state."""
        ...

    async def execute(self, replica: int, batch: Batch, timeout: float) -> Sequence[ItemOutcome]:
        """Run `batch` on `replica`; one outcome per input, in order: its result, or `InputRejected` for an
        input that could not be sent (the others still run).

        Raises ReplicaFailure when the replica dies or `timeout` passes, BatchFailure when it reports an error.
        """
        ...

    async def open_stream(
        self, replica: int, request: dict[str, Any], timeout: float
    ) -> tuple[AsyncIterator[dict[str, Any]], dict[str, Any]]:
        """Start one generation request on `replica`'s engine: its items (ending with the one that has a
        ``finish_reason``) and the engine's answer (``ok`` with ``prompt_tokens``, or ``ok: false`` with
        ``error: {param, message, code}``: refused, nothing runs).

        Raises ReplicaFailure when the replica cannot take it; iterating raises ReplicaFailure when the replica
        dies mid-stream, BatchFailure when the engine failed the request."""
        ...

    async def cancel_streams(self, replica: int, request_ids: list[str], timeout: float) -> None:
        """Stop requests on `replica`'s engine; their KV cache is freed at its next step."""
        ...

    async def engine_stats(
        self, replica: int, timeout: float, blocks_since: list[int] | None = None
    ) -> dict[str, Any]:
        """`replica`'s engine counts: requests_running, requests_waiting, kv_cache_usage, ...; with
        `blocks_since` ([epoch, seq] of the last report, or []) what its prefix cache stored and evicted since
        (``prefix_blocks``, from engines that report it)."""
        ...

    def startup(self, replica: int) -> ReplicaStartup | None:
        """How `replica`'s worker started (None: not known), for the cold start's parts."""
        ...

    async def close(self) -> None: ...
