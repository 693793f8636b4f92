"""A process spawned from an iwg process (as vLLM spawns its engine core from a worker) ends with it
(iwg_worker/spawned.py)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

# The main module of the spawning process imports iwg_worker, as `iwg-worker` does; its spawned child sleeps.
SPAWNER = textwrap.dedent(
    """
    import multiprocessing, sys, time
    import iwg_worker  # noqa: F401
    from iwg_worker.spawned import mark_spawner

    if __name__ == "__main__":
        mark_spawner()  # as the vLLM engine does before vLLM spawns its engine core
        child = multiprocessing.get_context("spawn").Process(target=time.sleep, args=(600,))
        child.start()
        print(child.pid, flush=True)
        time.sleep(600)
    """
)


def alive(process: psutil.Process) -> bool:
    """Running, not a zombie waiting for whoever adopted it to reap it."""
    try:
        return process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


@contextlib.contextmanager
def spawner(tmp_path: Path) -> Iterator[tuple[subprocess.Popen[str], psutil.Process]]:
    """The spawning process and its spawned child; both killed at the end."""
    script = tmp_path / "spawner.py"
    script.write_text(SPAWNER)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    parent = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True, env=env)
    try:
        assert parent.stdout is not None
        child = psutil.Process(int(parent.stdout.readline()))
        yield parent, child
    finally:
        with contextlib.suppress(psutil.NoSuchProcess):
            for process in psutil.Process(parent.pid).children(recursive=True):
                process.kill()
        parent.kill()


def test_a_spawned_child_exits_when_its_parent_is_killed(tmp_path: Path) -> None:
    with spawner(tmp_path) as (parent, child):
        assert alive(child)
        parent.send_signal(signal.SIGKILL)
        parent.wait(10)
        deadline = time.monotonic() + 5
        while alive(child):
            if time.monotonic() > deadline:
                child.kill()
                pytest.fail("the spawned child outlived its SIGKILLed parent by 5 s")
            time.sleep(0.1)


def test_a_spawned_child_lives_while_its_parent_does(tmp_path: Path) -> None:
    with spawner(tmp_path) as (_, child):
        time.sleep(2)
        assert alive(child)
