"""The worker's health server (`iwg_worker.health_server`): what a prober that gives up leaves in the log."""

from __future__ import annotations

import socket
import struct
import time
from typing import Any

import pytest
from iwg_worker.health_server import HealthServer
from prometheus_client import CollectorRegistry


def test_a_prober_that_gives_up_before_its_answer_leaves_no_traceback(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A kubelet's probe past its timeout closes its connection while the worker is slow to answer (loading its
    model): the write of the late answer fails; that is a debug line, not a traceback on stderr per probe."""
    answered = []

    def slow_liveness() -> tuple[bool, dict[str, Any]]:
        time.sleep(0.3)
        answered.append(True)
        return True, {}

    server = HealthServer("127.0.0.1", 0, slow_liveness, lambda: (True, {}), CollectorRegistry())
    server.start()
    try:
        for _ in range(3):
            with socket.create_connection(("127.0.0.1", server.port)) as sock:
                sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
                # Reset at close (linger 0), as a prober's cancelled request does: the late answer's write fails.
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        deadline = time.monotonic() + 5
        while len(answered) < 3 and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.3)  # the writes after the probes
        with socket.create_connection(("127.0.0.1", server.port)) as sock:  # and it still answers
            sock.sendall(b"GET /readyz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            assert sock.makefile("rb").readline().startswith(b"HTTP/1.0 200")
    finally:
        server.stop()
    assert len(answered) >= 3
    err = capsys.readouterr().err
    assert "Traceback" not in err and "BrokenPipeError" not in err and "ConnectionResetError" not in err, err
