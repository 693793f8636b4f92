"""Polling for state that the control plane reaches asynchronously: one helper for every test package."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def eventually(
    probe: Callable[[], T | None],
    timeout: float = 30,
    what: str = "condition",
    interval: float = 0.2,
    tolerate: tuple[type[BaseException], ...] = (),
) -> T:
    """Call `probe` until it returns something truthy and return that; exceptions in `tolerate` count as
    "not yet" (the last one is reported). Fails the test once `timeout` seconds have passed."""
    deadline = time.monotonic() + timeout
    last_error: BaseException | None = None
    while True:
        try:
            value = probe()
            if value:
                return value
        except tolerate as error:
            last_error = error
        if time.monotonic() > deadline:
            detail = f" (last error: {last_error})" if last_error else ""
            raise AssertionError(f"{what}: not reached within {timeout:.0f}s{detail}")
        time.sleep(interval)
