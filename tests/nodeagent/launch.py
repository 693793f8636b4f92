"""The container's first moments: runs inside `ip netns exec <pod-netns>` (which gives it a private mount
namespace and the pod's resolv.conf), takes the pod's hostname in its own UTS namespace, mounts the pod's
volumes at their paths, then execs the container's command. Usage: python -m tests.nodeagent.launch PLAN.json
"""

from __future__ import annotations

import ctypes
import json
import os
import socket
import sys
from pathlib import Path

CLONE_NEWUTS = 0x04000000
MS_RDONLY = 1
MS_REMOUNT = 32
MS_BIND = 4096
MS_REC = 16384

_libc = ctypes.CDLL(None, use_errno=True)


def _check(result: int, what: str) -> None:
    if result != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"{what}: {os.strerror(errno)}")


def _mount(source: str, target: str, fstype: str | None, flags: int, data: str | None) -> None:
    _check(
        _libc.mount(
            source.encode(),
            target.encode(),
            fstype.encode() if fstype else None,
            ctypes.c_ulong(flags),
            data.encode() if data else None,
        ),
        f"mount {source} on {target}",
    )


def apply_mount(mount: dict[str, object], source_fds: dict[str, int]) -> None:
    source, target = str(mount["source"]), str(mount["target"])
    if mount.get("tmpfs_size"):
        Path(target).mkdir(parents=True, exist_ok=True)
        _mount("tmpfs", target, "tmpfs", 0, f"size={mount['tmpfs_size']}")
        return
    # Through a descriptor opened before any mount: an earlier mount (an emptyDir on /tmp) may hide the path.
    handle = f"/proc/self/fd/{source_fds[source]}"
    if os.path.isdir(handle):
        Path(target).mkdir(parents=True, exist_ok=True)
    elif not Path(target).exists():
        Path(target).parent.mkdir(parents=True, exist_ok=True)
        Path(target).touch()
    _mount(handle, target, None, MS_BIND | MS_REC, None)
    if mount.get("read_only"):
        _mount(handle, target, None, MS_BIND | MS_REMOUNT | MS_RDONLY, None)


def restore_hidden_image(mounts: list[dict[str, object]], image_fds: dict[str, int]) -> None:
    """Binds the image's paths back where a volume mounted above them (an emptyDir on /tmp) hid them."""
    for path, fd in image_fds.items():
        if any(Path(path).is_relative_to(str(m["target"])) for m in mounts):
            Path(path).mkdir(parents=True, exist_ok=True)
            _mount(f"/proc/self/fd/{fd}", path, None, MS_BIND | MS_REC, None)


def main() -> None:
    plan = json.loads(Path(sys.argv[1]).read_text())
    _check(_libc.unshare(CLONE_NEWUTS), "unshare(CLONE_NEWUTS)")
    socket.sethostname(plan["hostname"])
    source_fds = {
        m["source"]: os.open(m["source"], os.O_PATH | os.O_CLOEXEC)
        for m in plan["mounts"]
        if not m.get("tmpfs_size")
    }
    image_fds = {path: os.open(path, os.O_PATH | os.O_CLOEXEC) for path in plan.get("image_paths", [])}
    for mount in plan["mounts"]:
        apply_mount(mount, source_fds)
    restore_hidden_image(plan["mounts"], image_fds)
    for fd in [*source_fds.values(), *image_fds.values()]:
        os.close(fd)
    os.chdir(plan["working_dir"])
    argv = plan["argv"]
    os.execvpe(argv[0], argv, plan["env"])


if __name__ == "__main__":
    main()
