"""`executor.leftovers`: a sweep removes what dead runs left, and nothing of a live run, of another user's or
of anyone else's, with real processes and real locks."""

from __future__ import annotations

import fcntl
import os
import subprocess
import sys
from pathlib import Path

from iwg_worker.executor import leftovers


def dead_pid() -> int:
    process = subprocess.Popen([sys.executable, "-c", "pass"])
    process.wait()
    return process.pid


def make_leftovers(directory: Path, pid: int) -> tuple[Path, Path]:
    """A run's directory (with its lock file) and ring, as a run of ``pid`` makes them, not locked."""
    run = directory / f"iwg-{pid}-abc123_x"
    run.mkdir()
    (run / leftovers.LOCK_NAME).touch()
    (run / "worker-r0-k0.log").write_text("its log")
    ring = directory / f"iwg-ring-{pid}-abc123_x"
    ring.write_bytes(b"\0" * 64)
    return run, ring


def test_a_dead_runs_directory_and_ring_are_removed(tmp_path: Path) -> None:
    run, ring = make_leftovers(tmp_path, dead_pid())
    assert sorted(leftovers.sweep([tmp_path])) == sorted([str(run), str(ring)])
    assert not run.exists() and not ring.exists()


def test_a_live_runs_files_are_kept(tmp_path: Path) -> None:
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        # Unlocked (as in the instant between creating and locking): its pid is alive.
        files = make_leftovers(tmp_path, live.pid)
        assert leftovers.sweep([tmp_path]) == []
        assert all(p.exists() for p in files)
    finally:
        live.kill()
        live.wait()


def test_files_whose_lock_is_held_are_kept_even_when_their_pid_is_unknown_here(tmp_path: Path) -> None:
    """A run in another pid namespace sharing /dev/shm: its pid means nothing here, its lock is held."""
    run, ring = make_leftovers(tmp_path, dead_pid())
    held = [os.open(run / leftovers.LOCK_NAME, os.O_RDONLY), os.open(ring, os.O_RDONLY)]
    try:
        for fd in held:
            fcntl.flock(fd, fcntl.LOCK_EX)
        assert leftovers.sweep([tmp_path]) == []
        assert run.exists() and ring.exists()
    finally:
        for fd in held:
            os.close(fd)
    assert len(leftovers.sweep([tmp_path])) == 2  # its owner let go: now they go


def test_other_names_and_a_directory_without_its_lock_file_are_kept(tmp_path: Path) -> None:
    pid = dead_pid()
    kept = [
        tmp_path / "iwg-nodeagent-abc",  # another tool's directory
        tmp_path / "iwg-ring-abc123",  # an older ring without a pid
        tmp_path / f"iwg-{pid}-nolock",  # not one of ours (or being made): no lock file
        tmp_path / f"iwg-{pid}-abc123.txt",
    ]
    kept[0].mkdir()
    kept[1].touch()
    kept[2].mkdir()
    kept[3].touch()
    assert leftovers.sweep([tmp_path]) == []
    assert all(p.exists() for p in kept)


def test_files_made_by_this_process_are_locked_until_closed(tmp_path: Path) -> None:
    fd, path = leftovers.create_file(tmp_path, leftovers.RING_PREFIX)
    directory, dir_fd = leftovers.make_dir(tmp_path)
    assert Path(path).name.startswith(f"iwg-ring-{os.getpid()}-")
    assert directory.name.startswith(f"iwg-{os.getpid()}-")
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        [Path(path).name, directory.name]
    )  # no temp name
    for lock in (path, directory / leftovers.LOCK_NAME):  # held: another process cannot take it
        probe = f"import fcntl, os; fcntl.flock(os.open({str(lock)!r}, os.O_RDONLY), fcntl.LOCK_EX | fcntl.LOCK_NB)"
        assert subprocess.run([sys.executable, "-c", probe], capture_output=True).returncode != 0
    os.close(fd)
    os.close(dir_fd)
