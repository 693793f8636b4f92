"""Executors: one interface (`Executor`), one file per way of reaching the workers."""

from iwg_worker.executor.base import (
    Executor,
    MembershipEvent,
    ReplicaLostError,
    ReplicaUnavailableError,
    RPCError,
    RPCTimeoutError,
)

__all__ = [
    "Executor",
    "MembershipEvent",
    "RPCError",
    "RPCTimeoutError",
    "ReplicaLostError",
    "ReplicaUnavailableError",
]
