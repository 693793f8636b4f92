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


class ClashingExtension:
    def check_health(self) -> dict[str, Any]:
        return {}
