"""Files a local executor leaves on the machine: named after their owner's pid, locked while it lives, swept
once it is gone.

`MultiprocExecutor` (so ``iwg serve``) makes a private directory, ``$TMPDIR/iwg-<pid>-<random>``, and a
shared-memory ring, ``/dev/shm/iwg-ring-<pid>-<random>``, and removes both when it shuts down, on SIGTERM,
SIGINT and SIGHUP too. A process killed with SIGKILL cannot: every executor therefore `sweep`s at its start.
Each file holds an exclusive ``flock`` for as long as its owner lives (the directory on its ``owner.lock``,
the ring on itself; created under a temporary name, locked, then linked to its final name, so that no sweep
ever sees one unlocked while its owner lives), which the kernel releases when the process ends, however it
ends. A sweep removes an entry only when all of these hold: its name has this form, it belongs to this user,
its pid is not a live process here (a zombie counts as gone), and its lock can be taken. So a live run's files
are never removed, also not those of a run in another pid namespace sharing ``/dev/shm`` (its pid means
nothing here, but its lock is held).
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import logging
import os
import re
import shutil
import tempfile
from collections.abc import Callable, Iterable
from pathlib import Path

from iwg_worker.parent_watch import process_alive

log = logging.getLogger(__name__)

DIR_PREFIX = "iwg-"
RING_PREFIX = "iwg-ring-"
LOCK_NAME = "owner.lock"
_OWNED = re.compile(r"^iwg-(?P<ring>ring-)?(?P<pid>[0-9]+)-[a-z0-9_]+$")


def create_file(directory: str | Path, prefix: str) -> tuple[int, str]:
    """A new file ``directory/<prefix><pid>-<random>`` (mode 0600), already locked: (its descriptor, which
    holds the lock until it is closed, and its path)."""
    fd, temporary = tempfile.mkstemp(prefix=f".{prefix}new-", dir=directory)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        while True:
            path = os.path.join(directory, f"{prefix}{os.getpid()}-{_random_part(temporary)}")
            try:
                os.link(temporary, path)  # unlike rename, never replaces a file of that name
                break
            except FileExistsError:
                os.unlink(temporary)
                os.close(fd)
                fd, temporary = tempfile.mkstemp(prefix=f".{prefix}new-", dir=directory)
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        os.unlink(temporary)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temporary)
        os.close(fd)
        raise
    return fd, path


def make_dir(parent: str | Path | None = None) -> tuple[Path, int]:
    """A new private directory ``iwg-<pid>-<random>`` (mode 0700) with its ``owner.lock`` held: (its path, the
    lock's descriptor)."""
    path = Path(tempfile.mkdtemp(prefix=f"{DIR_PREFIX}{os.getpid()}-", dir=parent))
    fd, temporary = tempfile.mkstemp(prefix=".lock-", dir=path)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        os.rename(temporary, path / LOCK_NAME)  # the directory is ours alone: nothing to replace
    except BaseException:
        os.close(fd)
        shutil.rmtree(path, ignore_errors=True)
        raise
    return path, fd


def sweep(directories: Iterable[str | Path]) -> list[str]:
    """Remove what dead runs left in ``directories`` (see the module's docstring); the paths removed."""
    removed: list[str] = []
    uid = os.getuid()
    for directory in dict.fromkeys(str(d) for d in directories):
        try:
            entries = list(os.scandir(directory))
        except OSError:
            continue
        for entry in entries:
            match = _OWNED.match(entry.name)
            if match is None:
                continue
            pid = int(match["pid"])
            try:
                if (
                    entry.stat(follow_symlinks=False).st_uid != uid
                    or pid == os.getpid()
                    or process_alive(pid)
                ):
                    continue
                if match["ring"] and entry.is_file(follow_symlinks=False):
                    gone = _remove_unlocked(entry.path, functools.partial(os.unlink, entry.path))
                elif not match["ring"] and entry.is_dir(follow_symlinks=False):
                    lock = os.path.join(entry.path, LOCK_NAME)
                    gone = _remove_unlocked(lock, functools.partial(shutil.rmtree, entry.path))
                else:
                    continue
            except OSError as exc:
                log.warning("could not remove %s, left by process %d: %s", entry.path, pid, exc)
                continue
            if gone:
                log.info("removed %s, left by iwg process %d, which is gone", entry.path, pid)
                removed.append(entry.path)
    return removed


def _remove_unlocked(lock_path: str, remove: Callable[[], object]) -> bool:
    """Run ``remove`` while holding ``lock_path``'s lock, if it can be had at once; False if it cannot (or the
    lock file does not exist: not one of ours, or one being made)."""
    try:
        fd = os.open(lock_path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        return False
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False  # its owner (or a process that inherited the lock) lives
        remove()
        return True
    finally:
        os.close(fd)


def _random_part(temporary: str) -> str:
    return os.path.basename(temporary).rsplit("-", 1)[-1]
