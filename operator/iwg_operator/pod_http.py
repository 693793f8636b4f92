"""HTTP from the operator to the groups' pods: a connection pool per purpose, and bounded reads.

The pods run images their tenants choose, so nothing they answer may cost the shared operator more than a
fixed amount:

- **Bounded bodies.** A /healthz answer is read up to `HEALTH_BODY_LIMIT`, a /metrics page up to
  `METRICS_BODY_LIMIT` (`read_bounded`); a longer body fails that probe or that scrape (`BodyTooLarge`) and
  its connection is closed unread. Bodies are never decompressed (`Accept-Encoding: identity`, and a
  compressed answer is read as the bytes it is), so a small compressed body cannot expand either.
- **A pool per purpose, without a total limit** (`PodClients`): health probes, metrics scrapes, drains and
  the activation long-polls of groups at zero never wait for each other's connections, nor for a connection at all, so a probe's timeout measures only
  the worker's answer. The number of connections is bounded by the work itself: a group's probe round waits
  for its probes, so at most one probe per pod is in flight; one scrape per driver; one drain per driver and
  leaving replica.
"""

from __future__ import annotations

import aiohttp

HEALTH_BODY_LIMIT = 1 << 20  # 1 MiB: a worker's /healthz report is a few hundred bytes
METRICS_BODY_LIMIT = 8 << 20  # 8 MiB: a driver's /metrics page is tens of KiB, with its histograms
READ_CHUNK = 1 << 16


class BodyTooLarge(Exception):
    """An answer longer than the operator reads from a pod."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        super().__init__(f"answer longer than {limit} bytes ({limit / (1 << 20):g} MiB)")


async def read_bounded(response: aiohttp.ClientResponse, limit: int) -> bytes:
    """The body, or `BodyTooLarge` as soon as more than `limit` bytes came (or were announced): at most
    `limit` + one chunk is ever held. The connection of a body left unread is closed, never reused."""
    if response.content_length is not None and response.content_length > limit:
        response.close()
        raise BodyTooLarge(limit)
    body = bytearray()
    while True:
        chunk = await response.content.read(READ_CHUNK)
        if not chunk:
            return bytes(body)
        body += chunk
        if len(body) > limit:
            response.close()
            raise BodyTooLarge(limit)


def session() -> aiohttp.ClientSession:
    """A session for one purpose: its own pool, no total or per-host connection limit, no decompression."""
    return aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=0, limit_per_host=0),
        auto_decompress=False,
        headers={"Accept-Encoding": "identity"},
    )


class PodClients:
    """The sessions of the supervisor's four purposes, each made on first use and closed together."""

    def __init__(self) -> None:
        self._sessions: dict[str, aiohttp.ClientSession] = {}

    def _get(self, purpose: str) -> aiohttp.ClientSession:
        made = self._sessions.get(purpose)
        if made is None or made.closed:
            made = self._sessions[purpose] = session()
        return made

    @property
    def probes(self) -> aiohttp.ClientSession:
        return self._get("probes")

    @property
    def scrapes(self) -> aiohttp.ClientSession:
        return self._get("scrapes")

    @property
    def drains(self) -> aiohttp.ClientSession:
        return self._get("drains")

    @property
    def activations(self) -> aiohttp.ClientSession:
        return self._get("activations")

    async def close(self) -> None:
        sessions = list(self._sessions.values())
        self._sessions.clear()
        for made in sessions:
            await made.close()
