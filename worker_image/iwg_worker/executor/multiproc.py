"""`MultiprocExecutor`: WorkerProcs spawned on this machine, reached over ipc sockets.

Each worker is a real ``iwg-worker`` process configured through the same environment variables the operator
writes into pods (`worker_env`), so ``iwg serve`` runs exactly what a pod runs. Besides heartbeats, the
executor watches its processes: a worker that exits makes its replica leave at once.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from iwg_operator.api import wiring

from iwg_worker.executor.remote import RemoteExecutor
from iwg_worker.worker_base import WorkerConfig
from iwg_worker.worker_proc import DEFAULT_WORKER_CLS

log = logging.getLogger(__name__)


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def worker_env(
    config: WorkerConfig,
    rpc_endpoint: str,
    response_endpoint: str,
    *,
    curve_dir: str | None = None,
    insecure_tcp: bool = False,
    worker_cls: str = DEFAULT_WORKER_CLS,
    worker_extension_cls: str | None = None,
    health_port: int = 0,
    heartbeat_interval_s: float = wiring.DEFAULT_HEARTBEAT_INTERVAL_S,
    master_addr: str | None = None,
    master_port: int | None = None,
    pod_name: str | None = None,
) -> dict[str, str]:
    """The wiring-contract environment for one worker process (what a pod builder writes)."""
    env = {
        wiring.GROUP: config.group,
        wiring.REPLICA: str(config.replica),
        wiring.RANK: str(config.rank),
        wiring.WORLD_SIZE: str(config.world_size),
        wiring.POD_NAME: pod_name or f"{config.group}-r{config.replica}-k{config.rank}",
        wiring.RPC_ENDPOINT: rpc_endpoint,
        wiring.RESPONSE_ENDPOINT: response_endpoint,
        wiring.HEALTH_PORT: str(health_port),
        wiring.HEARTBEAT_INTERVAL: str(heartbeat_interval_s),
        wiring.MODEL_TASK: config.task,
        wiring.MODEL_PATH: config.model_path,
        wiring.SERVED_NAME: config.served_name,
        wiring.DEVICE: config.device,
        wiring.DTYPE: config.dtype,
        wiring.WORKER_CLS: worker_cls,
        wiring.TORCH_RANK: str(config.rank),
        wiring.TORCH_WORLD_SIZE: str(config.world_size),
    }
    if curve_dir:
        env[wiring.CURVE_DIR] = curve_dir
    if insecure_tcp:
        env[wiring.INSECURE_TCP] = "1"
    if worker_extension_cls:
        env[wiring.WORKER_EXTENSION_CLS] = worker_extension_cls
    if master_addr:
        env[wiring.MASTER_ADDR] = master_addr
        env[wiring.MASTER_PORT] = str(master_port or wiring.DEFAULT_MASTER_PORT)
    return env


def launch_worker(env: dict[str, str], log_path: Path | None = None) -> subprocess.Popen[bytes]:
    """Start ``iwg-worker`` (as ``python -m iwg_worker.worker_proc``) with the contract env on top of ours."""
    full_env = {**os.environ, **env}
    stderr = open(log_path, "ab") if log_path is not None else None  # noqa: SIM115 - handed to the child
    try:
        return subprocess.Popen(
            [sys.executable, "-m", "iwg_worker.worker_proc"],
            env=full_env,
            stdin=subprocess.DEVNULL,
            stdout=stderr,
            stderr=stderr,
        )
    finally:
        if stderr is not None:
            stderr.close()


@dataclass(frozen=True, slots=True)
class WorkerProcess:
    replica: int
    rank: int
    process: subprocess.Popen[bytes]
    log_path: Path

    def log_tail(self, lines: int = 15) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""


class MultiprocExecutor(RemoteExecutor):
    def __init__(
        self,
        config: WorkerConfig,
        replicas: int = 1,
        world_size: int = 1,
        worker_cls: str = DEFAULT_WORKER_CLS,
        worker_extension_cls: str | None = None,
        heartbeat_interval_s: float = wiring.DEFAULT_HEARTBEAT_INTERVAL_S,
        startup_timeout_s: float = 600.0,
        extra_env: dict[str, str] | None = None,
    ) -> None:
        """Spawn ``replicas * world_size`` WorkerProcs from ``config`` (its replica/rank/world_size are
        filled in per process) and wait until every replica serves; a worker that dies during startup
        raises with the tail of its log."""
        self._dir = Path(tempfile.mkdtemp(prefix="iwg-"))
        self.processes: list[WorkerProcess] = []
        self._exited: set[int] = set()
        super().__init__(
            f"ipc://{self._dir}/rpc",
            f"ipc://{self._dir}/response",
            replicas=replicas,
            world_size=world_size,
            group=config.group,
            heartbeat_interval_s=heartbeat_interval_s,
        )
        try:
            for replica in range(replicas):
                master_port = free_port() if world_size > 1 else None
                for rank in range(world_size):
                    rank_config = WorkerConfig(
                        task=config.task,
                        model_path=config.model_path,
                        served_name=config.served_name,
                        device=config.device,
                        dtype=config.dtype,
                        group=config.group,
                        replica=replica,
                        rank=rank,
                        world_size=world_size,
                    )
                    env = worker_env(
                        rank_config,
                        self.rpc_endpoint,
                        self.response_endpoint,
                        worker_cls=worker_cls,
                        worker_extension_cls=worker_extension_cls,
                        heartbeat_interval_s=heartbeat_interval_s,
                        master_addr="127.0.0.1" if world_size > 1 else None,
                        master_port=master_port,
                    )
                    env.update(extra_env or {})
                    log_path = self._dir / f"worker-r{replica}-k{rank}.log"
                    self.processes.append(
                        WorkerProcess(replica, rank, launch_worker(env, log_path), log_path)
                    )
            self._wait_started(startup_timeout_s)
        except BaseException:
            self.shutdown()
            raise

    def _wait_started(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while True:
            for wp in self.processes:
                code = wp.process.poll()
                if code is not None:
                    raise RuntimeError(
                        f"worker replica {wp.replica} rank {wp.rank} exited with code {code} during startup:\n"
                        f"{wp.log_tail()}"
                    )
            try:
                self.wait_until_serving(timeout=min(0.5, max(0.0, deadline - time.monotonic())))
                return
            except TimeoutError:
                if time.monotonic() >= deadline:
                    raise

    def _on_tick(self) -> None:
        for index, wp in enumerate(self.processes):
            if index in self._exited:
                continue
            code = wp.process.poll()
            if code is not None:
                self._exited.add(index)
                self._member_left(wp.replica, wp.rank, f"process {wp.process.pid} exited with code {code}")

    def worker_process(self, replica: int, rank: int) -> WorkerProcess:
        for wp in self.processes:
            if (wp.replica, wp.rank) == (replica, rank):
                return wp
        raise KeyError(f"no worker process for replica {replica} rank {rank}")

    def shutdown(self, grace_s: float = 10.0) -> None:
        """SIGTERM every worker (each drains and says goodbye), wait up to ``grace_s``, then kill."""
        for wp in self.processes:
            if wp.process.poll() is None:
                wp.process.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for wp in self.processes:
            try:
                wp.process.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.warning("worker replica %d rank %d did not stop in time; killing", wp.replica, wp.rank)
                wp.process.kill()
                wp.process.wait()
        super().shutdown()
        shutil.rmtree(self._dir, ignore_errors=True)
