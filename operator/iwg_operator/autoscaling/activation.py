"""Scale from zero without waiting for a scrape: while a group is at zero replicas, the autoscaler keeps one
long-poll open to each of its ready drivers (`GET /activation?wait=30`, the driver's activation.py). A driver
answers it as soon as it holds a request (at once when it holds one already), or after the wait with nothing
held; the watch then sets `woken`, and the supervisor runs the group's autoscaler at once instead of at its
next scrape. The driver needs no Kubernetes credentials and the operator no new rights: it is the same port
and pod IP the scrape reads.

Bounded: at most one request open per driver pod of a group at zero. `track` starts the missing ones and
cancels those of drivers that left the set; `stop` cancels them all when the group leaves zero (or stops being
autoscaled, or goes). A poll that failed (the pod went, an old driver answers 404) ends and is started again
at the next autoscaler round; one that reported a held request ends too and is not started again until the
group has left zero (its driver would answer at once again, and the scale-up is already under way).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import Sequence

import aiohttp

from iwg_operator.driver_admin import CONNECT_TIMEOUT_S, DriverPod
from iwg_operator.pod_http import read_bounded

log = logging.getLogger("iwg_operator.autoscaling")

POLL_WAIT_S = 30.0
MIN_POLL_S = 1.0  # a driver that answers "nothing held" without waiting is asked at most this often
ACTIVATION_BODY_LIMIT = 1 << 16  # the answer is `{"waiting": n}`


class ActivationWatch:
    def __init__(self) -> None:
        self.woken = asyncio.Event()
        self._polls: dict[tuple[str, str], asyncio.Task[None]] = {}  # (driver process, url) -> its long-poll
        self._reported: set[tuple[str, str]] = set()  # polls that saw a held request since the group hit zero

    @property
    def open(self) -> int:
        return sum(1 for task in self._polls.values() if not task.done())

    def track(self, http: aiohttp.ClientSession, drivers: Sequence[DriverPod], port: int) -> None:
        """The group is at zero: one long-poll to each of `drivers`, none to any other."""
        wanted = {(d.process, f"http://{d.address}:{port}/activation?wait={POLL_WAIT_S:g}") for d in drivers}
        for key in [k for k in self._polls if k not in wanted]:
            self._polls.pop(key).cancel()
        for key in wanted:
            task = self._polls.get(key)
            if (task is None or task.done()) and key not in self._reported:
                self._polls[key] = asyncio.create_task(self._poll(http, key), name=f"activation {key[0]}")

    def stop(self) -> None:
        """The group left zero: no long-poll stays open."""
        for task in self._polls.values():
            task.cancel()
        self._polls.clear()
        self._reported.clear()

    async def close(self) -> None:
        tasks = list(self._polls.values())
        self.stop()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task

    async def _poll(self, http: aiohttp.ClientSession, key: tuple[str, str]) -> None:
        driver, url = key
        timeout = aiohttp.ClientTimeout(total=POLL_WAIT_S + 10, sock_connect=CONNECT_TIMEOUT_S)
        try:
            while True:
                asked = time.monotonic()
                async with http.get(url, timeout=timeout) as response:
                    if response.status != 200:
                        raise ValueError(f"HTTP {response.status}")
                    body = await read_bounded(response, ACTIVATION_BODY_LIMIT)
                waiting = json.loads(body).get("waiting")
                if isinstance(waiting, int | float) and waiting > 0:
                    self._reported.add(key)
                    self.woken.set()
                    return
                # Nothing held: asked again at once, unless the driver did not wait (then once a second).
                await asyncio.sleep(max(0.0, MIN_POLL_S - (time.monotonic() - asked)))
        except asyncio.CancelledError:
            raise
        except Exception as error:  # the next round starts it again; the scrape still sees held requests
            log.debug(
                "activation long-poll to driver %s ended: %s", driver, str(error) or type(error).__name__
            )
