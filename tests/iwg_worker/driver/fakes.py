"""An in-process replica pool for unit tests of batching and routing (no workers, no ZMQ)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from iwg_worker.driver.pool import (
    Batch,
    BatchFailure,
    EmbedResult,
    ItemResult,
    MembershipEvent,
    MembershipListener,
    ReplicaFailure,
    ReplicaStartup,
    ReplicaState,
)


@dataclass
class FakeReplica:
    state: ReplicaState = ReplicaState.SERVING
    delay_s: float = 0.01
    fail_next: int = 0  # how many coming batches die with the replica
    error_next: int = 0  # how many coming batches raise a worker error
    batches: list[Batch] = field(default_factory=list)
    requests: list[dict[str, Any]] = field(default_factory=list)
    cancelled: list[str] = field(default_factory=list)
    die_after_items: int | None = None  # the replica dies after sending this many items of a stream
    hang: bool = False


class FakePool:
    """Embeds text as [len(text), replica] so tests can tell which replica answered which input."""

    def __init__(self, replicas: int = 2, delay_s: float = 0.01) -> None:
        self.replicas = {r: FakeReplica(delay_s=delay_s) for r in range(replicas)}
        self.listeners: list[MembershipListener] = []
        self.startups: dict[
            int, ReplicaStartup
        ] = {}  # how a replica's worker started, as its hello would say

    def startup(self, replica: int) -> ReplicaStartup | None:
        return self.startups.get(replica)

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
        return [EmbedResult(np.array([len(str(x)), replica], dtype=np.float32), 1) for x in batch.inputs]

    async def open_stream(
        self, replica: int, request: dict[str, Any], timeout: float
    ) -> tuple[AsyncIterator[dict[str, Any]], dict[str, Any]]:
        """ "Generates" the prompt reversed, one character (token) per item, cut at max_tokens or a stop."""
        rep = self.replicas[replica]
        rep.requests.append(request)
        if rep.state is not ReplicaState.SERVING:
            raise ReplicaFailure(f"replica {replica} is {rep.state.value}")
        prompt = request.get("prompt") or " ".join(map(str, request["prompt_ids"]))
        text = prompt[::-1][: request["max_tokens"]]
        cut = min((p for p in (text.find(s) for s in request.get("stop") or []) if p >= 0), default=-1)
        finish = "stop" if cut >= 0 or len(text) < request["max_tokens"] else "length"
        text = text[:cut] if cut >= 0 else text

        async def items() -> AsyncIterator[dict[str, Any]]:
            for i, char in enumerate(text or " "):
                await asyncio.sleep(rep.delay_s / max(1, len(text)))
                if rep.die_after_items == i:
                    raise ReplicaFailure(f"replica {replica} died")
                last = i == len(text or " ") - 1
                yield {
                    "id": request["id"],
                    "tokens": [ord(char)] if text else [],
                    "text": char if text else "",
                    "logprobs": None,
                    "token_texts": None,
                    "top_logprobs": None,
                    "finish_reason": finish if last else None,
                    "error": None,
                }

        return items(), {"id": request["id"], "ok": True, "prompt_tokens": len(prompt)}

    async def cancel_streams(self, replica: int, request_ids: list[str], timeout: float) -> None:
        self.replicas[replica].cancelled.extend(request_ids)

    async def engine_stats(
        self, replica: int, timeout: float, blocks_since: list[int] | None = None
    ) -> dict[str, Any]:
        return {"requests_running": 0, "requests_waiting": 0, "kv_cache_usage": 0.0}

    async def close(self) -> None:
        pass
