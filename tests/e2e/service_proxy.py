"""A loopback TCP proxy standing in for a ClusterIP Service's virtual IP (what kube-proxy gives a client in a
cluster); the node agent has no kube-proxy, and its DNS answers a ClusterIP name with the ready endpoints.

For each client connection it resolves the Service's name through the cluster DNS (the node agent's server,
so it sees endpoints come and go as the EndpointSlice controller marks them), picks a ready endpoint round-robin
and connects to it; a refused (or otherwise failed) connect tries the next endpoint of that answer. Then it
splices bytes both ways, and when either side closes it closes the other, so a driver that closes a keep-alive
connection closes the client's.

What it does not stand in for, honestly: kube-proxy in iptables or nftables mode picks an endpoint at random
and does not retry a refused connect (the client sees the refusal and must retry itself; the `openai`
client's default retries do); IPVS does not retry either. The retry on a refused connect is what a proxying
load balancer (Envoy, a gateway) does, and it covers the moment between a driver process dying and the
endpoint being marked not ready. Each connection sticks to one endpoint for its life, as with kube-proxy.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import threading
from dataclasses import dataclass, field

from tests.e2e.harness import resolve

# A connect that is not answered at all (no reset, no refusal) counts as refused after this long. A refused one
# fails at once whatever it is; a late one (an endpoint or this process stalled on a loaded machine) must not.
CONNECT_TIMEOUT_S = 10.0


@dataclass
class ServiceProxy:
    dns_server: str  # the node agent's DNS (its gateway address)
    service: str  # fully qualified: <name>.<namespace>.svc.cluster.local
    port: int  # the Service's (and its endpoints') port
    retry_refused: bool = True  # False: one connect to the chosen endpoint, as kube-proxy does
    listen_port: int = 0  # bound on 127.0.0.1; 0 picks a free one (read it after start())
    connections: int = 0
    refused: int = 0  # connects that failed and went to the next endpoint (or, without retry, to the client)
    _turn: itertools.count[int] = field(default_factory=itertools.count)
    _loop: asyncio.AbstractEventLoop | None = None
    _server: asyncio.Server | None = None
    _thread: threading.Thread | None = None

    def start(self) -> ServiceProxy:
        ready = threading.Event()
        self._loop = asyncio.new_event_loop()

        def run() -> None:
            assert self._loop is not None
            asyncio.set_event_loop(self._loop)
            self._server = self._loop.run_until_complete(
                asyncio.start_server(self._handle, "127.0.0.1", self.listen_port)
            )
            self.listen_port = self._server.sockets[0].getsockname()[1]
            ready.set()
            self._loop.run_forever()

        self._thread = threading.Thread(target=run, name="service-proxy", daemon=True)
        self._thread.start()
        if not ready.wait(10):
            raise RuntimeError("the Service proxy did not start")
        return self

    def stop(self) -> None:
        if self._loop is None:
            return

        async def close() -> None:
            if self._server is not None:
                self._server.close()
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        asyncio.run_coroutine_threadsafe(close(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        if self._thread is not None:
            self._thread.join(10)
        self._loop.close()
        self._loop = None

    async def _connect(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter] | None:
        endpoints = sorted(await asyncio.to_thread(resolve, self.dns_server, self.service))
        if not endpoints:
            return None
        first = next(self._turn)
        tries = len(endpoints) if self.retry_refused else 1
        for offset in range(tries):
            address = endpoints[(first + offset) % len(endpoints)]
            try:
                return await asyncio.wait_for(asyncio.open_connection(address, self.port), CONNECT_TIMEOUT_S)
            except (OSError, TimeoutError):
                self.refused += 1
        return None

    async def _handle(self, client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter) -> None:
        # A connection cancelled by stop() ends quietly (asyncio's server would log the cancelled task).
        with contextlib.suppress(asyncio.CancelledError):
            await self._serve(client_reader, client_writer)

    async def _serve(self, client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            upstream = await self._connect()
        except Exception:
            upstream = None
        if upstream is None:
            client_writer.close()  # the client sees its connection closed, as with no endpoint to reach
            return
        upstream_reader, upstream_writer = upstream
        splices = [
            asyncio.create_task(_pipe(client_reader, upstream_writer)),
            asyncio.create_task(_pipe(upstream_reader, client_writer)),
        ]
        try:
            # Either side closing ends the connection: the other side is closed too.
            await asyncio.wait(splices, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in splices:
                task.cancel()
            for writer in (client_writer, upstream_writer):
                writer.close()
                with contextlib.suppress(Exception):
                    await writer.wait_closed()


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    with contextlib.suppress(OSError, asyncio.IncompleteReadError):
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
