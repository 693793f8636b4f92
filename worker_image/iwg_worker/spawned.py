"""Processes that vLLM spawns from a worker end with the worker.

vLLM's engine core and model process are spawned by a worker's engine (vLLM sets the spawn method on CPU, and
CUDA needs it). The engine core does not watch the process that started it: a worker killed with SIGKILL (the
OOM killer, a node agent, ``kill -9``) would leave it running, holding the model and its KV cache, and the
model process with it (that one watches the engine core). A container runtime ends every process of a
container with its first; a worker under `iwg serve`, or any tree without a PID namespace, has no such help.

`mark_spawner` (the vLLM engine calls it before vLLM spawns anything) names the worker in the environment that
spawned processes inherit. A spawned process imports its parent's main module, and so this package, after
multiprocessing has named it (anything but ``MainProcess``): `iwg_worker/__init__` calls `watch_if_spawned`
then, which ends the process at once if the worker is already gone (it may die before the child reads its
parent's pid), and otherwise when its parent goes (`parent_watch.ParentWatch`: the worker for the engine core,
the engine core for the model process).
"""

from __future__ import annotations

import multiprocessing
import os

from iwg_worker.parent_watch import ParentWatch, process_alive

ENV = "IWG_SPAWNER_PID"


def mark_spawner() -> None:
    """Processes spawned from here on (and theirs) end when this process does."""
    os.environ[ENV] = str(os.getpid())


def watch_if_spawned() -> ParentWatch | None:
    """In a process spawned by multiprocessing under a marked spawner: end with the parent (None: nothing to
    watch, this is no such process)."""
    if multiprocessing.current_process().name == "MainProcess":
        return None
    try:
        spawner = int(os.environ.get(ENV, ""))
    except ValueError:
        return None
    parent = os.getppid()  # before the check: a spawner dying after it changes this pid, which the watch sees
    if not process_alive(spawner):
        os._exit(1)
    watch = ParentWatch(parent, on_orphaned=lambda: os._exit(1), grace_s=0.0)
    watch.start()
    return watch
