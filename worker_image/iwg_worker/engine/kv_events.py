"""What a vLLM engine's prefix cache holds, in the driver's terms: vLLM's KV cache events turned into the
driver's block hashes, stored and evicted.

vLLM's scheduler publishes every change of its prefix cache (`KVEventsConfig`): ``BlockStored`` (the blocks'
hashes, their parent's hash, their tokens, and the session id of the request they were computed for),
``BlockRemoved`` (hashes: evicted for room) and ``AllBlocksCleared``, a batch per engine step on a ZMQ PUB
socket, msgpack-encoded by msgspec (no pickle). The engine binds it to an ipc socket in a directory of its own
(mode 0700) and `KvEventSubscriber` reads it on a thread of its own.

The driver hashes each prompt in blocks of about one engine block (`iwg_worker.driver.prefix`) and sends those
hashes with the request (``prefix_blocks``); the engine gives vLLM the request's id as its session id. So a
stored block names its request, and its position in that request's prompt is its depth in vLLM's chain (its
parent's depth plus one). `KvBlockTracker` tags the engine block at position i with the driver's hash i. A
driver hash is held while at least one engine block tagged with it is cached, and evicted when the last such
block is removed. The alignment is by position, so it is close rather than exact at block edges: the driver's
blocks are characters (four a token), the engine's are tokens, chat templates add tokens of their own. What
the tracker tells the driver about whole blocks it does not guess: a prefix vLLM evicted is reported evicted
at the position vLLM evicted it.

The drivers read what changed through ``engine_stats(since)`` (`KvBlockTracker.report`): the tracker logs
(sequence, driver hash, held) and answers each driver from its own sequence number, so any number of drivers
read the same log. A driver told ``reset`` forgets what it knew of this replica's cache and starts again from
the report: the tracker's view was reset (a lost event batch, the cache cleared, its bound exceeded), the
driver's sequence fell out of the bounded log, or the tracker is a new one (its ``epoch`` changed: the engine
restarted).
"""

from __future__ import annotations

import logging
import os
import threading
from collections import OrderedDict, deque
from collections.abc import Hashable, Iterable, Sequence
from typing import Any

log = logging.getLogger(__name__)

LOG_ENTRIES = 65_536  # changes remembered for the drivers' reports
REQUESTS_REMEMBERED = 4_096  # requests whose driver hashes wait for their blocks' events
POLL_MS = 500  # the subscriber's wait for an event batch before it checks whether it should stop


