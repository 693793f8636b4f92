"""`ClusterExecutor`: the driver's end of a group whose WorkerProcs run elsewhere (pods) and connect over tcp.

Binds the group's two tcp endpoints with CURVE (only peers holding the group keypair get through) and lets
`RemoteExecutor` keep membership from hellos, heartbeats and goodbyes. Workers are told the address through
``IWG_RPC_ENDPOINT`` / ``IWG_RESPONSE_ENDPOINT`` (see `iwg_operator.api.wiring`).

Interface for the driver (besides `Executor`'s): ``collective_rpc(..., replica=r)`` and
``collective_rpc_future`` / ``collective_rpc_async`` for non-blocking per-replica calls,
``serving_replicas()``, ``members()``, ``subscribe(callback)`` for `MembershipEvent`s,
``wait_until_serving(replicas, timeout)``, ``heartbeat_timeout_s``.
"""

from __future__ import annotations

import os
from pathlib import Path
from urllib.parse import urlsplit

from iwg_operator.api import wiring

from iwg_worker.executor.remote import RemoteExecutor
from iwg_worker.security import CurveKeys


def bind_address(endpoint: str, host: str) -> str:
    """``tcp://name:port`` (what workers connect to) -> ``tcp://host:port`` (what the driver binds)."""
    parts = urlsplit(endpoint)
    if parts.scheme != "tcp" or parts.port is None:
        raise ValueError(f"endpoint {endpoint!r} must be tcp://host:port")
    return f"tcp://{host}:{parts.port}"


class ClusterExecutor(RemoteExecutor):
    def __init__(
        self,
        rpc_endpoint: str,
        response_endpoint: str,
        replicas: int = 1,
        world_size: int = 1,
        keys: CurveKeys | None = None,
        curve_dir: str | Path | None = None,
        insecure: bool = False,
        group: str = "",
        heartbeat_interval_s: float = wiring.DEFAULT_HEARTBEAT_INTERVAL_S,
        heartbeat_misses: int = wiring.DEFAULT_HEARTBEAT_MISSES,
    ) -> None:
        """Bind ``rpc_endpoint`` and ``response_endpoint`` (``tcp://host:port``; port 0 picks one, read the
        bound address back from ``self.rpc_endpoint`` / ``self.response_endpoint``). CURVE keys come from
        ``keys`` or ``curve_dir``; running without them needs ``insecure=True`` (benchmarks only)."""
        if keys is None and curve_dir is not None:
            keys = CurveKeys.load(curve_dir)
        if keys is None and not insecure:
            raise ValueError("ClusterExecutor needs the group's CURVE keys (keys= or curve_dir=)")
        for name, endpoint in (("rpc_endpoint", rpc_endpoint), ("response_endpoint", response_endpoint)):
            if not endpoint.startswith("tcp://"):
                raise ValueError(f"{name} must be tcp://host:port, got {endpoint!r}")
        super().__init__(
            rpc_endpoint,
            response_endpoint,
            replicas=replicas,
            world_size=world_size,
            keys=keys,
            group=group,
            heartbeat_interval_s=heartbeat_interval_s,
            heartbeat_misses=heartbeat_misses,
        )

    @classmethod
    def from_env(cls, environ: dict[str, str] | None = None) -> ClusterExecutor:
        """The driver pod's executor: endpoints, replicas, world size and keys from the wiring contract;
        binds the endpoints' ports on ``IWG_POD_IP`` (all interfaces when unset)."""
        env = dict(os.environ if environ is None else environ)
        for name in (wiring.RPC_ENDPOINT, wiring.RESPONSE_ENDPOINT, wiring.CURVE_DIR):
            if not env.get(name):
                raise ValueError(f"environment variable {name} is required")
        host = env.get(wiring.POD_IP) or "0.0.0.0"
        return cls(
            bind_address(env[wiring.RPC_ENDPOINT], host),
            bind_address(env[wiring.RESPONSE_ENDPOINT], host),
            replicas=int(env.get(wiring.REPLICAS) or 1),
            world_size=int(env.get(wiring.WORLD_SIZE) or 1),
            curve_dir=env[wiring.CURVE_DIR],
            group=env.get(wiring.GROUP, ""),
            heartbeat_interval_s=float(
                env.get(wiring.HEARTBEAT_INTERVAL) or wiring.DEFAULT_HEARTBEAT_INTERVAL_S
            ),
        )
