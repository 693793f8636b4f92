"""Polling for state that the control plane reaches asynchronously: one helper for every test package."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def eventually(
    probe: Callable[[], T | None],
    timeout: float = 90,
    what: str = "condition",
    interval: float = 0.2,
    tolerate: tuple[type[BaseException], ...] = (),
) -> T:
    """Call `probe` until it returns something truthy and return that; exceptions in `tolerate` count as
    "not yet" (the last one is reported). Fails the test once `timeout` seconds have passed (the default is
    generous: on a loaded machine any process may stall for seconds, and a wait that succeeds costs nothing
    more for it)."""
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


def steady(
    read: Callable[[], T],
    for_s: float = 5.0,
    timeout: float = 60.0,
    what: str = "value",
    interval: float = 0.2,
) -> T:
    """Call `read` until it has returned the same value for `for_s` seconds straight, and return that value
    (before a window in which nothing may change: what was still under way has landed). Fails the test once
    `timeout` seconds have passed without such a stretch."""
    deadline = time.monotonic() + timeout
    value, since = read(), time.monotonic()
    while True:
        now = time.monotonic()
        if now - since >= for_s:
            return value
        if now > deadline:
            raise AssertionError(f"{what}: still changing after {timeout:.0f}s (last: {value!r})")
        time.sleep(interval)
        current = read()
        if current != value:
            value, since = current, time.monotonic()
