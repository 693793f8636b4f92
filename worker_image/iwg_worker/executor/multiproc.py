"""`MultiprocExecutor`: WorkerProcs spawned on this machine, reached through a shared-memory ring and ipc sockets.

Each worker is a real ``iwg-worker`` process configured through the same environment variables the operator
writes into pods (`worker_env`), so ``iwg serve`` runs exactly what a pod runs. Calls go to the workers
through one shared-memory ring (`shm_ring`: written once, read by every worker addressed); small replies
come back through one FIFO (`reply_pipe`); stream messages, larger replies, hellos, heartbeats, pings and
calls too large for a ring chunk go over the ipc sockets of `RemoteExecutor`.

Besides heartbeats, the executor watches its processes: a worker that exits makes its replica leave at once.
After start-up, a replica that lost a rank is restarted, all its ranks (a torch.distributed group cannot
take a new member), after a backoff that doubles with each failure in a row.

The workers end with the executor's process, however it ends (`parent_watch`); its private directory and
ring go at `shutdown`, and what a killed run left behind is swept when the next executor starts
(`leftovers`).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from iwg_operator.api import wiring

from iwg_worker import parent_watch, protocol
from iwg_worker.executor import leftovers, shm_ring
from iwg_worker.executor.base import ReplicaLostError
from iwg_worker.executor.remote import RemoteExecutor
from iwg_worker.executor.reply_pipe import ReplyPipeReader
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
    replica_epoch: int = 0,
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
        wiring.ENGINE: config.engine,
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
    if config.enforce_eager:
        env[wiring.ENFORCE_EAGER] = "1"
    if config.chat_template:
        env[wiring.CHAT_TEMPLATE] = config.chat_template
    if config.kv_cache_blocks:
        env[wiring.KV_CACHE_BLOCKS] = str(config.kv_cache_blocks)
    if config.kv_cache_memory_fraction:
        env[wiring.KV_CACHE_MEMORY_FRACTION] = str(config.kv_cache_memory_fraction)
    if master_addr:
        env[wiring.MASTER_ADDR] = master_addr
        env[wiring.MASTER_PORT] = str(master_port or wiring.DEFAULT_MASTER_PORT)
    if replica_epoch:
        env[wiring.REPLICA_EPOCH] = str(replica_epoch)
    return env


def local_rank(replica: int, rank: int, world_size: int, gpus: int) -> int:
    """``LOCAL_RANK`` of a rank among the processes of one machine that sees ``gpus`` GPUs: the index of its
    GPU, the ranks of every replica on GPUs of their own (replicas go round the GPUs when there are more
    ranks than GPUs; a replica's ranks never share one). Without GPUs, the rank itself."""
    if gpus <= 0:
        return rank
    if gpus < world_size:
        raise ValueError(
            f"worldSize {world_size} needs a GPU for each rank of a replica; this machine has {gpus} "
            "(or set spec.worker.device: cpu)"
        )
    return (replica * world_size + rank) % gpus


def _visible_gpus() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def launch_worker(env: dict[str, str], log_path: Path | None = None) -> subprocess.Popen[bytes]:
    """Start ``iwg-worker`` (as ``python -m iwg_worker.worker_proc``) with the contract env on top of ours. The
    worker ends with this process (`parent_watch`)."""
    full_env = {**os.environ, **env, parent_watch.ENV: str(os.getpid())}
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
        *,
        ring: bool = True,
        ring_chunks: int = shm_ring.DEFAULT_CHUNKS,
        ring_chunk_bytes: int = shm_ring.DEFAULT_CHUNK_BYTES,
        ring_spin_s: float | None = None,
        reply_fifo: bool = True,
        restart: bool = True,
        restart_backoff_s: float = 1.0,
        restart_backoff_max_s: float = 30.0,
    ) -> None:
        """Spawn ``replicas * world_size`` WorkerProcs from ``config`` (its replica/rank/world_size are
        filled in per process) and wait until every replica serves; a worker that dies during startup
        raises with the tail of its log.

        ``ring``: calls through a shared-memory ring of ``ring_chunks`` chunks of ``ring_chunk_bytes`` and
        small replies through a FIFO (False: both over the ipc sockets; ``reply_fifo=False``: replies over
        the socket even with the ring); ``ring_spin_s``: how long an idle worker polls the
        ring before it sleeps on its wake-up FIFO (default: `shm_ring.DEFAULT_SPIN_S` when the machine has more
        cores than workers, else 0). ``restart``: after start-up, a replica that lost a rank is
        restarted after ``restart_backoff_s``, doubled with each failure in a row up to
        ``restart_backoff_max_s`` (a replica that ran that long before failing starts from the base again)."""
        # What dead runs (a SIGKILLed `iwg serve`) left: their private directories and rings. Then our own,
        # named after this process and locked while it lives (`leftovers`).
        leftovers.sweep([tempfile.gettempdir(), shm_ring._shm_dir()])
        self._dir, self._dir_lock = leftovers.make_dir()
        self._config = config
        self._worker_cls = worker_cls
        self._worker_extension_cls = worker_extension_cls
        self._extra_env = dict(extra_env or {})
        # The GPUs the ranks spread over (LOCAL_RANK), none when the workers run on the CPU.
        self._gpus = 0 if config.device == "cpu" else _visible_gpus()
        # Polling only pays while every worker and the caller have a core of their own; else it takes the
        # core from the process it waits for.
        spare_cores = (os.cpu_count() or 1) > replicas * world_size
        self._ring_spin_s = ring_spin_s if ring_spin_s is not None else (None if spare_cores else 0.0)
        self._procs: dict[tuple[int, int], WorkerProcess] = {}
        self._exited: set[tuple[int, int]] = set()
        self._restart = _RestartPolicy(restart_backoff_s, restart_backoff_max_s)
        self._restarting = False  # set once every replica served the first time
        self._launch_lock = threading.Lock()
        self._ring: shm_ring.RingWriter | None = None
        self._reply_pipe: ReplyPipeReader | None = None
        if ring:
            self._ring = _make_ring(replicas * world_size, self._dir, ring_chunks, ring_chunk_bytes)
            self._reply_pipe = ReplyPipeReader(self._dir) if reply_fifo else None
        super().__init__(
            f"ipc://{self._dir}/rpc",
            f"ipc://{self._dir}/response",
            replicas=replicas,
            world_size=world_size,
            group=config.group,
            heartbeat_interval_s=heartbeat_interval_s,
            reply_pipe=self._reply_pipe,
        )
        try:
            for replica in range(replicas):
                self._launch_replica(replica)
            self._wait_started(startup_timeout_s)
        except BaseException:
            self.shutdown()
            raise
        self._restarting = restart

    @property
    def processes(self) -> list[WorkerProcess]:
        return list(self._procs.values())

    @property
    def uses_shm_ring(self) -> bool:
        return self._ring is not None

    def _reader(self, replica: int, rank: int) -> int:
        return replica * self.world_size + rank

    def _launch_replica(self, replica: int) -> None:
        # Each launch of a sharded replica: a rendezvous port and a replica epoch of its own (a rank of an
        # earlier launch still running meets none of this one's, as under the operator).
        master_port = free_port() if self.world_size > 1 else None
        epoch = time.time_ns() if self.world_size > 1 else 0
        config = self._config
        for rank in range(self.world_size):
            # All of the group's settings (the KV cache's size too); this process's place in it.
            rank_config = dataclasses.replace(config, replica=replica, rank=rank, world_size=self.world_size)
            env = worker_env(
                rank_config,
                self.rpc_endpoint,
                self.response_endpoint,
                worker_cls=self._worker_cls,
                worker_extension_cls=self._worker_extension_cls,
                heartbeat_interval_s=self.heartbeat_interval_s,
                master_addr="127.0.0.1" if self.world_size > 1 else None,
                master_port=master_port,
                replica_epoch=epoch,
            )
            env[wiring.LOCAL_RANK] = str(local_rank(replica, rank, self.world_size, self._gpus))
            env.update(self._extra_env)
            if self._reply_pipe is not None:
                env.update(self._reply_pipe.env())
            if self._ring is not None:
                reader = self._reader(replica, rank)
                env.update(self._ring.reader_env(reader, self._ring_spin_s))
                with self._send_lock:
                    self._ring.admit(reader)
            log_path = self._dir / f"worker-r{replica}-k{rank}.log"
            self._procs[(replica, rank)] = WorkerProcess(
                replica, rank, launch_worker(env, log_path), log_path
            )
            self._exited.discard((replica, rank))
        self._restart.launched(replica)

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

    # -- calls through the ring ------------------------------------------------------------------------

    def _deliver(
        self, call_id: int, method: str, frames: list[Any], routes: list[tuple[int, tuple[bytes, ...]]]
    ) -> None:
        ring = self._ring
        if ring is None:
            super()._deliver(call_id, method, frames, routes)
            return
        readers = [self._reader(r, rank) for r, route in routes for rank in range(len(route))]
        overflow = not ring.fits(frames)
        try:
            dead = ring.write(
                protocol.encode_overflow(call_id) if overflow else frames,
                readers,
                self._reader_alive,
                timeout=self.heartbeat_timeout_s,
            )
        except shm_ring.RingBusyError as exc:
            self._fail_pending(call_id, exc)
            return
        lost = [r for r in dead if r in readers]
        if lost:  # the others the writer stopped waiting for are not this call's business
            replica, rank = divmod(lost[0], self.world_size)
            self._fail_pending(
                call_id, ReplicaLostError(method, replica, [rank], "its process died while the call was sent")
            )
            return
        if overflow:  # the ring holds its place in the order; the frames go on the socket
            super()._deliver(call_id, method, frames, routes)

    def _reader_alive(self, reader: int) -> bool:
        wp = self._procs.get(divmod(reader, self.world_size))
        return wp is not None and wp.process.poll() is None

    def _member_left(
        self, replica: int, rank: int, reason: str, last_call: int | Literal[False] | None = False
    ) -> None:
        if self._ring is not None:
            self._ring.exclude(self._reader(replica, rank))  # the writer stops waiting on it at once
        super()._member_left(replica, rank, reason, last_call)
        wp = self._procs.get((replica, rank))
        if (
            last_call is False
            and self._restarting
            and not self._closed.is_set()
            and wp is not None
            and wp.process.poll() is None
        ):
            # Silent but running (no heartbeat, or its connection went): it may still read the ring, which
            # no longer waits for it. Stop it; the exit brings the replica back through a restart.
            log.warning(
                "killing worker replica %d rank %d (pid %d): %s", replica, rank, wp.process.pid, reason
            )
            wp.process.kill()

    # -- processes -------------------------------------------------------------------------------------

    def _on_tick(self) -> None:
        now = time.monotonic()
        for key, wp in list(self._procs.items()):
            if key in self._exited:
                continue
            code = wp.process.poll()
            if code is not None:
                self._exited.add(key)
                self._member_left(key[0], key[1], f"process {wp.process.pid} exited with code {code}")
                if self._restarting and not self._closed.is_set():
                    self._schedule_restart(key[0], now)
        for replica in self._restart.due(now):
            ranks = [(replica, k) for k in range(self.world_size)]
            if not all(k in self._exited for k in ranks):
                self._restart.postpone(replica, now + _TICK_S)
                continue
            with self._launch_lock:  # shutdown() either sees this replica's new processes or stops it first
                if self._restarting:
                    self._launch_replica(replica)

    def _schedule_restart(self, replica: int, now: float) -> None:
        delay = self._restart.schedule(replica, now)
        if delay is None:
            return  # already scheduled (another rank of the replica)
        log.warning("restarting replica %d in %.1f s", replica, delay)
        for k in range(self.world_size):
            wp = self._procs[(replica, k)]
            if wp.process.poll() is None:  # its peers: a torch.distributed group cannot take a new member
                wp.process.kill()

    def restarts(self, replica: int) -> int:
        """How many times ``replica`` was restarted."""
        return self._restart.count.get(replica, 0)

    def worker_process(self, replica: int, rank: int) -> WorkerProcess:
        wp = self._procs.get((replica, rank))
        if wp is None:
            raise KeyError(f"no worker process for replica {replica} rank {rank}")
        return wp

    def shutdown(self, grace_s: float = 10.0) -> None:
        """SIGINT every worker (each finishes its in-flight call and says goodbye; no SIGTERM drain: this
        executor, the one driver of these workers, is going away), wait up to ``grace_s``, then kill."""
        with self._launch_lock:
            self._restarting = False
        for wp in self.processes:
            if wp.process.poll() is None:
                wp.process.send_signal(signal.SIGINT)
        deadline = time.monotonic() + grace_s
        for wp in self.processes:
            try:
                wp.process.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.warning("worker replica %d rank %d did not stop in time; killing", wp.replica, wp.rank)
                wp.process.kill()
                wp.process.wait()
        super().shutdown()
        if self._ring is not None:
            self._ring.close()
        if self._reply_pipe is not None:
            self._reply_pipe.close()
        shutil.rmtree(self._dir, ignore_errors=True)
        if self._dir_lock >= 0:
            os.close(self._dir_lock)
            self._dir_lock = -1


