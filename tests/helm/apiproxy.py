"""A recording reverse proxy in front of the test API server.

The operator under test talks to the API server through it (plain HTTP on loopback; the proxy speaks TLS
upstream and passes the operator's own bearer token through, so the API server authorises the operator,
not the proxy). Every request is recorded as the RBAC attributes the API server authorises it by
(API group, resource[/subresource], verb, namespace) with the response's status code: the complete list of
what the operator did, Kopf's watches and patches included, to compare against what the chart grants.
"""

from __future__ import annotations

import asyncio
import ssl
import threading
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

import aiohttp
from aiohttp import web
from iwg_operator.kube import api_error

# Headers that describe one hop, not the message (RFC 9110 7.6.1), plus the length/encoding aiohttp redoes.
_HOP_HEADERS = frozenset(
    h.lower()
    for h in (
        "Connection", "Keep-Alive", "Proxy-Authenticate", "Proxy-Authorization", "TE", "Trailer",
        "Transfer-Encoding", "Upgrade", "Host", "Content-Length",
    )
)  # fmt: skip


@dataclass(frozen=True)
class Request:
    """One request, as RBAC sees it. `resource` is None for non-resource URLs (discovery, /version)."""

    method: str
    path: str
    status: int
    group: str | None
    resource: str | None
    verb: str
    namespace: str | None
    causes: tuple[str, ...] = ()  # the types of the causes an error response gives (NamespaceTerminating)

    @property
    def rule(self) -> tuple[str, str, str]:
        assert self.group is not None and self.resource is not None
        return (self.group, self.resource, self.verb)


def rbac_attributes(
    method: str, url: str, content_type: str, status: int
) -> list[tuple[str | None, str | None, str, str | None]]:
    """(group, resource, verb, namespace) for a request, the way the API server's request-info resolver
    derives them; a server-side apply that created its object also needed `create`."""
    split = urlsplit(url)
    parts = [p for p in split.path.split("/") if p]
    query = parse_qs(split.query)
    if parts[:1] == ["api"] and len(parts) >= 2:
        group, rest = "", parts[2:]
    elif parts[:1] == ["apis"] and len(parts) >= 3:
        group, rest = parts[1], parts[3:]
    else:
        return [(None, None, method.lower(), None)]
    if not rest:  # /api/v1, /apis/group/version: discovery
        return [(None, None, method.lower(), None)]
    namespace = None
    if rest[0] == "namespaces" and len(rest) >= 3:
        namespace, rest = rest[1], rest[2:]
    elif rest[0] == "namespaces" and len(rest) == 2:
        namespace = rest[1]
    resource, name, subresource = (
        rest[0],
        rest[1] if len(rest) > 1 else None,
        rest[2] if len(rest) > 2 else None,
    )
    full = f"{resource}/{subresource}" if subresource else resource
    watching = query.get("watch", ["false"])[0] in ("true", "1")
    verbs = {
        "GET": "watch" if watching else ("get" if name else "list"),
        "HEAD": "get" if name else "list",
        "POST": "create",
        "PUT": "update",
        "PATCH": "patch",
        "DELETE": "delete" if name else "deletecollection",
    }
    verb = verbs[method.upper()]
    found: list[tuple[str | None, str | None, str, str | None]] = [(group, full, verb, namespace)]
    if verb == "patch" and content_type.startswith("application/apply-patch") and status == 201:
        found.append((group, full, "create", namespace))
    return found


class RecordingProxy:
    """Runs in its own thread and event loop; `url` is what the operator's kubeconfig points at."""

    def __init__(self, upstream: str, ca_file: Path) -> None:
        self.upstream = upstream.rstrip("/")
        self._ssl = ssl.create_default_context(cafile=str(ca_file))
        self.requests: list[Request] = []
        self._lock = threading.Lock()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="api-proxy", daemon=True)
        self._runner: web.AppRunner | None = None
        self._session: aiohttp.ClientSession | None = None
        self.port = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> RecordingProxy:
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self._loop).result(timeout=10)
        return self

    def stop(self) -> None:
        asyncio.run_coroutine_threadsafe(self._stop(), self._loop).result(timeout=10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
        self._loop.close()

    def recorded(self) -> list[Request]:
        with self._lock:
            return list(self.requests)

    async def _start(self) -> None:
        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(ssl=self._ssl),
            auto_decompress=False,
            timeout=aiohttp.ClientTimeout(total=None),
        )
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.router.add_route("*", "/{tail:.*}", self._forward)
        # A client that goes away (the operator stopping) cancels its handler and so its upstream watch.
        self._runner = web.AppRunner(app, access_log=None, handle_signals=False, handler_cancellation=True)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.port = int(self._runner.addresses[0][1])

    async def _stop(self) -> None:
        if self._session is not None:
            await self._session.close()  # ends every upstream stream still open
        if self._runner is not None:
            await self._runner.cleanup()

    def _record(
        self, method: str, url: str, content_type: str, status: int, causes: tuple[str, ...] = ()
    ) -> None:
        with self._lock:
            for group, resource, verb, namespace in rbac_attributes(method, url, content_type, status):
                self.requests.append(Request(method, url, status, group, resource, verb, namespace, causes))

    async def _forward(self, request: web.Request) -> web.StreamResponse:
        assert self._session is not None
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _HOP_HEADERS}
        body = await request.read()
        content_type = request.headers.get("Content-Type", "")
        async with self._session.request(
            request.method, self.upstream + request.path_qs, headers=headers, data=body or None
        ) as upstream:
            response = web.StreamResponse(status=upstream.status, reason=upstream.reason)
            for key, value in upstream.headers.items():
                if key.lower() not in _HOP_HEADERS:
                    response.headers.add(key, value)
            if upstream.status >= 400:  # a Status object: small, and its causes say why
                error = await upstream.read()
                self._record(
                    request.method,
                    request.path_qs,
                    content_type,
                    upstream.status,
                    api_error(upstream.status, error.decode(errors="replace")).causes,
                )
                await response.prepare(request)
                await response.write(error)
                await response.write_eof()
                return response
            self._record(request.method, request.path_qs, content_type, upstream.status)
            await response.prepare(request)
            try:
                async for chunk in upstream.content.iter_any():
                    await response.write(chunk)
                await response.write_eof()
            except (aiohttp.ClientError, ConnectionResetError):
                pass  # either side went away mid-stream (a watch ending): nothing more to relay
            return response


def rules_used(requests: Iterable[Request]) -> set[tuple[str, str, str]]:
    return {r.rule for r in requests if r.resource is not None}
