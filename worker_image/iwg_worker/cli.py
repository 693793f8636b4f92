"""`iwg`: the command line. `iwg serve MANIFEST` runs an InferenceWorkerGroup on this machine.

The manifest is validated by the operator's own models (`iwg_operator.api.v1alpha1.load_manifest`), so a
manifest `iwg serve` accepts is one the API server accepts. The group runs as it would in a cluster: a
driver (HTTP, batching, routing) and `replicas x worldSize` `iwg-worker` processes, spawned by
`MultiprocExecutor` and reached through its shared-memory ring and ZMQ ipc; a replica that loses a worker
is restarted after ``spec.health``'s backoff. With ``--executor ray`` the ranks are Ray actors instead
(`RayExecutor`, the ``ray`` extra), on a local Ray or the cluster at ``--ray-address``. With 0 replicas (which
needs ``spec.autoscaling`` enabled with ``minReplicas: 0``) the driver starts alone and one replica's workers
start on the first request and stop when idle (`iwg_worker.driver.zero_pool`).

SIGTERM, SIGINT and SIGHUP stop it cleanly, at any point: the workers stop and the shared-memory ring and the
private directory are removed. Killed with SIGKILL, its workers end by themselves (`parent_watch`) and the
next ``iwg serve`` on the machine removes what it left (`executor.leftovers`).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import secrets
import signal
import sys
from pathlib import Path
from types import FrameType
from typing import Any

from iwg_operator.api.v1alpha1 import InferenceWorkerGroup, ManifestError, load_manifest

log = logging.getLogger("iwg")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="iwg", description="InferenceWorkerGroup tools")
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="run a group on this machine: driver + local worker processes")
    serve.add_argument("manifest", type=Path, help="an InferenceWorkerGroup YAML manifest")
    serve.add_argument("--host", default="127.0.0.1", help="HTTP address (default: 127.0.0.1)")
    serve.add_argument(
        "--port", type=int, default=None, help="HTTP port (default: spec.driver.port; 0 picks one)"
    )
    serve.add_argument("--replicas", type=int, default=None, help="override spec.replicas")
    serve.add_argument(
        "--admin-token-file",
        type=Path,
        default=None,
        help="file with the admin API's bearer token (default: a fresh token, printed at start)",
    )
    serve.add_argument("--startup-timeout", type=float, default=300.0, help="seconds to wait for the workers")
    serve.add_argument(
        "--heartbeat-interval", type=float, default=None, help="seconds between heartbeats (default: 1)"
    )
    serve.add_argument(
        "--executor",
        choices=("multiproc", "ray"),
        default="multiproc",
        help="how ranks run: local processes over ZMQ ipc (default), or Ray actors (needs the 'ray' extra)",
    )
    serve.add_argument(
        "--ray-address",
        default=None,
        help="with --executor ray: the Ray cluster to join (default: RAY_ADDRESS, else a local Ray)",
    )
    return parser


STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


class _Stop(Exception):
    pass


def _raise_stop(signum: int, _frame: FrameType | None) -> None:
    raise _Stop(signal.Signals(signum).name)


def serve(args: argparse.Namespace) -> int:
    try:
        group = load_manifest(args.manifest)
    except ManifestError as exc:
        print(f"iwg serve: {exc}", file=sys.stderr)
        return 2
    try:
        model_path = group.spec.model.resolved_path()
    except ValueError as exc:
        print(f"iwg serve: {exc}", file=sys.stderr)
        return 2
    if not model_path.is_dir():
        print(f"iwg serve: spec.model.path: {model_path} is not a directory on this machine", file=sys.stderr)
        return 2
    from iwg_worker.model_dir import missing_parts

    missing = missing_parts(model_path, group.spec.model.task)
    if missing:
        print(
            f"iwg serve: spec.model.path: {model_path} is not a model directory for task "
            f"{group.spec.model.task!r}: {'; '.join(missing)}",
            file=sys.stderr,
        )
        return 2
    refusal = _sharding_refusal(model_path, group.spec.world_size)
    if refusal is not None:
        print(f"iwg serve: spec.worldSize: {refusal}", file=sys.stderr)
        return 2
    replicas = group.spec.replicas if args.replicas is None else args.replicas
    autoscaling = group.spec.autoscaling
    if replicas < 0 or (replicas == 0 and not (autoscaling.enabled and autoscaling.min_replicas == 0)):
        print(
            "iwg serve: needs at least one replica (spec.replicas or --replicas), or 0 with spec.autoscaling "
            "enabled and minReplicas 0 (a replica then starts on the first request)",
            file=sys.stderr,
        )
        return 2
    token = _admin_token(args.admin_token_file)
    if token is None:
        return 2

    # A signal during the (long) worker start-up unwinds through MultiprocExecutor, which stops its workers;
    # one after it, through the executor's shutdown below. While HTTP serves, the driver's loop takes them.
    previous = {sig: signal.signal(sig, _raise_stop) for sig in STOP_SIGNALS}
    executor = None  # with 0 replicas the driver alone: it starts one replica's workers on the first request
    try:
        if replicas > 0:
            try:
                executor = _start_workers(group, str(model_path), replicas, args)
            except _Stop as stop:
                print(f"iwg serve: stopped by {stop} during start-up", file=sys.stderr)
                return 130
            except (RuntimeError, TimeoutError, ValueError) as exc:
                print(f"iwg serve: the workers did not start: {exc}", file=sys.stderr)
                return 1
        try:
            engine = (
                _engine_words(executor, replicas, group.spec.model.engine)
                if executor is not None and group.spec.model.task == "generate"
                else None
            )
            asyncio.run(_serve_http(group, executor, replicas, token, args, engine))
        except _Stop as stop:
            print(f"iwg serve: stopped by {stop}", file=sys.stderr)
        finally:
            # Ignore further signals until the workers are stopped and the ring and directory removed.
            for sig in STOP_SIGNALS:
                signal.signal(sig, signal.SIG_IGN)
            if executor is not None:
                executor.shutdown()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    print("iwg serve: stopped", file=sys.stderr)
    return 0


def _sharding_refusal(model_path: Path, world_size: int) -> str | None:
    """Why the model cannot be sharded ``world_size`` ways (read from its configuration, before any worker
    starts), or None."""
    if world_size <= 1:
        return None
    from iwg_worker.models.sharding import ShardingRefused, check_shardable, load_config

    try:
        check_shardable(load_config(model_path, local_files_only=True), world_size)
    except ShardingRefused as exc:
        return str(exc)
    return None


def _engine_words(executor: Any, replicas: int, requested: str) -> str:
    """What the start line says of the generation engine: the one every replica resolved (`engine vllm`), each
    replica's when they differ, or the requested choice when a replica does not say (`engine auto requested`).
    """
    from iwg_worker.executor.base import DEFAULT_HEALTH_TIMEOUT_S

    resolved: list[object] = []
    for replica in range(replicas):
        try:
            report = executor.check_health(timeout=DEFAULT_HEALTH_TIMEOUT_S, replica=replica)[0]
        except (RuntimeError, TimeoutError) as exc:
            log.warning("replica %d did not say which engine it runs: %s", replica, exc)
            report = {}
        resolved.append(report.get("engine") if isinstance(report, dict) else None)
    if not all(isinstance(engine, str) for engine in resolved):
        return f"engine {requested} requested"
    if len(set(resolved)) == 1:
        return f"engine {resolved[0]}"
    return "engines " + ", ".join(f"replica {replica} {engine}" for replica, engine in enumerate(resolved))


def _admin_token(path: Path | None) -> str | None:
    from iwg_worker.driver.main import ConfigError, read_admin_token

    if path is None:
        return secrets.token_urlsafe(24)
    try:
        return read_admin_token(str(path))
    except ConfigError as exc:
        print(f"iwg serve: {exc}", file=sys.stderr)
        return None


def _start_workers(
    group: InferenceWorkerGroup, model_path: str, replicas: int, args: argparse.Namespace
) -> Any:
    from iwg_operator.api import wiring

    from iwg_worker.executor.multiproc import MultiprocExecutor
    from iwg_worker.worker_base import WorkerConfig
    from iwg_worker.worker_proc import DEFAULT_WORKER_CLS

    spec = group.spec
    world = spec.world_size
    # Workers share this machine's cores: give each its share so torch threads do not fight.
    threads = max(1, (os.cpu_count() or 1) // (replicas * world))
    extra_env = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    if "OMP_NUM_THREADS" not in os.environ:
        extra_env["OMP_NUM_THREADS"] = str(threads)
    extra_env.update({e.name: e.value for e in spec.worker.env})
    config = WorkerConfig(
        task=spec.model.task,
        model_path=model_path,
        served_name=group.served_name,
        device=spec.worker.device,
        dtype=spec.model.dtype,
        engine=spec.model.engine,
        enforce_eager=spec.model.enforce_eager,
        chat_template=spec.model.chat_template,
        group=group.name,
        kv_cache_blocks=spec.model.kv_cache.blocks if spec.model.kv_cache else None,
        kv_cache_memory_fraction=spec.model.kv_cache.memory_fraction if spec.model.kv_cache else None,
    )
    log.info(
        "starting %d replica(s) x %d rank(s) of %r (%s%s) from %s",
        replicas,
        world,
        group.name,
        spec.model.task,
        f", engine {spec.model.engine}{', eager' if spec.model.enforce_eager else ''}"
        if spec.model.task == "generate"
        else "",
        model_path,
    )
    if args.executor == "ray":
        try:
            from iwg_worker.executor.ray import RayExecutor
        except ImportError as exc:
            raise RuntimeError(
                f"--executor ray needs the 'ray' extra (pip install 'iwg[ray]'): {exc}"
            ) from exc

        return RayExecutor(
            config,
            replicas=replicas,
            world_size=world,
            worker_cls=spec.worker.worker_cls or DEFAULT_WORKER_CLS,
            worker_extension_cls=spec.worker.worker_extension_cls,
            startup_timeout_s=args.startup_timeout,
            extra_env=extra_env,
            ray_address=args.ray_address,
        )
    return MultiprocExecutor(
        config,
        replicas=replicas,
        world_size=world,
        worker_cls=spec.worker.worker_cls or DEFAULT_WORKER_CLS,
        worker_extension_cls=spec.worker.worker_extension_cls,
        heartbeat_interval_s=args.heartbeat_interval or wiring.DEFAULT_HEARTBEAT_INTERVAL_S,
        startup_timeout_s=args.startup_timeout,
        extra_env=extra_env,
        # A replica that loses a worker comes back as the operator would bring it back: spec.health's backoff.
        restart=spec.health.max_restarts > 0,
        restart_backoff_s=float(spec.health.backoff_seconds),
        restart_backoff_max_s=float(spec.health.max_backoff_seconds),
    )


async def _serve_http(
    group: InferenceWorkerGroup,
    executor: Any,
    replicas: int,
    token: str,
    args: argparse.Namespace,
    engine: str | None = None,
) -> None:
    from iwg_worker.driver.executor_pool import ExecutorPool
    from iwg_worker.driver.pool import ReplicaPool
    from iwg_worker.driver.server import run_driver
    from iwg_worker.driver.service import Driver, DriverConfig
    from iwg_worker.driver.zero_pool import LocalScaler, ZeroPool, scaling
    from iwg_worker.model_dir import context_length, vocab_size

    batching = group.spec.driver.batching
    autoscaling = group.spec.autoscaling
    model_path = group.spec.model.resolved_path()
    config = DriverConfig(
        served_name=group.served_name,
        task=group.spec.model.task,
        max_batch_size=batching.max_batch_size,
        max_wait_ms=float(batching.max_wait_ms),
        max_queue=batching.max_queue,
        vocab_size=vocab_size(model_path),
        context_length=context_length(model_path),
        routing_policy=group.spec.driver.routing.policy,
        load_bound=group.spec.driver.routing.load_bound,
        # As the operator sets it (builders/driver.py): requests are held while no replica serves.
        activation_timeout_s=float(autoscaling.activation_timeout_seconds)
        if autoscaling.min_replicas == 0
        else 0.0,
    )
    zero = ZeroPool() if replicas == 0 else None
    pool: ReplicaPool = zero if zero is not None else ExecutorPool(executor)
    driver = Driver(config, pool)
    port = group.spec.driver.port if args.port is None else args.port

    def listening(bound: int) -> None:
        # One line a script can wait for; the token goes to stderr only when we made it up.
        shape = f"{replicas} replicas" + (f", {engine}" if engine else "")
        if zero is not None:
            shape += ", one starts on the first request"
        print(f"iwg serve: {group.served_name} on http://{args.host}:{bound}/v1 ({shape})", flush=True)
        if args.admin_token_file is None:
            print(f"iwg serve: admin token (Authorization: Bearer): {token}", file=sys.stderr, flush=True)

    if zero is None:
        await run_driver(driver, args.host, port, token, on_listening=listening, signals=STOP_SIGNALS)
        return
    model = str(model_path)
    scaler = LocalScaler(
        driver,
        zero,
        lambda: _start_workers(group, model, 1, args),
        autoscaling,
        float(group.spec.rollout.drain_timeout_seconds),
    )
    async with scaling(scaler):
        await run_driver(driver, args.host, port, token, on_listening=listening, signals=STOP_SIGNALS)


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(
        level=os.environ.get("IWG_LOG_LEVEL", "INFO"),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    args = _parser().parse_args(argv)
    if args.command == "serve":
        return serve(args)
    return 2


if __name__ == "__main__":
    sys.exit(main())
