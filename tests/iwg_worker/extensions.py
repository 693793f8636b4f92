"""Worker extension classes the tests load by qualified name (in-process and in spawned workers)."""

from __future__ import annotations

import os
from typing import Any


class ProbeExtension:
    """Adds methods a test can call by name on a worker."""

    def env_value(self, name: str) -> str | None:
        return os.environ.get(name)

    def seen_features(self, batch: dict[str, Any]) -> dict[str, list[int]]:
        return {rid: list(f.shape) for rid, f in batch.get("mm_features", {}).items()}


class ClashingExtension:
    def check_health(self) -> dict[str, Any]:
        return {}
