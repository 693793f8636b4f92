"""`iwg-driver`: the group's driver in its pod. Everything it needs comes from the wiring contract
(`iwg_operator.api.wiring`), written by the operator's pod builder:

- identity and size: IWG_GROUP, IWG_REPLICAS, IWG_WORLD_SIZE
- ZMQ: IWG_RPC_ENDPOINT, IWG_RESPONSE_ENDPOINT (bound on IWG_POD_IP), IWG_CURVE_DIR, IWG_HEARTBEAT_INTERVAL_S
- model: IWG_MODEL_TASK (embed | generate), IWG_SERVED_NAME
- HTTP: IWG_HTTP_PORT (8000), IWG_HTTP_HOST (all interfaces)
- batching: IWG_MAX_BATCH_SIZE (32), IWG_MAX_WAIT_MS (5), IWG_MAX_QUEUE (1024)
- routing of generation requests: IWG_ROUTING_POLICY (cacheAware | leastLoaded), IWG_ROUTING_LOAD_BOUND (0.25)
- scale from zero: IWG_ACTIVATION_TIMEOUT_S (0: off; else requests wait that long for a replica, activation.py)
- admin: IWG_ADMIN_TOKEN_FILE (a file holding the bearer token; the admin API is off without it)
"""

from __future__ import annotations

import asyncio
import logging
import os
import sys
from collections.abc import Mapping
from pathlib import Path

from iwg_operator.api import wiring

from iwg_worker import protocol
from iwg_worker.driver.service import DriverConfig
from iwg_worker.model_dir import context_length, vocab_size


class ConfigError(ValueError):
    pass


def _int(env: Mapping[str, str], name: str, default: int, minimum: int = 0) -> int:
    raw = env.get(name)
    if not raw:
        return default
    try:
        value = int(raw)
    except ValueError:
        raise ConfigError(f"environment variable {name} must be an integer, got {raw!r}") from None
    if value < minimum:
        raise ConfigError(f"environment variable {name} must be >= {minimum}, got {value}")
    return value


def _float(env: Mapping[str, str], name: str, default: float) -> float:
    raw = env.get(name)
    if not raw:
        return default
    try:
        value = float(raw)
    except ValueError:
        raise ConfigError(f"environment variable {name} must be a number, got {raw!r}") from None
    if not value >= 0:
        raise ConfigError(f"environment variable {name} must be >= 0, got {raw!r}")
    return value


def driver_config_from_env(env: Mapping[str, str]) -> DriverConfig:
    task = env.get(wiring.MODEL_TASK, "")
    if task not in ("embed", "generate"):
        raise ConfigError(f"environment variable {wiring.MODEL_TASK} must be embed or generate, got {task!r}")
    served_name = env.get(wiring.SERVED_NAME) or env.get(wiring.GROUP)
    if not served_name:
        raise ConfigError(f"environment variable {wiring.SERVED_NAME} (or {wiring.GROUP}) is required")
    max_batch_size = _int(env, wiring.MAX_BATCH_SIZE, 32, minimum=1)
    model_dir = _model_dir(env.get(wiring.MODEL_PATH, ""))
    policy = env.get(wiring.ROUTING_POLICY) or "cacheAware"
    if policy not in ("cacheAware", "leastLoaded"):
        raise ConfigError(
            f"environment variable {wiring.ROUTING_POLICY} must be cacheAware or leastLoaded, got {policy!r}"
        )
    return DriverConfig(
        vocab_size=vocab_size(model_dir) if model_dir else None,
        context_length=context_length(model_dir) if model_dir else None,
        served_name=served_name,
        task=task,  # type: ignore[arg-type]  # checked above
        max_batch_size=max_batch_size,
        max_wait_ms=_float(env, wiring.MAX_WAIT_MS, 5.0),
        max_queue=_int(env, wiring.MAX_QUEUE, 1024, minimum=1),
        routing_policy=policy,  # type: ignore[arg-type]  # checked above
        load_bound=_float(env, wiring.ROUTING_LOAD_BOUND, 0.25),
        activation_timeout_s=_float(env, wiring.ACTIVATION_TIMEOUT, 0.0),
    )


def _model_dir(path: str) -> Path | None:
    """The model directory the workers serve, when the driver's pod mounts it too (a volume or a `pkg:`
    path): its vocabulary and context length let token-id prompts be refused per request instead of failing
    a worker's batch."""
    from iwg_operator.api.v1alpha1 import resolve_model_path

    if not path:
        return None
    try:
        return resolve_model_path(path)
    except ValueError:
        return None


def read_admin_token(path: str | None) -> str | None:
    """The admin bearer token, from a file (mounted from a Secret); None turns the admin API off."""
    if not path:
        return None
    try:
        token = Path(path).read_text().strip()
    except OSError as exc:
        raise ConfigError(
            f"cannot read the admin token file {path!r} ({wiring.ADMIN_TOKEN_FILE}): {exc}"
        ) from None
    if len(token) < 16:
        raise ConfigError(f"the admin token in {path!r} is shorter than 16 characters")
    return token


async def _run(env: Mapping[str, str]) -> None:
    from iwg_worker.driver.executor_pool import ExecutorPool
    from iwg_worker.driver.server import run_driver
    from iwg_worker.driver.service import Driver
    from iwg_worker.executor.cluster import ClusterExecutor

    config = driver_config_from_env(env)
    token = read_admin_token(env.get(wiring.ADMIN_TOKEN_FILE))
    port = _int(env, wiring.HTTP_PORT, wiring.DEFAULT_HTTP_PORT)
    host = env.get(wiring.HTTP_HOST) or "0.0.0.0"
    lame_duck_s = _float(env, wiring.DRIVER_LAME_DUCK, wiring.DEFAULT_DRIVER_LAME_DUCK_S)
    executor = await asyncio.to_thread(ClusterExecutor.from_env, dict(env))
    pool = ExecutorPool(executor)
    logging.getLogger(__name__).info(
        "group %r: waiting for %d replicas x %d ranks on %s / %s",
        env.get(wiring.GROUP, ""),
        executor.replicas,
        executor.world_size,
        executor.rpc_endpoint,
        executor.response_endpoint,
    )
    # After SIGTERM the pod keeps serving a moment (each answer closing its connection) before it stops
    # accepting: the Service stops sending it new connections meanwhile, and clients move their kept-alive ones.
    await run_driver(
        Driver(config, pool),
        host,
        port,
        token,
        drain_timeout_s=wiring.DRIVER_DRAIN_S,
        lame_duck_s=lame_duck_s,
    )


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(
        level=os.environ.get("IWG_LOG_LEVEL", "INFO"),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    # The driver process reads what workers computed and computes nothing: it never needs torch (protocol.py
    # says why). Set for the process, here at its entry point.
    protocol.decode_tensors_as_numpy()
    try:
        asyncio.run(_run(os.environ))
    except (ConfigError, ValueError) as exc:
        print(f"iwg-driver: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
