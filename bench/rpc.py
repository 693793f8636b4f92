"""Worker RPC benchmark: collective_rpc round trips beside raw pyzmq, all measured in one run.

For each executor (UniProc; Multiproc through its shared-memory ring and reply FIFO, through the ring with
replies on the socket (``reply_fifo=False``), and with ``ring=False`` over ipc sockets; Cluster over tcp with CURVE on and off), 1 and 4 workers, and
64 B / 1 MiB / 16 MiB tensor payloads, it times ``collective_rpc("echo", (tensor,))`` and, right beside it, a
raw pyzmq ROUTER -> DEALER echo of the same bytes over the same transport (same CURVE setting) to as many
echo processes. Timings alternate between the two in rounds, so load on the machine hits both alike; the
table shows medians and the ratio iwg / raw. It also times a proxied call through `WorkerWrapperBase`
against the same direct call on the worker.

Multiproc, ring against sockets, same run: a 16 MiB broadcast to 4 workers whose replies are a small int
(the tests' `ProbeExtension.touch` reads a byte of every page), and the CPU time the 4 idle workers
of each group use over 10 s.

Run: ``python -m bench.rpc`` from the repository root (about 3 minutes on 2 cores, most of it starting 20
worker processes); ``python -m bench.rpc --multiproc-only``: the three Multiproc groups, their broadcast and
idle rows, beside the raw ipc echo (12 worker processes).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
import timeit
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil
import torch
import zmq
from iwg_worker.executor.base import Executor
from iwg_worker.executor.cluster import ClusterExecutor
from iwg_worker.executor.multiproc import MultiprocExecutor, launch_worker, worker_env
from iwg_worker.executor.uniproc import UniProcExecutor
from iwg_worker.security import CurveKeys, ZapAuthenticator, make_server
from iwg_worker.torch_worker import TorchWorker
from iwg_worker.worker_base import WorkerConfig
from iwg_worker.worker_wrapper import WorkerWrapperBase

SIZES = {"64 B": 64, "1 MiB": 1 << 20, "16 MiB": 16 << 20}
ITERATIONS = {"64 B": 400, "1 MiB": 60, "16 MiB": 12}
ROUNDS = 4
REPLICAS = 4  # groups of 4 one-rank replicas: replica=0 is "1 worker", replica=None is "4 workers"
# `echo` (and `touch`) are test helpers, not production methods: workers get them from the tests' extension
# class, which the spawned workers (and Ray's actors) import from this checkout.
ECHO_EXTENSION = "tests.iwg_worker.extensions.ProbeExtension"
_ROOT = Path(__file__).resolve().parents[1]
os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(_ROOT), os.environ.get("PYTHONPATH")) if p)
BROADCAST_BYTES = 16 << 20
BROADCAST_ITERATIONS = 16
IDLE_S = 10.0


# -- raw pyzmq baseline -------------------------------------------------------------------------------------


class RawGroup:
    def __init__(self, endpoint: str, workers: int, keys: CurveKeys | None, curve_dir: str | None) -> None:
        self.context = zmq.Context()
        self.zap = None
        if keys is not None:
            self.zap = ZapAuthenticator(self.context, keys.public)
        self.router = self.context.socket(zmq.ROUTER)
        if keys is not None:
            make_server(self.router, keys)
        self.router.bind(endpoint)
        self.endpoint = self.router.get_string(zmq.LAST_ENDPOINT)
        self.procs = [
            subprocess.Popen([sys.executable, "-m", "bench.zmq_echo", self.endpoint, curve_dir or ""])
            for _ in range(workers)
        ]
        self.ids = [self.router.recv_multipart()[0] for _ in range(workers)]

    def round_trip(self, payload: Any, workers: int) -> None:
        for identity in self.ids[:workers]:
            self.router.send_multipart([identity, payload], copy=False)
        for _ in range(workers):
            self.router.recv_multipart(copy=False)

    def close(self) -> None:
        for identity in self.ids:
            self.router.send_multipart([identity, b"stop"])
        for proc in self.procs:
            proc.wait(timeout=10)
        self.router.close(linger=0)
        if self.zap is not None:
            self.zap.stop()
        self.context.term()


# -- measurement -------------------------------------------------------------------------------------------


def _samples(fn: Callable[[], None], n: int) -> list[float]:
    out = []
    for _ in range(n):
        started = time.perf_counter()
        fn()
        out.append(time.perf_counter() - started)
    return out


def compare(iwg: Callable[[], None], raw: Callable[[], None], n: int) -> tuple[float, float]:
    """Median seconds of each, measured in alternating rounds after a warm-up."""
    for fn in (iwg, raw):
        _samples(fn, max(2, n // 10))
    a: list[float] = []
    b: list[float] = []
    for _ in range(ROUNDS):
        a += _samples(iwg, max(1, n // ROUNDS))
        b += _samples(raw, max(1, n // ROUNDS))
    return statistics.median(a), statistics.median(b)


@dataclass
class Row:
    executor: str
    transport: str
    workers: int
    payload: str
    iwg_s: float
    raw_s: float

    def cells(self) -> list[str]:
        size = SIZES[self.payload] * self.workers * 2  # bytes moved per round trip, both ways
        return [
            self.executor,
            self.transport,
            str(self.workers),
            self.payload,
            f"{self.iwg_s * 1e6:,.0f}",
            f"{self.raw_s * 1e6:,.0f}",
            f"{self.iwg_s / self.raw_s:.2f}x",
            f"{size / self.iwg_s / 1e6:,.0f}",
            f"{size / self.raw_s / 1e6:,.0f}",
        ]


HEADER = [
    "executor",
    "transport",
    "workers",
    "payload",
    "iwg µs",
    "raw µs",
    "iwg/raw",
    "iwg MB/s",
    "raw MB/s",
]


def _table(rows: list[list[str]], header: list[str]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def measure_executor(
    name: str, transport: str, executor: Executor, raw: RawGroup, worker_counts: tuple[int, ...]
) -> list[Row]:
    rows = []
    for workers in worker_counts:
        replica = 0 if workers == 1 else None
        for label, size in SIZES.items():
            tensor = torch.zeros(size, dtype=torch.uint8)
            payload = tensor.numpy()

            def iwg(tensor: torch.Tensor = tensor, replica: int | None = replica) -> None:
                executor.collective_rpc("echo", (tensor,), replica=replica, timeout=60)

            def baseline(payload: Any = payload, workers: int = workers) -> None:
                raw.round_trip(payload, workers)

            iwg_s, raw_s = compare(iwg, baseline, ITERATIONS[label])
            rows.append(Row(name, transport, workers, label, iwg_s, raw_s))
            print("  ", " | ".join(rows[-1].cells()), flush=True)
    return rows


class NoopWorker(TorchWorker):
    def noop(self, x: int) -> int:
        return x


class _Forwarder:
    """The fastest forwarding CPython 3.11 allows: no `__getattr__`, the bound method in the instance dict."""


def proxied_vs_direct() -> list[list[str]]:
    """Per-call cost of reaching a worker method through `WorkerWrapperBase`, beside calling it directly.

    Best of several repeats (the least disturbed by other load). By attribute: ``wrapper.noop`` is found in
    the instance dict where `__getattr__` cached it, but CPython 3.11 does not specialise attribute loads on
    a class that defines `__getattr__`, so it pays a generic lookup. The floor row is a forwarder without
    `__getattr__` (what any proxy costs at least); the ``check_health`` rows are a real worker method. By
    name, as the busy loop calls: the wrapper's resolved-method cache against ``getattr(worker, name)``."""
    wrapper = WorkerWrapperBase(rpc_rank=0)
    wrapper.init_worker([{"worker_cls": NoopWorker, "config": WorkerConfig(device="cpu")}])
    worker = wrapper.require_worker()
    worker.init_device()
    forwarder = _Forwarder()
    forwarder.noop = worker.noop  # type: ignore[attr-defined]
    env = {"worker": worker, "wrapper": wrapper, "forwarder": forwarder}
    wrapper.noop(0)  # type: ignore[attr-defined]  # first access resolves and caches the bound method
    wrapper.check_health()  # type: ignore[attr-defined]
    n = 200_000
    # (label, statement, index of its direct reference in this list)
    cases = [
        ("worker.noop(1): direct, by attribute", "worker.noop(1)", 0),
        ("wrapper.noop(1): proxied, by attribute", "wrapper.noop(1)", 0),
        ("forwarder.noop(1): floor for any proxy", "forwarder.noop(1)", 0),
        ("worker.check_health(): direct", "worker.check_health()", 3),
        ("wrapper.check_health(): proxied", "wrapper.check_health()", 3),
        ("getattr(worker, 'noop')(1): direct, by name", "getattr(worker, 'noop')(1)", 5),
        ("wrapper.resolve_method('noop')(1): proxied, by name", "wrapper.resolve_method('noop')(1)", 5),
        (
            "wrapper.execute_method('noop', ...): by name + timing",
            "wrapper.execute_method('noop', (1,), {})",
            5,
        ),
    ]
    times = [
        min(timeit.repeat(stmt, globals=env, number=n // 20 if "health" in stmt else n, repeat=7))
        / (n // 20 if "health" in stmt else n)
        for _, stmt, _ in cases
    ]
    return [
        [label, f"{times[i] * 1e9:,.0f}", f"{times[i] / times[ref]:.2f}x"]
        for i, (label, _, ref) in enumerate(cases)
    ]


def _cluster_group(
    root: Path, keys: CurveKeys | None, heartbeat: float
) -> tuple[ClusterExecutor, list[subprocess.Popen[bytes]]]:
    root.mkdir(parents=True, exist_ok=True)
    curve_dir = str(keys.save(root / "curve")) if keys is not None else None
    executor = ClusterExecutor(
        "tcp://127.0.0.1:0",
        "tcp://127.0.0.1:0",
        replicas=REPLICAS,
        keys=keys,
        insecure=keys is None,
        group="bench",
        heartbeat_interval_s=heartbeat,
    )
    procs = []
    for replica in range(REPLICAS):
        config = WorkerConfig(task="none", device="cpu", group="bench", replica=replica)
        env = worker_env(
            config,
            executor.rpc_endpoint,
            executor.response_endpoint,
            curve_dir=curve_dir,
            insecure_tcp=keys is None,
            heartbeat_interval_s=heartbeat,
            worker_extension_cls=ECHO_EXTENSION,
        )
        procs.append(launch_worker(env, root / f"worker-{replica}.log"))
    return executor, procs


def _ray_group() -> tuple[Executor, Callable[[], None]] | None:
    """The Ray row: `RayExecutor` with ``REPLICAS`` one-rank replicas (actors) on a local Ray, measured beside
    the raw pyzmq ipc echo like the others, and how to stop both; None when the 'ray' extra is missing."""
    try:
        import ray
        from iwg_worker.executor.ray import RayExecutor
    except ImportError:
        print("ray is not installed: no Ray row (install the 'ray' extra)", flush=True)
        return None
    for attempt in (1, 2):
        # Ray gives its raylet a fixed 30 s to register; on a saturated machine a second start may get in.
        try:
            ray.init(
                num_cpus=REPLICAS, include_dashboard=False, object_store_memory=512 << 20, log_to_driver=False
            )
            break
        except Exception as exc:
            ray.shutdown()
            if attempt == 2:
                print(f"Ray did not start twice ({exc}): no Ray row", flush=True)
                return None
    executor = RayExecutor(
        WorkerConfig(task="none", device="cpu", group="bench"),
        replicas=REPLICAS,
        worker_extension_cls=ECHO_EXTENSION,
    )

    def stop() -> None:
        executor.shutdown()
        ray.shutdown()

    return executor, stop


def broadcast(ring: MultiprocExecutor, sockets: MultiprocExecutor) -> tuple[float, float]:
    """Median seconds of a 16 MiB call to 4 workers with small replies: through the ring, through sockets."""
    tensor = torch.ones(BROADCAST_BYTES, dtype=torch.uint8)
    expected = [[BROADCAST_BYTES // 4096]] * REPLICAS

    def call(executor: MultiprocExecutor) -> Callable[[], None]:
        def run() -> None:
            result = executor.collective_rpc("touch", (tensor,), timeout=60)
            assert result == expected, result

        return run

    return compare(call(ring), call(sockets), BROADCAST_ITERATIONS)


def idle_cpu(groups: dict[str, MultiprocExecutor], seconds: float) -> dict[str, float]:
    """CPU seconds each group's workers use together over the same ``seconds`` of doing nothing."""
    procs = {name: [psutil.Process(wp.process.pid) for wp in ex.processes] for name, ex in groups.items()}

    def used(ps: list[psutil.Process]) -> float:
        return sum(p.cpu_times().user + p.cpu_times().system for p in ps)

    before = {name: used(ps) for name, ps in procs.items()}
    time.sleep(seconds)
    return {name: used(ps) - before[name] for name, ps in procs.items()}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--multiproc-only",
        action="store_true",
        help="only the Multiproc groups (ring and sockets) and the raw ipc echo",
    )
    only_multiproc: bool = parser.parse_args().multiproc_only
    started = time.monotonic()
    load_start = os.getloadavg()
    root = Path(tempfile.mkdtemp(prefix="iwg-bench-"))
    keys = CurveKeys.generate()
    curve_dir = str(keys.save(root / "raw-curve"))
    groups = 3 if only_multiproc else 5
    print(
        f"starting {groups * REPLICAS} worker processes and {(1 if only_multiproc else 3) * REPLICAS} raw echo "
        "processes ...",
        flush=True,
    )
    clusters: dict[str, tuple[ClusterExecutor, list[subprocess.Popen[bytes]]]] = {}
    raws: dict[str, RawGroup] = {}
    multiproc = multiproc_sockets = multiproc_ring_only = uniproc = None
    rows: list[Row] = []
    try:
        # Start everything first; the cluster groups' workers load while Multiproc waits for its own.
        if not only_multiproc:
            clusters["tcp + CURVE"] = _cluster_group(root / "curve", keys, 2.0)
            clusters["tcp, no CURVE"] = _cluster_group(root / "plain", None, 2.0)
        bench_config = WorkerConfig(task="none", device="cpu", group="bench")
        multiproc = MultiprocExecutor(bench_config, replicas=REPLICAS, worker_extension_cls=ECHO_EXTENSION)
        multiproc_sockets = MultiprocExecutor(
            bench_config, replicas=REPLICAS, worker_extension_cls=ECHO_EXTENSION, ring=False
        )
        multiproc_ring_only = MultiprocExecutor(
            bench_config, replicas=REPLICAS, worker_extension_cls=ECHO_EXTENSION, reply_fifo=False
        )
        for executor, _ in clusters.values():
            executor.wait_until_serving(timeout=600)
        raws["ipc"] = RawGroup(f"ipc://{root}/raw", REPLICAS, None, None)
        if not only_multiproc:
            raws["tcp + CURVE"] = RawGroup("tcp://127.0.0.1:0", REPLICAS, keys, curve_dir)
            raws["tcp, no CURVE"] = RawGroup("tcp://127.0.0.1:0", REPLICAS, None, None)
        print(
            f"started in {time.monotonic() - started:.0f} s; measuring (medians of alternating rounds)",
            flush=True,
        )
        if not only_multiproc:
            uniproc = UniProcExecutor(
                WorkerConfig(task="none", device="cpu"), worker_extension_cls=ECHO_EXTENSION
            )
            rows += measure_executor("UniProc", "in-process (raw: ipc)", uniproc, raws["ipc"], (1,))
        rows += measure_executor("Multiproc", "shm ring", multiproc, raws["ipc"], (1, 4))
        rows += measure_executor("Multiproc", "ipc sockets", multiproc_sockets, raws["ipc"], (1, 4))
        rows += measure_executor(
            "Multiproc", "shm ring, replies on socket", multiproc_ring_only, raws["ipc"], (1, 4)
        )
        ring_s, sockets_s = broadcast(multiproc, multiproc_sockets)
        idle = idle_cpu({"shm ring": multiproc, "ipc sockets": multiproc_sockets}, IDLE_S)
        for transport, (executor, _) in clusters.items():
            rows += measure_executor("Cluster", transport, executor, raws[transport], (1, 4))
        # Ray last: its processes start only now, so they do not load the machine during the rows above.
        ray_group = None if only_multiproc else _ray_group()
        if ray_group is not None:
            try:
                rows += measure_executor(
                    "Ray", "Ray actor tasks (raw: ipc)", ray_group[0], raws["ipc"], (1, 4)
                )
            finally:
                ray_group[1]()
        proxy_rows = [] if only_multiproc else proxied_vs_direct()
    finally:
        if uniproc is not None:
            uniproc.shutdown()
        for group in (multiproc, multiproc_sockets, multiproc_ring_only):
            if group is not None:
                group.shutdown()
        for executor, procs in clusters.values():
            for proc in procs:
                proc.terminate()
            for proc in procs:
                proc.wait(timeout=30)
            executor.shutdown()
        for raw in raws.values():
            raw.close()

    print()
    print(_table([r.cells() for r in rows], HEADER))
    print()
    if proxy_rows:
        print(_table(proxy_rows, ["call", "ns per call", "vs direct (same style)"]))
        print()

    def ratio(transport: str, workers: int) -> float:
        row = next(r for r in rows if (r.transport, r.workers, r.payload) == (transport, workers, "64 B"))
        return row.iwg_s / row.raw_s

    print(
        f"Multiproc through the shm ring, 64 B, iwg / raw pyzmq: {ratio('shm ring', 4):.2f}x to 4 workers "
        f"(target <= 1.0x), {ratio('shm ring', 1):.2f}x to 1 (target <= 1.2x); over ipc sockets "
        f"{ratio('ipc sockets', 4):.2f}x and {ratio('ipc sockets', 1):.2f}x; through the ring with replies on "
        f"the socket (no reply FIFO) {ratio('shm ring, replies on socket', 4):.2f}x and "
        f"{ratio('shm ring, replies on socket', 1):.2f}x"
    )
    mb = BROADCAST_BYTES * REPLICAS / 1e6
    print(
        f"16 MiB broadcast to {REPLICAS} workers: ring {ring_s * 1e3:,.1f} ms ({mb / ring_s:,.0f} MB/s), "
        f"sockets {sockets_s * 1e3:,.1f} ms ({mb / sockets_s:,.0f} MB/s): "
        f"{sockets_s / ring_s:.2f}x the bandwidth (target >= 2x)"
    )
    print(
        f"idle CPU of {REPLICAS} workers over {IDLE_S:g} s: "
        + ", ".join(f"{name} {used / IDLE_S * 100:.2f}% of a core" for name, used in idle.items())
        + " (target < 5%)"
    )
    cluster = [r.iwg_s / r.raw_s for r in rows if r.payload == "64 B" and r.executor == "Cluster"]
    if cluster:
        large = [
            r.raw_s / r.iwg_s
            for r in rows
            if r.payload == "16 MiB" and r.executor in ("Multiproc", "Cluster")
        ]
        print(
            f"Cluster 64 B overhead vs raw pyzmq: {min(cluster):.2f}x .. {max(cluster):.2f}x; "
            f"16 MiB echo bandwidth vs raw: {min(large):.2f} .. {max(large):.2f}"
        )
    multiproc_s = {(r.workers, r.payload): r.iwg_s for r in rows if r.transport == "shm ring"}
    ray_vs = [
        f"{r.workers} worker(s) {r.payload} {r.iwg_s / multiproc_s[(r.workers, r.payload)]:.1f}x"
        for r in rows
        if r.executor == "Ray" and (r.workers, r.payload) in multiproc_s
    ]
    if ray_vs:
        print("Ray round trip / Multiproc (shm ring) round trip: " + ", ".join(ray_vs))
    load_end = os.getloadavg()
    print(
        f"total {time.monotonic() - started:.0f} s on {os.cpu_count()} cores; load average (1, 5, 15 min) "
        f"{load_start[0]:.1f} {load_start[1]:.1f} {load_start[2]:.1f} at the start, "
        f"{load_end[0]:.1f} {load_end[1]:.1f} {load_end[2]:.1f} at the end"
    )


if __name__ == "__main__":
    main()
