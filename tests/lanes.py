"""`make test`: the suite as two pytest processes side by side, so the cluster tests' waits overlap the worker tests'.

The tests marked ``cluster`` (control plane, node agent, real kubelets, e2e groups) mostly wait: health periods,
drain windows, autoscaler windows, node controllers. The others (workers, engines, drivers, real models) mostly
compute. One after the other, the machine's cores were busy less than half of the suite's time; side by side,
each lane's waits are the other's compute time. Nothing is shared between the lanes: the control planes, node
agents and network namespaces are all in the cluster lane, and every test takes its ports from the kernel.

Each lane's lines are printed as they come, prefixed with the lane's name, and kept whole in
``.pytest-lanes/<lane>.log``; the lanes' summaries follow at the end. The exit status is the first failing lane's
(pytest's own codes), 0 when both pass. Arguments are passed to both lanes (``make test PYTEST_ARGS=...``); a lane
whose selection is empty (pytest's code 5) counts as passed unless both are.
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

ROOT = Path(__file__).resolve().parent.parent
LANES: dict[str, list[str]] = {
    "cluster": ["-m", "cluster"],
    "worker": ["-m", "not cluster"],
}
NO_TESTS_COLLECTED = 5


def _pump(name: str, source: IO[bytes], log_path: Path, lock: threading.Lock) -> None:
    with open(log_path, "wb") as log:
        for raw in iter(source.readline, b""):
            log.write(raw)
            log.flush()
            with lock:
                sys.stdout.write(f"[{name}] {raw.decode(errors='replace')}")
                sys.stdout.flush()


def _summary(path: Path) -> str:
    """The lane's log from pytest's short test summary (or its last lines) on."""
    lines = path.read_text(errors="replace").splitlines()
    for i, line in enumerate(lines):
        if "short test summary info" in line:
            return "\n".join(lines[i:])
    return "\n".join(lines[-5:])


def main(argv: list[str]) -> int:
    logs = ROOT / ".pytest-lanes"
    logs.mkdir(exist_ok=True)
    lock = threading.Lock()
    started = time.monotonic()
    procs: dict[str, subprocess.Popen[bytes]] = {}
    pumps: list[threading.Thread] = []
    for name, selection in LANES.items():
        proc = subprocess.Popen(
            [sys.executable, "-m", "pytest", "-q", "-ra", *selection, *argv],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
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
