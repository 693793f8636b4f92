"""A worker that a local executor started ends with that executor's process.

`MultiprocExecutor` (so `iwg serve`) starts each ``iwg-worker`` with ``IWG_PARENT_PID`` set to its own pid. A
worker so started asks the kernel for a signal when its parent dies (``PR_SET_PDEATHSIG`` through ``prctl``,
Linux), and watches its parent pid on a thread as well (every ``WATCH_INTERVAL_S``: other systems, and the
case where the parent died before the ``prctl``). Either way it then stops as on SIGINT, without SIGTERM's
drain (goodbye, engine shut down), and exits within ``ORPHAN_GRACE_S`` whatever it was doing: nothing is left waiting for a driver
that will never come back. Pods do not set the variable: a pod's worker has no such parent.

The kernel sends the death signal when the *thread* that started the process ends, which may be before the
process does (an executor created on a short-lived thread). The signal is therefore ``SIGUSR2``, not SIGTERM:
its handler checks that the parent pid really changed before it stops anything.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from types import FrameType

log = logging.getLogger(__name__)

ENV = "IWG_PARENT_PID"
DEATH_SIGNAL = signal.SIGUSR2
WATCH_INTERVAL_S = 0.5
ORPHAN_GRACE_S = 10.0
_PR_SET_PDEATHSIG = 1


def expected_parent(environ: dict[str, str] | None = None) -> int | None:
    """The pid this process must not outlive (``IWG_PARENT_PID``), or None."""
    raw = (os.environ if environ is None else environ).get(ENV, "")
    try:
        pid = int(raw)
    except ValueError:
        return None
    return pid if pid > 1 else None


def set_death_signal(sig: int) -> bool:
    """Ask the kernel for ``sig`` when the parent (thread) ends; False where there is no prctl."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return int(libc.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0)) == 0
    except (OSError, AttributeError):
        return False


def process_alive(pid: int) -> bool:
    """Whether ``pid`` is a process here that has not ended (a zombie has)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as stat:
            state = stat.read().rsplit(")", 1)[-1].split()[0]
    except OSError:
        return True
    return state != "Z"


class ParentWatch:
    """Calls ``on_orphaned`` once when the parent ``parent`` is gone, then ends the process after
    ``grace_s`` if it is still running."""

    def __init__(self, parent: int, on_orphaned: Callable[[], None], grace_s: float = ORPHAN_GRACE_S) -> None:
        self.parent = parent
        self._on_orphaned = on_orphaned
        self._grace_s = grace_s
        self._fired = threading.Lock()
        self._thread = threading.Thread(target=self._watch, name="iwg-parent-watch", daemon=True)

    def start(self) -> None:
        """Install the death signal's handler (main thread), then ask for the signal, then watch."""
        signal.signal(DEATH_SIGNAL, self._on_signal)
        if not set_death_signal(DEATH_SIGNAL):
            log.info("no parent-death signal on this system; watching parent pid %d", self.parent)
        self._thread.start()
        self.check()  # the parent may have died before the prctl

    def orphaned(self) -> bool:
        return os.getppid() != self.parent

    def check(self) -> None:
        if self.orphaned():
            self._fire()

    def _on_signal(self, _signum: int, _frame: FrameType | None) -> None:
        self.check()  # else: the thread that started us ended, not our parent

    def _watch(self) -> None:
        while not self.orphaned():
            time.sleep(WATCH_INTERVAL_S)
        self._fire()

    def _fire(self) -> None:
        if not self._fired.acquire(blocking=False):
            return
        log.warning("parent process %d is gone: stopping (at most %.0f s)", self.parent, self._grace_s)
        threading.Thread(target=self._deadline, name="iwg-orphan-deadline", daemon=True).start()
        self._on_orphaned()

    def _deadline(self) -> None:
        time.sleep(self._grace_s)
        log.error("still running %.0f s after the parent's death: exiting", self._grace_s)
        with contextlib.suppress(Exception):
            logging.shutdown()
        os._exit(1)
