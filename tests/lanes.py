"""`make test`: the suite as four pytest processes side by side, so the cluster tests' waits overlap the
worker tests' computing.

The tests marked ``cluster`` (control plane, real kubelets, groups serving on them) mostly wait: health
periods, drain windows, autoscaler windows, node controllers. The others (workers, engines, drivers, real
models) mostly compute. One after the other, the machine's two cores were busy 44% of the suite's time. The
lanes (RULES): three real-node modules with clusters of their own (e2e: autoscaling, vLLM's engine, the
sharded group's drains), the other cluster tests (real kubelets included), the engine and driver tests (real
models, vLLM included), the rest. Each lane is its own pytest process and starts what it uses: its own
control plane on ports from the kernel; a real-kubelet cluster has its fixed fabric in network and mount
namespaces of its own, so one in the e2e lane and one in the cluster lane do not meet.
Other splits were slower here (docs/development.md, "The suite in lanes"): seven lanes with OMP_NUM_THREADS=1
(load 16 on two cores, four timing failures); four with the driver's stream tests moved to the worker lane and
OMP_NUM_THREADS=1; five with the e2e groups in two (load 12: the worker and e2e lanes 2-3 minutes longer, a
vLLM pod's start past its 180 s, and the engine lane past 24 min).

Each lane's lines are printed as they come, prefixed with the lane's name, and kept whole in
``.pytest-lanes/<lane>.log``; the lanes' summaries follow at the end, each with its 15 slowest tests. The
exit status is the first failing lane's (pytest's own codes), 0 when all pass. Arguments go to every lane
(``make test PYTEST_ARGS=...``: paths, ``-k``, ``--durations``); the lane's selection applies at collection
(``IWG_TEST_LANE``, tests/conftest.py), and a lane whose selection is empty (pytest's code 5) counts as passed
unless all are.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import IO

import pytest

ROOT = Path(__file__).resolve().parent.parent
LANE_ENV = "IWG_TEST_LANE"
NO_TESTS_COLLECTED = 5
# (lane, whether its tests are cluster-marked, paths under tests/ it takes): a test goes to the first rule of
# its kind whose paths hold it. Chosen on measured runs (docs/development.md, "The suite in lanes").
RULES: tuple[tuple[str, bool, tuple[str, ...]], ...] = (
    (
        "e2e",
        True,
        ("realnodes/test_autoscaling.py", "realnodes/test_vllm_engine.py", "realnodes/test_drain_sharded.py"),
    ),
    ("cluster", True, ("",)),
    ("engine", False, ("iwg_worker/driver/", "iwg_worker/engine/")),
    ("worker", False, ("",)),
)
LANES = tuple(dict.fromkeys(lane for lane, _cluster, _paths in RULES))
# Four lanes on two cores: an OpenMP thread (torch, vLLM's CPU kernels) that spins while it waits for the rest
# of its team holds a core another lane's process needs. Waiting passively: the transformers engine's
# 32-schema test took 87 s beside three busy processes, against 240 s spinning (94 s with one thread; 29 s
# alone). The environment's own value wins.
LANE_DEFAULTS = {"OMP_WAIT_POLICY": "PASSIVE"}


def lane_of(path: Path, cluster: bool) -> str:
    """The lane of a test file (``cluster``: its tests are cluster-marked)."""
    relative = path.resolve().relative_to(ROOT / "tests").as_posix()
    return next(
        lane
        for lane, of_cluster, paths in RULES
        if of_cluster == cluster and any(relative.startswith(p) for p in paths)
    )


def select(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Deselects the items of other lanes when this process runs one lane (tests/conftest.py calls it)."""
    lane = os.environ.get(LANE_ENV)
    if not lane:
        return
    if lane not in LANES:
        raise pytest.UsageError(f"{LANE_ENV}={lane!r}: expected one of {', '.join(LANES)}")
    keep: list[pytest.Item] = []
    drop: list[pytest.Item] = []
    for item in items:
        (keep if lane_of(item.path, item.get_closest_marker("cluster") is not None) == lane else drop).append(
            item
        )
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep


def _pump(name: str, source: IO[bytes], log_path: Path, lock: threading.Lock) -> None:
    with open(log_path, "wb") as log:
        for raw in iter(source.readline, b""):
            log.write(raw)
            log.flush()
            with lock:
                sys.stdout.write(f"[{name}] {raw.decode(errors='replace')}")
                sys.stdout.flush()


def _summary(path: Path) -> str:
    """The lane's log from pytest's slowest durations or short test summary (or its last lines) on."""
    lines = path.read_text(errors="replace").splitlines()
    for i, line in enumerate(lines):
        if "slowest 15 durations" in line or "short test summary info" in line:
            return "\n".join(lines[i:])
    return "\n".join(lines[-5:])


def main(argv: list[str]) -> int:
    logs = ROOT / ".pytest-lanes"
    logs.mkdir(exist_ok=True)
    lock = threading.Lock()
    started = time.monotonic()
    procs: dict[str, subprocess.Popen[bytes]] = {}
    pumps: list[threading.Thread] = []
    for name in LANES:
        proc = subprocess.Popen(
            [sys.executable, "-m", "pytest", "-q", "-ra", "--durations=15", *argv],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            env={**LANE_DEFAULTS, **os.environ, "PYTHONUNBUFFERED": "1", LANE_ENV: name},
            start_new_session=True,  # an interrupt reaches it through us, once
        )
        assert proc.stdout is not None
        procs[name] = proc
        pump = threading.Thread(
            target=_pump, args=(name, proc.stdout, logs / f"{name}.log", lock), daemon=True
        )
        pump.start()
        pumps.append(pump)
    try:
        codes = {name: proc.wait() for name, proc in procs.items()}
    except KeyboardInterrupt:
        for proc in procs.values():
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGINT)
        codes = {name: proc.wait() for name, proc in procs.items()}
    for pump in pumps:
        pump.join()
    elapsed = time.monotonic() - started
    print(f"\n==== lanes done in {elapsed / 60:.0f} min {elapsed % 60:.0f} s ====")
    for name in LANES:
        print(f"---- {name} (exit {codes[name]}) ----\n{_summary(logs / f'{name}.log')}")
    if all(code == NO_TESTS_COLLECTED for code in codes.values()):
        return NO_TESTS_COLLECTED
    failed = [code for code in codes.values() if code not in (0, NO_TESTS_COLLECTED)]
    return failed[0] if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