_TICK_S = 0.02


def _make_ring(readers: int, directory: Path, chunks: int, chunk_bytes: int) -> shm_ring.RingWriter | None:
    if readers > shm_ring.MAX_READERS:
        log.warning(
            "%d workers: more than a ring's %d readers; calls go over the sockets",
            readers,
            shm_ring.MAX_READERS,
        )
        return None
    try:
        return shm_ring.RingWriter(readers, directory, chunks, chunk_bytes)
    except OSError as exc:
        log.warning("no shared-memory ring (%s); calls go over the sockets", exc)
        return None


@dataclass
class _RestartPolicy:
    """When to restart a replica: a backoff that doubles with each failure in a row."""

    base_s: float
    max_s: float
    failures: dict[int, int] = field(default_factory=dict)
    launched_at: dict[int, float] = field(default_factory=dict)
    pending: dict[int, float] = field(default_factory=dict)  # replica -> monotonic restart time
    count: dict[int, int] = field(default_factory=dict)

    def launched(self, replica: int) -> None:
        if replica in self.launched_at:
            self.count[replica] = self.count.get(replica, 0) + 1
        self.launched_at[replica] = time.monotonic()

    def schedule(self, replica: int, now: float) -> float | None:
        if replica in self.pending:
            return None
        if now - self.launched_at.get(replica, now) >= self.max_s:
            self.failures[replica] = 0  # it ran long enough: this failure starts a new series
        failures = self.failures.get(replica, 0)
        delay = min(self.max_s, self.base_s * float(2**failures))
        self.failures[replica] = failures + 1
        self.pending[replica] = now + delay
        return delay

    def due(self, now: float) -> list[int]:
        due = [r for r, at in self.pending.items() if now >= at]
        for r in due:
            del self.pending[r]
        return due

    def postpone(self, replica: int, at: float) -> None:
        self.pending[replica] = at
