"""`iwg serve` leaves nothing behind, however it ends. SIGKILLed: its workers end by themselves within seconds
and the next `iwg serve` removes its shared-memory ring and private directory; SIGHUP and SIGTERM: it stops its
workers and removes both itself. Real `iwg serve` processes with MiniLM."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from tests.iwg_worker.driver.conftest import (
    ADMIN_TOKEN,
    ROOT,
    STARTUP_TIMEOUT_S,
    free_port,
    subprocess_env,
    wait_http,
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

SHM = Path("/dev/shm")
WORKERS_GONE_S = 15.0


class Run:
    """One `iwg serve` of MiniLM (one replica) whose temporary files go to ``tmpdir``."""

    def __init__(self, tmp: Path, tmpdir: Path, name: str) -> None:
        token = tmp / "admin-token"
        token.write_text(ADMIN_TOKEN)
        self.log = tmp / f"{name}.log"
        port = free_port()
        with open(self.log, "wb") as out:
            self.process = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "iwg_worker.cli",
                    "serve",
                    str(ROOT / "examples" / "minilm.yaml"),
                    "--port",
                    str(port),
                    "--replicas",
                    "1",
                    "--admin-token-file",
                    str(token),
                ],
                cwd=ROOT,
                env={
                    **subprocess_env(),
                    "TMPDIR": str(tmpdir),
                    "PYTHONPATH": f"{ROOT / 'operator'}:{ROOT / 'worker_image'}",
                },
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
            )
        self.tmpdir = tmpdir
        wait_http(f"http://127.0.0.1:{port}/readyz", self.process, STARTUP_TIMEOUT_S, self.log)
        self.workers = psutil.Process(self.process.pid).children(recursive=True)
        assert self.workers, "iwg serve started no worker process"
        # Its ring and private directory, as its workers were told them.
        env = self.workers[0].environ()
        self.paths = sorted([Path(env["IWG_SHM_RING"]), Path(env["IWG_SHM_RING_WAKE"]).parent])

    def files(self) -> list[Path]:
        """Its ring and private directory, those that exist."""
        return [p for p in self.paths if p.exists()]

    def workers_gone_after(self) -> float:
        """Seconds until every worker process has ended (fails after ``WORKERS_GONE_S``)."""
        started = time.monotonic()
        _gone, alive = psutil.wait_procs(self.workers, timeout=WORKERS_GONE_S)
        for process in alive:
            process.kill()
        assert not alive, f"workers {[p.pid for p in alive]} outlived iwg serve by {WORKERS_GONE_S:.0f} s"
        return time.monotonic() - started


@pytest.mark.skipif(not SHM.is_dir(), reason="no /dev/shm here: the ring lives in the temporary directory")
def test_serve_killed_or_hung_up_leaves_no_process_no_ring_and_no_directory(tmp_path: Path) -> None:
    tmpdir = tmp_path / "tmp"
    tmpdir.mkdir()
    killed = Run(tmp_path, tmpdir, "killed")
    try:
        left = killed.files()
        assert len(left) == 2 and {p.parent for p in left} == {tmpdir, SHM}, left
        killed.process.send_signal(signal.SIGKILL)
        killed.process.wait(10)
        gone_s = killed.workers_gone_after()
    finally:
        killed.process.kill()
    # Nothing could remove its private directory yet. Its ring in /dev/shm is the machine's: any iwg serve that
    # starts meanwhile (another lane's) sweeps the rings of dead owners, as the next run does here.
    assert [p for p in left if p.parent == tmpdir and p.exists()], left

    hung_up = Run(tmp_path, tmpdir, "hung-up")  # its start sweeps what the killed run left
    try:
        assert killed.files() == [], killed.files()
        own = hung_up.files()
        assert len(own) == 2 and all(p.exists() for p in own), own
        hung_up.process.send_signal(signal.SIGHUP)
        assert hung_up.process.wait(60) == 0, hung_up.log.read_text(errors="replace")[-3000:]
        hup_gone_s = hung_up.workers_gone_after()
        assert hung_up.files() == [], hung_up.files()
    finally:
        hung_up.process.kill()

    terminated = Run(tmp_path, tmpdir, "terminated")
    try:
        terminated.process.send_signal(signal.SIGTERM)
        assert terminated.process.wait(60) == 0, terminated.log.read_text(errors="replace")[-3000:]
        terminated.workers_gone_after()
        assert terminated.files() == [], terminated.files()
    finally:
        terminated.process.kill()
    print(
        f"SIGKILL: workers gone {gone_s:.1f} s after iwg serve died, ring and directory swept by the next "
        f"start; SIGHUP: workers gone {hup_gone_s:.1f} s after iwg serve exited, ring and directory removed"
    )
    assert [p for p in tmpdir.iterdir() if p.name.startswith("iwg-")] == []  # (torch keeps a cache there)
