"""Run a driver: HTTP server up, wait for SIGTERM/SIGINT (and SIGHUP under `iwg serve`), then stop taking requests, finish the admitted
ones, and close the pool. Shared by `iwg-driver` (in a pod) and `iwg serve` (on one machine).

From the signal on, every answer says `Connection: close`, so a client that keeps sending moves to a new
connection (through a Service: to another driver) after its current request instead of finding its kept-alive
connection closed under a request it just sent. `lame_duck_s` keeps serving that long before the listener
closes and idle connections are closed (`iwg-driver` uses it; in a cluster the Service also needs a moment to
stop sending new connections to a pod being deleted). Requests held for a replica (a group at zero) are held
through both: a replica that starts meanwhile serves them; those still held when the drain ends are answered
503 ``driver_stopping`` with ``Retry-After`` (activation.py), which a client retries on another driver.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from collections.abc import Awaitable, Callable

from aiohttp import hdrs, web
from iwg_operator.api import wiring

from iwg_worker.driver.app import build_app
from iwg_worker.driver.service import Driver

log = logging.getLogger(__name__)

HANDED_BACK_S = 2.0  # for the answers of requests given back at the end of the drain to be written


async def run_driver(
    driver: Driver,
    host: str,
    port: int,
    admin_token: str | None,
    *,
    stop: asyncio.Event | None = None,
    on_listening: Callable[[int], Awaitable[None] | None] | None = None,
    drain_timeout_s: float = wiring.DRIVER_DRAIN_S,
    lame_duck_s: float = 0.0,
    signals: tuple[signal.Signals, ...] = (signal.SIGTERM, signal.SIGINT),
) -> None:
    """Serve until `stop` is set or one of ``signals`` arrives; `on_listening(port)` runs once HTTP is bound."""
    stopping = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in signals:
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(sig, stopping.set)
    driver.start()
    app = build_app(driver, admin_token)

    async def close_after_answer(request: web.Request, response: web.StreamResponse) -> None:
        if stopping.is_set():
            # aiohttp set its Connection header before this hook runs (and sends the headers after it): closing
            # the connection without saying so would cut the client's next request on it.
            response.force_close()
            response.headers[hdrs.CONNECTION] = "close"

    app.on_response_prepare.append(close_after_answer)
    # A client that goes away cancels its handler: a generation request is then cancelled on the worker.
    runner = web.AppRunner(app, handle_signals=False, access_log=None, handler_cancellation=True)
    await runner.setup()
    site = web.TCPSite(runner, host, port, reuse_address=True)
    await site.start()
    bound = _bound_port(runner, port)
    log.info("driver for %r listening on http://%s:%d", driver.config.served_name, host, bound)
    try:
        if on_listening is not None:
            result = on_listening(bound)
            if result is not None:
                await result
        await stopping.wait()
        if lame_duck_s > 0:
            log.info("stopping: serving %.1f s more, each answer closing its connection", lame_duck_s)
            await asyncio.sleep(lame_duck_s)
        log.info("stopping: finishing admitted requests (up to %.0f s)", drain_timeout_s)
    finally:
        # Stop accepting connections, let admitted requests finish, then stop the dispatcher and the pool.
        await runner.shutdown()
        cleanup = asyncio.ensure_future(runner.cleanup())
        await asyncio.wait({cleanup}, timeout=drain_timeout_s)
        if not cleanup.done():
            # Requests still held for a replica that did not come: answered 503 (a client retries it on
            # a driver that still runs) while their connections are open, not cut when the process ends.
            held = driver.activation.give_back("it was told to stop")
            if held:
                log.warning(
                    "stopping with %d requests held for a replica: answered 503 driver_stopping", held
                )
            await asyncio.wait({cleanup}, timeout=HANDED_BACK_S)
        if not cleanup.done():
            cleanup.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await cleanup
        await driver.stop()
        await driver.pool.close()
        for sig in signals:
            with contextlib.suppress(NotImplementedError, RuntimeError):
                loop.remove_signal_handler(sig)


def _bound_port(runner: web.AppRunner, fallback: int) -> int:
    for address in runner.addresses:
        if isinstance(address, tuple) and len(address) >= 2:
            return int(address[1])
    return fallback
