"""Worker extension classes the tests load by qualified name (in-process and in spawned workers)."""

from __future__ import annotations

import os
import time
from typing import Any


class ProbeExtension:
    """Adds methods a test (or bench/rpc.py) can call by name on a worker; production workers lack them."""

    def env_value(self, name: str) -> str | None:
        return os.environ.get(name)

    def echo(self, *args: Any) -> list[Any]:
        """Return the arguments unchanged: the transport's round trip."""
        return list(args)

    def sleep(self, seconds: float) -> float:
        """Block the worker's busy loop for ``seconds`` (at most 60): drains, timeouts and liveness."""
        if not 0 <= seconds <= 60:
            raise ValueError(f"seconds must be within [0, 60], got {seconds!r}")
        time.sleep(seconds)
        return seconds

    def touch(self, tensor: Any) -> int:
        """Read one byte of every 4 KiB page of ``tensor`` and answer with a small int (bench/rpc.py's
        broadcast rows: the worker has the data in reach, and the reply does not carry it back)."""
        return int(tensor.reshape(-1)[::4096].sum())


class ClashingExtension:
    def check_health(self) -> dict[str, Any]:
        return {}


class RingProbeExtension(ProbeExtension):
    """Methods the shared-memory ring tests call: holding an argument during a call, and call order."""

    def hold(self, tensor: Any, seconds: float) -> int:
        """Keep ``tensor`` (a view into the ring when it came through one) for ``seconds``, then answer."""
        time.sleep(seconds)
        return int(tensor.reshape(-1)[::4096].sum())

    def record(self, value: Any) -> list[int]:
        """Append an id (or a tensor's first element) to this worker's log and return the log."""
        log: list[int] = self.__dict__.setdefault("_ring_test_log", [])
        log.append(int(value.reshape(-1)[0]) if hasattr(value, "reshape") else int(value))
        return list(log)
