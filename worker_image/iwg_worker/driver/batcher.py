"""Dynamic batching: inputs wait until a batch is full or the oldest has waited `max_wait`.

Inputs only share a batch when they share a `BatchKey` (the task and, for generation, the sampling
parameters), because a replica runs one batch with one set of parameters.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from dataclasses import dataclass, field

from iwg_worker.driver.metrics import DriverMetrics
from iwg_worker.driver.pool import Batch, ItemResult, Task


@dataclass(frozen=True)
class BatchParams:
    max_batch_size: int
    max_wait_s: float

    def __post_init__(self) -> None:
        if self.max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {self.max_batch_size}")
        if not 0.0 <= self.max_wait_s <= 60.0:
            raise ValueError(f"max_wait_s must be within [0, 60], got {self.max_wait_s}")


@dataclass(frozen=True)
class BatchKey:
    task: Task
    token_ids: bool = False  # inputs are token ids, not text: a replica gets one kind per batch


@dataclass(eq=False)
class QueuedItem:
    input: str | tuple[int, ...]
    key: BatchKey
    future: asyncio.Future[ItemResult]
    enqueued: float = field(default_factory=time.monotonic)


class QueueFull(Exception):
    pass


class Batcher:
    def __init__(self, params: BatchParams, max_queue: int, metrics: DriverMetrics) -> None:
        self._params = params
        self._max_queue = max_queue
        self._metrics = metrics
        self._queues: dict[BatchKey, deque[QueuedItem]] = {}
        self._depth = 0
        self._arrived = asyncio.Event()
        metrics.queue_limit.set(max_queue)
        self._publish_params()

    @property
    def params(self) -> BatchParams:
        return self._params

    @property
    def depth(self) -> int:
        return self._depth

    @property
    def max_queue(self) -> int:
        return self._max_queue

    def set_params(self, params: BatchParams) -> None:
        self._params = params
        self._publish_params()
        self._arrived.set()  # a smaller batch size or wait may make the current batch ready now

    def enqueue(self, inputs: list[str | tuple[int, ...]], key: BatchKey) -> list[QueuedItem]:
        """Queue every input of one request, or none of them (QueueFull): a request is admitted whole."""
        if self._depth + len(inputs) > self._max_queue:
            raise QueueFull(f"queue holds {self._depth} of {self._max_queue} inputs")
        loop = asyncio.get_running_loop()
        now = time.monotonic()
        items = [QueuedItem(x, key, loop.create_future(), now) for x in inputs]
        self._queues.setdefault(key, deque()).extend(items)
        self._set_depth(self._depth + len(items))
        self._arrived.set()
        return items

    def discard(self, items: list[QueuedItem]) -> None:
        """Take the still-queued items of a request that gave up (timeout, client gone) out of the queue."""
        for item in items:
            queue = self._queues.get(item.key)
            if queue is not None and not item.future.done():
                try:
                    queue.remove(item)
                except ValueError:
                    continue  # already in a batch
                self._set_depth(self._depth - 1)

    def fail_all(self, exc: BaseException) -> int:
        """Fail every queued input with `exc` (e.g. no replica came back in time). Returns how many."""
        failed = 0
        for queue in self._queues.values():
            while queue:
                item = queue.popleft()
                if not item.future.done():
                    item.future.set_exception(exc)
                    failed += 1
        self._queues.clear()
        self._set_depth(0)
        return failed

    async def wait_nonempty(self) -> None:
        while self._depth == 0:
            self._arrived.clear()
            await self._arrived.wait()

    async def next_batch(self) -> tuple[Batch, list[QueuedItem]]:
        """Wait for the oldest key's batch to fill or for its oldest input to have waited max_wait."""
        while True:
            await self.wait_nonempty()
            key, queue = self._oldest()
            params = self._params
            ready_at = queue[0].enqueued + params.max_wait_s
            now = time.monotonic()
            if len(queue) >= params.max_batch_size or now >= ready_at:
                return self._take(key, queue, params.max_batch_size)
            self._arrived.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._arrived.wait(), ready_at - now)

    def _oldest(self) -> tuple[BatchKey, deque[QueuedItem]]:
        for key in [k for k, q in self._queues.items() if not q]:
            del self._queues[key]
        return min(self._queues.items(), key=lambda kq: kq[1][0].enqueued)

    def _take(self, key: BatchKey, queue: deque[QueuedItem], size: int) -> tuple[Batch, list[QueuedItem]]:
        items = [queue.popleft() for _ in range(min(size, len(queue)))]
        self._set_depth(self._depth - len(items))
        now = time.monotonic()
        for item in items:
            self._metrics.queue_wait.observe(now - item.enqueued)
        batch = Batch(task=key.task, inputs=tuple(i.input for i in items))
        return batch, items

    def _set_depth(self, depth: int) -> None:
        self._depth = depth
        self._metrics.queue_depth.set(depth)

    def _publish_params(self) -> None:
        self._metrics.max_batch_size.set(self._params.max_batch_size)
        self._metrics.max_wait_seconds.set(self._params.max_wait_s)
