"""Small replies from `MultiprocExecutor`'s workers through one FIFO, past ZMQ's I/O threads.

A reply over ZMQ crosses four threads: the worker's Python thread hands it to its ZMQ I/O thread, which
writes the ipc socket; the executor's ZMQ I/O thread reads it and signals the waiting caller's thread. For
a small call that hand-off is a large share of the round trip. Here a worker writes a reply whose encoding is
one frame of at most `MAX_MESSAGE_BYTES` into a FIFO the executor created, with one ``write``; the caller
blocked in ``poll`` on that FIFO wakes directly. Everything else (tensor frames, stream messages, hellos,
heartbeats, goodbyes, replies that do not fit) goes over the ZMQ socket as before; replies are matched by
call id, so the two paths may overtake each other.

Every worker of the executor writes into the same FIFO. Each message is ``[u32 length][msgpack header]`` in a
single ``write`` of at most ``PIPE_BUF`` bytes, which POSIX makes atomic: messages of different writers never
interleave, and a worker that dies mid-call leaves whole messages or none. The worker's descriptor is
non-blocking: when the FIFO is full (the executor is not reading) the write fails whole and the reply goes
over the socket instead.

The FIFO lives in the executor's private temporary directory (mode 0700) with mode 0600, the same protection
as the ipc sockets beside it. The payload is the protocol's msgpack header, decoded by `protocol.decode` like
a socket frame; nothing is pickled. The reader checks every length it reads: a length out of range drops
what is buffered and what is still in the FIFO (counted in ``rejected``), so garbage can neither crash nor
hang it.
"""

from __future__ import annotations

import os
import select
from pathlib import Path
from typing import Final

ENV_PATH: Final = "IWG_REPLY_PIPE"  # set by MultiprocExecutor, not part of the pod wiring
PIPE_BUF: Final = getattr(select, "PIPE_BUF", 4096)  # POSIX: at least 512; Linux: 4096
_LENGTH_BYTES: Final = 4
MAX_MESSAGE_BYTES: Final = PIPE_BUF - _LENGTH_BYTES
_READ_BYTES: Final = 1 << 16  # a FIFO's default capacity on Linux


class ReplyPipeWriter:
    """A worker's end: `send` writes one small message whole, or reports that it did not."""

    def __init__(self, path: str) -> None:
        # The executor keeps its end open (O_RDWR), so opening for writing never blocks or fails for want of
        # a reader; a write after the executor is gone fails (EPIPE) and the reply takes the socket.
        self.fd = os.open(path, os.O_WRONLY | os.O_NONBLOCK)

    def send(self, message: bytes) -> bool:
        """Write ``message`` as one atomic record; False (nothing written) when it is too large or the FIFO
        is full or closed."""
        n = len(message)
        if n > MAX_MESSAGE_BYTES:
            return False
        try:
            os.write(self.fd, n.to_bytes(_LENGTH_BYTES, "little") + message)
        except OSError:  # BlockingIOError: full; BrokenPipeError: the executor went away
            return False
        return True

    def close(self) -> None:
        """Idempotent: a worker's shutdown paths may each close it."""
        fd, self.fd = self.fd, -1
        if fd >= 0:
            os.close(fd)


class ReplyPipeReader:
    """The executor's end: creates the FIFO in ``directory`` and reads the messages its workers write.

    Not thread-safe: the executor reads it under the lock that guards its response socket."""

    def __init__(self, directory: Path) -> None:
        self.path = str(directory / "replies")
        os.mkfifo(self.path, 0o600)
        self.fd = os.open(self.path, os.O_RDWR | os.O_NONBLOCK)  # never EOF, however many writers come and go
        self._pending = b""  # the start of a message whose rest is still in the FIFO
        self.received = 0
        self.rejected = 0

    def env(self) -> dict[str, str]:
        return {ENV_PATH: self.path}

    def read(self) -> list[bytes]:
        """The messages available now, in the order written; never blocks."""
        try:
            data = os.read(self.fd, _READ_BYTES)
        except BlockingIOError:
            return []
        buf = self._pending + data if self._pending else data
        messages: list[bytes] = []
        offset = 0
        end = len(buf)
        self._pending = b""
        while end - offset >= _LENGTH_BYTES:
            n = int.from_bytes(buf[offset : offset + _LENGTH_BYTES], "little")
            if not 0 < n <= MAX_MESSAGE_BYTES:
                self._discard()
                offset = end
                break
            start = offset + _LENGTH_BYTES
            if end - start < n:
                break  # the rest comes with the next read
            messages.append(buf[start : start + n])
            offset = start + n
        self._pending = buf[offset:]
        self.received += len(messages)
        return messages

    def _discard(self) -> None:
        """Not our framing: drop what is buffered and what is in the FIFO now (at most 16 reads: a record
        that is cut by that limit is found malformed by the next read, or by `protocol.decode`)."""
        self.rejected += 1
        for _ in range(16):
            try:
                if len(os.read(self.fd, _READ_BYTES)) < _READ_BYTES:
                    return
            except BlockingIOError:
                return

    def close(self) -> None:
        """Idempotent, like the writer's."""
        fd, self.fd = self.fd, -1
        if fd >= 0:
            os.close(fd)
        Path(self.path).unlink(missing_ok=True)