class KvBlockTracker:
    """The driver hashes whose blocks vLLM's prefix cache holds, from its events (module docstring).
    Thread-safe: the subscriber thread applies events, the worker's threads ask for reports."""

    def __init__(self, max_blocks: int, log_entries: int = LOG_ENTRIES) -> None:
        self.max_blocks = max_blocks  # engine blocks tracked before the view is reset (events were lost)
        self.epoch = int.from_bytes(os.urandom(6), "little")
        self._lock = threading.Lock()
        self._requests: OrderedDict[str, tuple[int, ...]] = OrderedDict()
        self._depth: dict[Hashable, int] = {}  # engine block hash -> its position in its prompt
        self._tags: dict[Hashable, set[int]] = {}  # engine block hash -> the driver hashes at that position
        self._holders: dict[int, int] = {}  # driver hash -> engine blocks tagged with it
        self._log: deque[tuple[int, int, bool]] = deque(maxlen=log_entries)
        self._seq = 0  # the last change logged
        self._reset_seq = 0  # the latest reset (a driver that read less than it starts again)

    def expect(self, request_id: str, driver_hashes: Sequence[int]) -> None:
        """`request_id`'s prompt has the driver's block hashes `driver_hashes` (its events may come later)."""
        if not driver_hashes:
            return
        with self._lock:
            self._requests[request_id] = tuple(driver_hashes)
            self._requests.move_to_end(request_id)
            while len(self._requests) > REQUESTS_REMEMBERED:
                self._requests.popitem(last=False)

    def stored(
        self, session_id: str | None, block_hashes: Iterable[Hashable], parent: Hashable | None
    ) -> None:
        with self._lock:
            if parent is None:
                depth = 0
            elif parent in self._depth:
                depth = self._depth[parent] + 1
            else:
                return  # its parent's event came before this tracker's view began: no position to give it
            driver = self._requests.get(session_id or "", ())
            for block in block_hashes:
                self._depth[block] = depth
                if depth < len(driver):
                    self._tag(block, driver[depth])
                depth += 1
            if len(self._depth) > self.max_blocks:
                self._reset("more blocks than the cache holds (removals were missed)")

    def removed(self, block_hashes: Iterable[Hashable]) -> None:
        with self._lock:
            for block in block_hashes:
                self._depth.pop(block, None)
                for driver_hash in self._tags.pop(block, ()):
                    left = self._holders[driver_hash] - 1
                    if left:
                        self._holders[driver_hash] = left
                    else:
                        del self._holders[driver_hash]
                        self._append(driver_hash, held=False)

    def cleared(self) -> None:
        with self._lock:
            self._reset("the engine cleared its prefix cache")

    def lost(self, why: str) -> None:
        """Events were missed: nothing known can be trusted."""
        with self._lock:
            self._reset(why)

    def report(self, epoch: int | None, since: int) -> dict[str, Any]:
        """What changed after change `since` of tracker `epoch`: ``{epoch, seq, reset, stored, removed}``, the
        driver hashes now held and those now evicted (each once, its latest state). ``reset``: forget every
        hash known of this replica before applying these."""
        with self._lock:
            reset = (
                epoch != self.epoch
                or since > self._seq
                or since < self._reset_seq
                or (bool(self._log) and since < self._log[0][0] - 1)
            )
            start = self._reset_seq if reset else since
            latest: dict[int, bool] = {}
            for seq, driver_hash, held in self._log:
                if seq > start:
                    latest[driver_hash] = held
            if reset:  # whatever was held before the window is still held
                latest.update((h, True) for h in self._holders if h not in latest)
            return {
                "epoch": self.epoch,
                "seq": self._seq,
                "reset": reset,
                "stored": [h for h, held in latest.items() if held],
                "removed": [] if reset else [h for h, held in latest.items() if not held],
            }

    def size(self) -> tuple[int, int]:
        """(engine blocks, driver hashes) tracked."""
        with self._lock:
            return len(self._depth), len(self._holders)

    # -- under the lock ------------------------------------------------------------------------------

    def _tag(self, block: Hashable, driver_hash: int) -> None:
        tags = self._tags.setdefault(block, set())
        if driver_hash in tags:
            return
        tags.add(driver_hash)
        count = self._holders.get(driver_hash, 0)
        self._holders[driver_hash] = count + 1
        if not count:
            self._append(driver_hash, held=True)

    def _append(self, driver_hash: int, held: bool) -> None:
        self._seq += 1
        self._log.append((self._seq, driver_hash, held))

    def _reset(self, why: str) -> None:
        log.info("prefix cache view reset: %s", why)
        self._depth.clear()
        self._tags.clear()
        self._holders.clear()
        self._log.clear()
        self._seq += 1  # the reset is a change: a driver that read up to the change before it is told
        self._reset_seq = self._seq


class KvEventSubscriber:
    """Reads vLLM's KV event batches from `endpoint` into `tracker`, on a thread of its own, until `close`.
    A gap in the batches' sequence numbers (the publisher's high-water mark dropped some) resets the view."""

    def __init__(self, endpoint: str, tracker: KvBlockTracker) -> None:
        import zmq

        self.tracker = tracker
        self._socket: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.SUB)
        self._socket.setsockopt(zmq.SUBSCRIBE, b"")
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.connect(endpoint)
        self._stopping = False
        self._last_seq: int | None = None
        self._thread = threading.Thread(target=self._run, name="kv-events", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        import msgspec
        from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch

        decoder = msgspec.msgpack.Decoder(KVEventBatch)
        try:
            while not self._stopping:
                if not self._socket.poll(POLL_MS):
                    continue
                frames = self._socket.recv_multipart()
                if len(frames) != 3:
                    self.tracker.lost(f"a KV event message of {len(frames)} frames")
                    continue
                _topic, seq_bytes, payload = frames
                seq = int.from_bytes(seq_bytes, "big", signed=True)
                if self._last_seq is not None and seq != self._last_seq + 1:
                    self.tracker.lost(f"KV event batches {self._last_seq + 1} to {seq - 1} were not received")
                self._last_seq = seq
                try:
                    batch = decoder.decode(payload)
                except msgspec.DecodeError as exc:
                    self.tracker.lost(f"a KV event batch could not be read: {exc}")
                    continue
                for event in batch.events:
                    if isinstance(event, BlockStored):
                        self.tracker.stored(event.session_id, event.block_hashes, event.parent_block_hash)
                    elif isinstance(event, BlockRemoved):
                        self.tracker.removed(event.block_hashes)
                    elif isinstance(event, AllBlocksCleared):
                        self.tracker.cleared()
        except Exception:
            if not self._stopping:
                log.exception("reading vLLM's KV events stopped; the drivers keep their own view")
                self.tracker.lost("its events are no longer read")
        finally:
            self._socket.close(linger=0)

    def close(self) -> None:
        self._stopping = True
        self._thread.join(timeout=2 * POLL_MS / 1000)
