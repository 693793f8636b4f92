"""HTTP to the groups' pods: hung workers of other groups cost a healthy group's probes nothing, and answers
are read only up to their limits (real servers on loopback addresses)."""

from __future__ import annotations

import asyncio
import contextlib
import gzip
import json
import resource
import time
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest
from iwg_operator.api import wiring
from iwg_operator.autoscaling import scaler
from iwg_operator.autoscaling.policy import MetricsError
from iwg_operator.autoscaling.scaler import GroupScaler
from iwg_operator.driver_admin import DriverPod, drain_in_drivers
from iwg_operator.health.prober import probe_worker
from iwg_operator.planning import ObservedPod
from iwg_operator.pod_http import HEALTH_BODY_LIMIT, METRICS_BODY_LIMIT, PodClients

HUNG, HEALTHY = 120, 20
HUGE_BYTES = 1536 << 20
# The healthy probes' timeout, and how long the hung pods' requests stay in flight: far enough apart that a
# healthy probe queued behind the hung requests fails its timeout, with room for a stalled process (a loaded
# machine pauses any process for 2-3 s) in between.
HEALTHY_TIMEOUT_S, HUNG_TIMEOUT_S = 8.0, 20.0


def pod(ip: str) -> ObservedPod:
    return ObservedPod(name=f"w-{ip}", group="g", replica=0, rank=0, revision="r", ready=True, uid=ip, ip=ip)


Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


@contextlib.asynccontextmanager
async def servers(
    addresses: list[str], port: int, handler: Handler
) -> AsyncIterator[list[asyncio.StreamWriter]]:
    """Servers on `addresses`; yields their connections as they are accepted."""
    writers: list[asyncio.StreamWriter] = []

    async def tracked(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writers.append(writer)
        await handler(reader, writer)

    started = [await asyncio.start_server(tracked, host, port) for host in addresses]
    try:
        yield writers
    finally:
        for server in started:
            server.close()
        for writer in writers:
            writer.close()


async def hang(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Accepts and never answers (a stopped process, a node gone without a reset)."""
    with contextlib.suppress(Exception):
        await reader.read()  # until the client hangs up


async def healthy(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    body = json.dumps({"alive": True}).encode()
    with contextlib.suppress(Exception):
        while await reader.readuntil(b"\r\n\r\n"):
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n")
            writer.write(b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
            await writer.drain()


async def huge(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """1.5 GiB, no Content-Length, generated as it is sent, until the client hangs up."""
    chunk = b"x" * (1 << 20)
    with contextlib.suppress(Exception):
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nConnection: close\r\n\r\n")
        for _ in range(HUGE_BYTES // len(chunk)):
            writer.write(chunk)
            await writer.drain()
    writer.close()


async def test_120_hung_workers_of_other_groups_fail_no_probe_of_a_healthy_group(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Probes, scrapes and drains of 120 hung pods in flight (held until their 20 s timeouts): a healthy group's
    20 probes with an 8 s timeout all pass, in about the time one answer takes."""
    hung = [f"127.77.0.{i}" for i in range(1, HUNG + 1)]
    fine = [f"127.78.0.{i}" for i in range(1, HEALTHY + 1)]
    port, driver_port = wiring.DEFAULT_HEALTH_PORT, wiring.DEFAULT_HTTP_PORT
    monkeypatch.setattr(scaler, "SCRAPE_TIMEOUT_S", HUNG_TIMEOUT_S)  # 3 s: the scrapes would end first
    clients = PodClients()
    async with (
        servers(hung, port, hang) as probed,
        servers(hung, driver_port, hang) as scraped_and_drained,
        servers(fine, port, healthy),
    ):
        try:
            stuck = [
                *(probe_worker(clients.probes, pod(ip), HUNG_TIMEOUT_S) for ip in hung),
                *(GroupScaler().scrape(clients.scrapes, [DriverPod(ip, ip)], driver_port) for ip in hung),
                # A drain request waits its timeout plus 10 s for the driver's answer.
                drain_in_drivers(
                    clients.drains,
                    [DriverPod(ip, ip) for ip in hung],
                    driver_port,
                    "t",
                    [1, 2],
                    timeout=HUNG_TIMEOUT_S - 10,
                ),
            ]
            held = asyncio.gather(*stuck, return_exceptions=True)
            deadline = time.monotonic() + 30
            # Every hung request is held: a probe and a scrape per pod, a drain per pod and replica.
            while len(probed) < HUNG or len(scraped_and_drained) < 3 * HUNG:
                assert time.monotonic() < deadline, (len(probed), len(scraped_and_drained))
                await asyncio.sleep(0.05)
            started = time.monotonic()
            outcomes = await asyncio.gather(
                *(probe_worker(clients.probes, pod(ip), HEALTHY_TIMEOUT_S) for ip in fine)
            )
            took = time.monotonic() - started
            assert [o.reason for o in outcomes if not o.healthy] == []
            # Far below the hung requests' timeout: no healthy probe waited for them.
            assert took < HEALTHY_TIMEOUT_S < HUNG_TIMEOUT_S, took
            hung_outcomes = await held
            assert all(not o.healthy for o in hung_outcomes[:HUNG]), "the hung ones fail on their own timeout"
        finally:
            await clients.close()


async def test_a_huge_health_answer_fails_the_probe_and_a_huge_metrics_page_the_scrape() -> None:
    """1.5 GiB streamed bodies: read up to the limits only (the process's peak RSS grows by less than 64 MiB)."""
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss << 10
    clients = PodClients()
    async with servers(["127.79.0.1"], wiring.DEFAULT_HEALTH_PORT, huge), servers(["127.79.0.2"], 9000, huge):
        try:
            outcome = await probe_worker(clients.probes, pod("127.79.0.1"), 60)
            assert not outcome.healthy
            assert outcome.reason == (
                f"health answer not read: answer longer than {HEALTH_BODY_LIMIT} bytes (1 MiB)"
            )
            with pytest.raises(
                MetricsError, match=f"driver pod d unavailable: .* {METRICS_BODY_LIMIT} bytes"
            ):
                await GroupScaler().scrape(clients.scrapes, [DriverPod("d", "127.79.0.2")], 9000)
        finally:
            await clients.close()
    grown = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss << 10) - before
    assert grown < 64 << 20, f"peak RSS grew by {grown >> 20} MiB"


async def test_a_gzip_answer_is_not_expanded() -> None:
    """A compressed body is read as its bytes (a small gzip could expand to gigabytes): not a health report."""
    packed = gzip.compress(json.dumps({"alive": True}).encode())

    async def gzipped(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(Exception):
            await reader.readuntil(b"\r\n\r\n")
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Encoding: gzip\r\nContent-Type: application/json\r\n")
            writer.write(b"Content-Length: %d\r\nConnection: close\r\n\r\n%s" % (len(packed), packed))
            await writer.drain()
        writer.close()

    clients = PodClients()
    async with servers(["127.79.0.3"], wiring.DEFAULT_HEALTH_PORT, gzipped):
        try:
            async with clients.probes.get(
                f"http://127.79.0.3:{wiring.DEFAULT_HEALTH_PORT}/healthz"
            ) as answer:
                assert answer.request_info.headers["Accept-Encoding"] == "identity"
                assert await answer.read() == packed
        finally:
            await clients.close()
