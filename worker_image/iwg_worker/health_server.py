"""The worker's HTTP face for kubelet and the operator's prober: /healthz, /readyz, /metrics."""

from __future__ import annotations

import json
import logging
import sys
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

log = logging.getLogger(__name__)

# Each probe returns (healthy, report).
Probe = Callable[[], tuple[bool, dict[str, Any]]]


class HealthServer:
    def __init__(
        self, host: str, port: int, liveness: Probe, readiness: Probe, registry: CollectorRegistry
    ) -> None:
        routes: dict[str, Callable[[], tuple[int, str, bytes]]] = {
            "/healthz": lambda: _probe_response(liveness),
            "/readyz": lambda: _probe_response(readiness),
            "/metrics": lambda: (200, CONTENT_TYPE_LATEST, generate_latest(registry)),
        }

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                route = routes.get(self.path.split("?", 1)[0])
                if route is None:
                    status, ctype, body = 404, "text/plain", b"not found\n"
                else:
                    try:
                        status, ctype, body = route()
                    except Exception as exc:  # a probe must answer, even when the worker is broken
                        status, ctype, body = 503, "text/plain", f"{type(exc).__name__}: {exc}\n".encode()
                self.send_response(status)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: Any) -> None:
                log.debug("health: " + format, *args)

        self._server = _ProbeServer((host, port), Handler)
        self._server.daemon_threads = True
        self.port = int(self._server.server_address[1])
        self._thread = threading.Thread(target=self._server.serve_forever, name="iwg-health", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()


class _ProbeServer(ThreadingHTTPServer):
    def handle_error(self, request: Any, client_address: Any) -> None:
        """A prober that gave up before its answer was written (a kubelet's probe past its timeoutSeconds while
        the worker loads its model) closed its connection: one line at debug, not socketserver's traceback on
        stderr for each."""
        error = sys.exc_info()[1]
        if isinstance(error, (BrokenPipeError, ConnectionResetError)):
            log.debug("health: %s went away before its answer: %s", client_address, error)
            return
        super().handle_error(request, client_address)


def _probe_response(probe: Probe) -> tuple[int, str, bytes]:
    healthy, report = probe()
    return (200 if healthy else 503), "application/json", json.dumps(report, default=str).encode()
