"""Which driver pods the operator asks to drain, and what a driver that cannot be asked means (real HTTP
servers on loopback)."""

from __future__ import annotations

import socket
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from iwg_operator.driver_admin import DrainError, DriverPod, drain_in_drivers, select_drivers


def driver(name: str, ready: bool, state: str = "running", terminating: bool = False) -> dict[str, Any]:
    metadata: dict[str, Any] = {"name": name}
    if terminating:
        metadata["deletionTimestamp"] = "2026-12-05T00:00:00Z"
    return {
        "metadata": metadata,
        "status": {
            "podIP": f"10.0.0.{len(name)}",
            "conditions": [{"type": "Ready", "status": str(ready)}],
            "containerStatuses": [{"name": "driver", "restartCount": 1, "state": {state: {}}}],
        },
    }


PODS = [
    driver("ready", True),
    driver("missed-a-probe", False),
    driver("lame-duck", True, terminating=True),
    driver("starting", False, state="waiting"),
]


def test_metrics_come_from_ready_drivers_and_drains_go_to_every_running_one() -> None:
    assert [d.name for d in select_drivers(PODS)] == ["ready"]
    assert [d.name for d in select_drivers(PODS, routing=True)] == ["lame-duck", "missed-a-probe", "ready"]
    assert select_drivers(PODS)[0].process == "ready#1"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


async def test_a_refused_connect_has_nothing_to_drain_and_a_refusal_is_an_error() -> None:
    asked: list[str] = []

    async def drain(request: web.Request) -> web.Response:
        asked.append(request.path)
        return web.Response(status=int(request.headers.get("X-Status", "200")))

    app = web.Application()
    app.router.add_post("/admin/replicas/{replica}/drain", drain)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.2", port).start()  # nothing listens on 127.0.0.3:port
    try:
        async with aiohttp.ClientSession() as http:
            listening, gone = DriverPod("a", "127.0.0.2"), DriverPod("b", "127.0.0.3")
            await drain_in_drivers(http, [listening, gone], port, "t", [0, 1], 5)
            assert sorted(asked) == ["/admin/replicas/0/drain", "/admin/replicas/1/drain"]
            async with aiohttp.ClientSession(headers={"X-Status": "500"}) as failing:
                with pytest.raises(DrainError, match="driver pod a: drain of replica 0 answered HTTP 500"):
                    await drain_in_drivers(failing, [listening, gone], port, "t", [0], 5)
    finally:
        await runner.cleanup()
