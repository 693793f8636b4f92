"""An in-process replica pool for unit tests of batching and routing (no workers, no ZMQ)."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
from iwg_worker.driver.pool import (
    Batch,
    BatchFailure,
    EmbedResult,
    GenerateResult,
    ItemResult,
    MembershipEvent,
    MembershipListener,
    ReplicaFailure,
    ReplicaState,
)


@dataclass
class FakeReplica:
    state: ReplicaState = ReplicaState.SERVING
    delay_s: float = 0.01
    fail_next: int = 0  # how many coming batches die with the replica
    error_next: int = 0  # how many coming batches raise a worker error
    batches: list[Batch] = field(default_factory=list)
    hang: bool = False


class FakePool:
    """Embeds text as [len(text), replica] so tests can tell which replica answered which input."""

    def __init__(self, replicas: int = 2, delay_s: float = 0.01) -> None:
        self.replicas = {r: FakeReplica(delay_s=delay_s) for r in range(replicas)}
        self.listeners: list[MembershipListener] = []

    def states(self) -> dict[int, ReplicaState]:
        return {r: rep.state for r, rep in self.replicas.items()}

    def add_listener(self, listener: MembershipListener) -> None:
        self.listeners.append(listener)

    def set_state(self, replica: int, state: ReplicaState) -> None:
        self.replicas.setdefault(replica, FakeReplica()).state = state
        for listener in self.listeners:
            listener(MembershipEvent(replica, state))

    async def execute(self, replica: int, batch: Batch, timeout: float) -> Sequence[ItemResult]:
        rep = self.replicas[replica]
        rep.batches.append(batch)
        if rep.state is not ReplicaState.SERVING:
            raise ReplicaFailure(f"replica {replica} is {rep.state.value}")
        try:
            await asyncio.wait_for(asyncio.sleep(3600 if rep.hang else rep.delay_s), timeout)
        except TimeoutError:
            raise ReplicaFailure(f"replica {replica} timed out after {timeout} s") from None
        if rep.state is not ReplicaState.SERVING:
            raise ReplicaFailure(f"replica {replica} left while running the batch")
        if rep.fail_next:
            rep.fail_next -= 1
            raise ReplicaFailure(f"replica {replica} died")
        if rep.error_next:
            rep.error_next -= 1
            raise BatchFailure("ValueError: boom")
        if batch.task == "generate":
            assert batch.params is not None
            # "Generates" the prompt reversed, cut to max_tokens characters (one token per character).
            texts = [str(x)[::-1][: batch.params.max_tokens] for x in batch.inputs]
            return [
                GenerateResult(
                    t, len(str(x)), len(t), "length" if len(t) == batch.params.max_tokens else "stop"
                )
                for x, t in zip(batch.inputs, texts, strict=True)
            ]
        return [EmbedResult(np.array([len(str(x)), replica], dtype=np.float32), 1) for x in batch.inputs]

    async def close(self) -> None:
        pass
