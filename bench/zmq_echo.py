"""The raw pyzmq baseline's worker: a DEALER that echoes every message back (no torch, no iwg protocol)."""

from __future__ import annotations

import sys

import zmq
from iwg_worker.security import CurveKeys, make_client


def main(endpoint: str, curve_dir: str | None) -> None:
    context = zmq.Context()
    sock = context.socket(zmq.DEALER)
    if curve_dir:
        make_client(sock, CurveKeys.load(curve_dir))
    sock.connect(endpoint)
    sock.send(b"ready")
    while True:
        frames = sock.recv_multipart(copy=False)
        if len(frames) == 1 and frames[0].bytes == b"stop":
            return
        sock.send_multipart(frames, copy=False)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 and sys.argv[2] else None)
