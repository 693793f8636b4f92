"""Streamed generation at the executor: request id -> the `GenerationStream` its items are delivered to.

A generate worker's engine sends one ``stream`` message per step holding the new output of every running
request of its replica. Whichever thread receives it (an executor's I/O thread, a caller receiving for itself,
or the engine's thread under `UniProcExecutor`) hands the items to `StreamHub.deliver`, which groups them by
event loop and wakes each loop once per message. A caller reads its request's items with ``async for``.

A stream ends with the item that carries a ``finish_reason`` or an ``error``; it fails with the executor's
`ReplicaLostError` when its replica loses a rank while the request runs.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import AsyncIterator
from typing import Any


class StreamFailed(RuntimeError):
    """The worker ended the request with an error (the engine failed it). ``code`` is the item's
    ``error_code``: ``replica_failure`` when the replica failed (its engine as a whole), not the request."""

    def __init__(self, message: str, code: str | None = None) -> None:
        super().__init__(message)
        self.code = code


class GenerationStream:
    """The items of one request, in order, as an async iterator (create it on the loop that reads it)."""

    def __init__(self, request_id: str, replica: int, loop: asyncio.AbstractEventLoop) -> None:
        self.request_id = request_id
        self.replica = replica
        self.loop = loop
        self._queue: asyncio.Queue[dict[str, Any] | BaseException] = asyncio.Queue()
        self.done = False

    def _push(self, item: dict[str, Any] | BaseException) -> None:  # on the loop's thread
        self._queue.put_nowait(item)

    def __aiter__(self) -> AsyncIterator[dict[str, Any]]:
        return self._items()

    async def _items(self) -> AsyncIterator[dict[str, Any]]:
        while not self.done:
            item = await self._queue.get()
            if isinstance(item, BaseException):
                self.done = True
                raise item
            if item["error"] is not None:
                self.done = True
                raise StreamFailed(item["error"], item.get("error_code"))
            self.done = item["finish_reason"] is not None
            yield item


class StreamHub:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._streams: dict[str, GenerationStream] = {}

    def register(self, stream: GenerationStream) -> None:
        with self._lock:
            if stream.request_id in self._streams:
                raise ValueError(f"request id {stream.request_id!r} already has a stream")
            self._streams[stream.request_id] = stream

    def unregister(self, request_id: str) -> None:
        with self._lock:
            self._streams.pop(request_id, None)

    def deliver(self, replica: int, items: list[dict[str, Any]]) -> None:
        """Hand each item to its stream (any thread); items of unknown or other replicas' ids are dropped."""
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[GenerationStream, dict[str, Any]]]] = {}
        with self._lock:
            for item in items:
                stream = self._streams.get(item["id"])
                if stream is None or stream.replica != replica:
                    continue
                if item["finish_reason"] is not None or item["error"] is not None:
                    del self._streams[item["id"]]
                by_loop.setdefault(stream.loop, []).append((stream, item))
        for loop, batch in by_loop.items():
            _call_soon(loop, _push_all, batch)

    def fail_replica(self, replica: int, error: BaseException) -> None:
        """Fail every stream of ``replica`` (it lost a rank)."""
        with self._lock:
            failed = [s for s in self._streams.values() if s.replica == replica]
            for stream in failed:
                del self._streams[stream.request_id]
        for stream in failed:
            _call_soon(stream.loop, stream._push, error)

    def fail_all(self, error: BaseException) -> None:
        with self._lock:
            failed = list(self._streams.values())
            self._streams.clear()
        for stream in failed:
            _call_soon(stream.loop, stream._push, error)


def _push_all(batch: list[tuple[GenerationStream, dict[str, Any]]]) -> None:
    for stream, item in batch:
        stream._push(item)


def _call_soon(loop: asyncio.AbstractEventLoop, callback: Any, arg: Any) -> None:
    with contextlib.suppress(RuntimeError):  # the loop is closed: nobody reads this stream any more
        loop.call_soon_threadsafe(callback, arg)
