"""A shared-memory ring for calls from `MultiprocExecutor` to its workers: one writer, many readers.

The executor writes each call once into a chunk of a file in ``/dev/shm``; every worker it is addressed to
reads it from there, tensors included, without a copy per reader. The payload is the same msgpack header
plus raw tensor frames as on the socket (`iwg_worker.protocol`); nothing is pickled.

Layout of the file (all integers little-endian u64, all offsets 64-byte aligned)::

    header   magic, version, n_chunks, chunk_bytes, n_readers, start[n_readers]
    control  per chunk: written, targets, read[n_readers]
    data     per chunk: chunk_bytes = [n_frames][len_0 .. len_{n-1}][frame_0 .. frame_{n-1}] (frames aligned)

Message ``seq`` (1, 2, 3, ...) lives in chunk ``(seq - 1) % n_chunks``. ``written`` is the seq of the message
in the chunk, ``targets`` a bitmask of the readers it is addressed to, ``read[r]`` the last seq reader ``r``
finished with in that chunk. Flags hold sequence numbers, never booleans, so nobody clears them: a chunk is
free for message ``seq`` when every reader the previous occupant was addressed to (and that is still
admitted) has ``read[r]`` equal to the occupant's seq. ``start[r]`` is the first seq reader ``r`` may take:
the writer sets it before (re)starting that reader, so a restarted worker never runs a call meant for its
predecessor.

Memory ordering. The two processes share plain memory; CPython exposes no atomics or fences. What makes it
correct:

- Every flag is one aligned 8-byte word, written and read by a single ``memoryview`` item access (one
  ``memcpy`` of 8 bytes, compiled to one load or store): aligned 8-byte accesses are single-copy atomic on
  x86-64 and AArch64, so a flag is never seen half-written.
- Publication (writer: payload, then ``written``; reader: ``written``, then payload) and release (reader:
  last access to the payload, then ``read[r]``; writer: ``read[r]``, then new payload) each need the first
  access ordered before the second. x86-64 (TSO) never reorders store-store, load-load or load-store, so
  program order suffices there; the only reordering x86 does (a store after a later load) is not used. On
  AArch64 all of these may be reordered, so both sides put a `_Fence` between the two accesses: releasing,
  then re-acquiring, a private `threading.Lock`. With glibc, CPython's lock is a POSIX semaphore (3.11,
  3.12) or an atomic word (3.13+): release is an atomic read-modify-write with release semantics and
  acquire one with acquire semantics, and on AArch64 a release followed by an acquire is ordered (RCsc), so
  every access before the fence is ordered before every access after it. On x86-64 both are ``lock``-
  prefixed instructions, full barriers. The interpreter cannot reorder across them either: each access is
  a separate C call.
- Wake-ups go through a FIFO per reader (see `RingReader.wait`); a reader blocked in ``poll`` learns of a
  message through the kernel, whose pipe lock orders the writer's earlier stores before the reader's later
  loads on any CPU, and a reader that is spinning reads ``written`` and fences as above.

A reader that dies does not block the ring: `RingWriter.write` waits for a busy chunk only on readers that
are admitted and alive, checks their processes while it waits, and returns the dead ones so the executor
fails their calls; the executor also `exclude`s a reader as soon as its worker leaves the group.

Untrusted contents: a reader validates every length, count and sequence number it reads from the file and
rejects (`RingReadError`) what does not fit, as the socket path rejects a bad frame; it never loops on what
it reads, so garbage in the file can neither crash nor hang it.
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import os
import select
import tempfile
import threading
import time
import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import numpy as np

from iwg_worker.executor import leftovers

log = logging.getLogger(__name__)

MAGIC: Final = int.from_bytes(b"IWGRING1", "little")
VERSION: Final = 1
MAX_READERS: Final = 64  # targets is one 64-bit mask
MAX_FRAMES: Final = 4096  # as protocol.MAX_FRAMES
DEFAULT_CHUNKS: Final = 8
DEFAULT_CHUNK_BYTES: Final = 17 << 20  # a 16 MiB tensor and its header fit in one chunk
DEFAULT_SPIN_S: Final = 0.0005

# Environment of a worker that reads calls from a ring (set by MultiprocExecutor, not part of the pod wiring).
ENV_PATH: Final = "IWG_SHM_RING"
ENV_READER: Final = "IWG_SHM_RING_READER"
ENV_WAKE: Final = "IWG_SHM_RING_WAKE"
ENV_SPIN_US: Final = "IWG_SHM_RING_SPIN_US"

_ALIGN: Final = 64
# Map every page at once, so no message pays page faults the first time it passes through a chunk.
_MAP_FLAGS: Final = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
_HEADER_WORDS: Final = 5  # magic, version, n_chunks, chunk_bytes, n_readers; then start[n_readers]


def _aligned(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


class RingReadError(ValueError):
    """What a reader found in the ring is not a well-formed message; it skips it and keeps reading."""


class RingBusyError(RuntimeError):
    """The chunk the next message needs is still held by live readers after the writer's timeout."""


class _Fence:
    """A full memory barrier from Python: release, then re-acquire, a lock only this object uses.

    Not shared between threads: each writer or reader has its own and uses it from one thread at a time."""

    __slots__ = ("_lock",)

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._lock.acquire()

    def __call__(self) -> None:
        self._lock.release()
        self._lock.acquire()


@dataclass(frozen=True, slots=True)
class RingLayout:
    n_chunks: int
    chunk_bytes: int
    n_readers: int

    def __post_init__(self) -> None:
        if not 1 <= self.n_readers <= MAX_READERS:
            raise ValueError(f"a ring has 1 to {MAX_READERS} readers, got {self.n_readers}")
        if self.n_chunks < 1 or self.chunk_bytes < 4096 or self.chunk_bytes % _ALIGN:
            raise ValueError(
                f"a ring needs >= 1 chunk of >= 4096 bytes (a multiple of {_ALIGN}), "
                f"got {self.n_chunks} x {self.chunk_bytes}"
            )

    @property
    def control_offset(self) -> int:
        return _aligned((_HEADER_WORDS + self.n_readers) * 8)

    @property
    def control_words(self) -> int:
        return 2 + self.n_readers  # written, targets, read[n_readers]

    @property
    def data_offset(self) -> int:
        return _aligned(self.control_offset + self.n_chunks * self.control_words * 8)

    @property
    def size(self) -> int:
        return self.data_offset + self.n_chunks * self.chunk_bytes

    # Word indices into the file viewed as u64.
    def start_word(self, reader: int) -> int:
        return _HEADER_WORDS + reader

    def written_word(self, chunk: int) -> int:
        return self.control_offset // 8 + chunk * self.control_words

    def targets_word(self, chunk: int) -> int:
        return self.written_word(chunk) + 1

    def read_word(self, chunk: int, reader: int) -> int:
        return self.written_word(chunk) + 2 + reader

    def chunk_offset(self, chunk: int) -> int:
        return self.data_offset + chunk * self.chunk_bytes

    def frames_offset(self, n_frames: int) -> int:
        """Offset of the first frame inside a chunk: after the frame count and the lengths."""
        return _aligned(8 + 8 * n_frames)

    def message_bytes(self, lengths: Iterable[int]) -> int:
        lengths = list(lengths)
        return self.frames_offset(len(lengths)) + sum(_aligned(n) for n in lengths)


def _nbytes(frame: Any) -> int:
    return frame.nbytes if isinstance(frame, memoryview) else len(frame)


def _shm_dir() -> str:
    """``/dev/shm`` (memory) where there is one; otherwise the temporary directory."""
    return "/dev/shm" if os.access("/dev/shm", os.W_OK) else tempfile.gettempdir()


class RingWriter:
    """The executor's side: creates the ring and one wake-up FIFO per reader, writes messages."""

    def __init__(
        self,
        n_readers: int,
        wake_dir: Path,
        n_chunks: int = DEFAULT_CHUNKS,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    ) -> None:
        self.layout = layout = RingLayout(n_chunks, chunk_bytes, n_readers)
        # Mode 0600, named after this process and locked while it lives: a later executor's sweep removes it
        # if this process dies without closing it (`leftovers`).
        fd, path = leftovers.create_file(_shm_dir(), leftovers.RING_PREFIX)
        self.path = path
        self._lock_fd = fd
        try:
            # Allocate it all now: a tmpfs that is too small fails here (ENOSPC), not with SIGBUS on a write.
            os.posix_fallocate(fd, 0, layout.size)
            self._mmap = mmap.mmap(fd, layout.size, _MAP_FLAGS, mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.unlink(path)
            os.close(fd)
            raise
        self._words = memoryview(self._mmap).cast("B").cast("Q")
        self._bytes = memoryview(self._mmap)
        for i, value in enumerate((MAGIC, VERSION, n_chunks, chunk_bytes, n_readers)):
            self._words[i] = value
        self.wake_paths = [wake_dir / f"wake-{r}" for r in range(n_readers)]
        self._wake_fds = []
        for p in self.wake_paths:
            os.mkfifo(p, 0o600)
            # O_RDWR: opening never blocks and never fails for want of a reader; writes never see EPIPE.
            self._wake_fds.append(os.open(p, os.O_RDWR | os.O_NONBLOCK))
        self._fence = _Fence()
        self._written_at = [layout.written_word(c) for c in range(n_chunks)]
        self._read_at = [[layout.read_word(c, r) for r in range(n_readers)] for c in range(n_chunks)]
        self._chunk_at = [layout.chunk_offset(c) for c in range(n_chunks)]
        self._seq = 0  # last seq written
        self._occupant: list[tuple[int, int]] = [(0, 0)] * n_chunks  # (seq, targets) per chunk
        self._start = [0] * n_readers  # first seq each reader may take (0: not admitted)
        self._admitted = [False] * n_readers
        self.max_message_bytes = chunk_bytes

    # -- readers -------------------------------------------------------------------------------------

    def reader_env(self, reader: int, spin_s: float | None = None) -> dict[str, str]:
        env = {ENV_PATH: self.path, ENV_READER: str(reader), ENV_WAKE: str(self.wake_paths[reader])}
        if spin_s is not None:
            env[ENV_SPIN_US] = str(round(spin_s * 1e6))
        return env

    def admit(self, reader: int) -> None:
        """Let ``reader`` take messages from the next one written on (call before starting its process)."""
        self._start[reader] = self._seq + 1
        self._words[self.layout.start_word(reader)] = self._seq + 1
        self._admitted[reader] = True
        self._drain_wake(reader)

    def exclude(self, reader: int) -> None:
        """Stop addressing and waiting for ``reader`` (its worker left); `admit` brings it back."""
        self._admitted[reader] = False

    def admitted(self, reader: int) -> bool:
        return self._admitted[reader]

    def _drain_wake(self, reader: int) -> None:
        try:
            while os.read(self._wake_fds[reader], 65536):
                pass
        except BlockingIOError:
            pass

    # -- writing -------------------------------------------------------------------------------------

    def fits(self, frames: list[Any]) -> bool:
        if len(frames) > MAX_FRAMES:
            return False
        return self.layout.message_bytes(_nbytes(f) for f in frames) <= self.layout.chunk_bytes

    def _holders(self, chunk: int) -> list[int]:
        """Admitted readers that have not finished with the chunk's current message."""
        seq, targets = self._occupant[chunk]
        if seq == 0:
            return []
        read_at = self._read_at[chunk]
        words = self._words
        return [
            r
            for r in range(self.layout.n_readers)
            if targets >> r & 1 and self._admitted[r] and seq >= self._start[r] and words[read_at[r]] != seq
        ]

    def write(
        self,
        frames: list[Any],
        targets: Iterable[int],
        is_alive: Callable[[int], bool],
        timeout: float,
    ) -> list[int]:
        """Write one message addressed to ``targets`` and wake them; returns the readers found dead meanwhile.

        Waits for the next chunk while live readers still hold it (spinning briefly, then sleeping a little
        longer each time), checking ``is_alive`` for them every 10 ms: a dead one is excluded and returned,
        and the wait goes on for the others. Raises `RingBusyError` after ``timeout`` s. The caller makes
        sure the message `fits`."""
        seq = self._seq + 1
        chunk = (seq - 1) % self.layout.n_chunks
        dead: list[int] = []
        holders = self._holders(chunk)
        if holders:
            started = time.monotonic()
            next_check = started + 0.01
            pause = 0.0
            while holders:
                now = time.monotonic()
                if now >= next_check:
                    for r in holders:
                        if not is_alive(r):
                            self.exclude(r)
                            dead.append(r)
                    next_check = now + 0.01
                if now - started > timeout:
                    raise RingBusyError(
                        f"ring chunk {chunk} still held by reader(s) {holders} after {timeout:g} s"
                    )
                time.sleep(pause)
                pause = min(0.001, pause + 0.00005)
                holders = self._holders(chunk)
        self._fence()  # the readers' last accesses to the old message before we overwrite it
        mask = 0
        for r in targets:
            mask |= 1 << r
        base = self._chunk_at[chunk]
        words = self._words
        words[base // 8] = len(frames)
        offset = base + _aligned(8 + 8 * len(frames))
        for i, frame in enumerate(frames):
            n = _nbytes(frame)
            words[base // 8 + 1 + i] = n
            self._bytes[offset : offset + n] = frame
            offset += (n + _ALIGN - 1) // _ALIGN * _ALIGN
        written_at = self._written_at[chunk]
        words[written_at + 1] = mask  # targets
        self._fence()  # payload and targets before the written flag
        words[written_at] = seq
        self._seq = seq
        self._occupant[chunk] = (seq, mask)
        for r in targets:
            try:  # noqa: SIM105 - the hot path: contextlib.suppress costs more than the write
                os.write(self._wake_fds[r], b"\0")
            except BlockingIOError:
                pass  # the FIFO is full of wake-ups already: the reader will look
        return dead

    def close(self) -> None:
        for p in [Path(self.path), *self.wake_paths]:  # first: nothing is left behind, whatever follows
            p.unlink(missing_ok=True)
        for fd in self._wake_fds:
            os.close(fd)
        self._wake_fds = []
        if self._lock_fd >= 0:
            os.close(self._lock_fd)
            self._lock_fd = -1
        self._words.release()
        self._bytes.release()
        with contextlib.suppress(BufferError):  # a view of it still alive here: it goes with the process
            self._mmap.close()


class RingMessage:
    """One message read from the ring: its frames are read-only views into the chunk (no copy).

    All the frames are views of one numpy array over the chunk, so whatever is built on them (a tensor, a
    memoryview of a memoryview) keeps that array alive. The reader holds the chunk (the writer will not
    overwrite it) until `release` finds the array gone."""

    __slots__ = ("_base", "_reader", "chunk", "frames", "seq")

    def __init__(
        self, reader: RingReader, seq: int, chunk: int, base: weakref.ref[Any], frames: list[memoryview]
    ) -> None:
        self._reader = reader
        self._base = base
        self.seq = seq
        self.chunk = chunk
        self.frames = frames

    def release(self) -> bool:
        """Give the chunk back if nothing refers to its memory any more; False (still held) otherwise.

        Drop every object decoded from the frames first: a tensor kept past the call keeps the chunk."""
        self.frames = []
        if self._base() is not None:
            return False
        self._reader._mark_read(self.chunk, self.seq)
        return True


class RingReader:
    """A worker's side: attaches to the ring by path, takes the messages addressed to it, in order."""

    def __init__(self, path: str, reader: int, wake_path: str, spin_s: float = DEFAULT_SPIN_S) -> None:
        fd = os.open(path, os.O_RDWR)
        try:
            size = os.fstat(fd).st_size
            self._mmap = mmap.mmap(fd, size, _MAP_FLAGS, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        self._words = memoryview(self._mmap).cast("B").cast("Q")
        magic, version, n_chunks, chunk_bytes, n_readers = (self._words[i] for i in range(_HEADER_WORDS))
        if magic != MAGIC or version != VERSION:
            raise ValueError(f"{path} is not an iwg ring of version {VERSION}")
        self.layout = RingLayout(n_chunks, chunk_bytes, n_readers)
        if self.layout.size != size:
            raise ValueError(f"{path} holds {size} bytes, its header describes {self.layout.size}")
        if not 0 <= reader < n_readers:
            raise ValueError(f"reader {reader} outside [0, {n_readers})")
        self.reader = reader
        self.wake_fd = os.open(wake_path, os.O_RDWR | os.O_NONBLOCK)
        self.spin_s = spin_s
        self._fence = _Fence()
        self._n_chunks = n_chunks
        self._written_at = [self.layout.written_word(c) for c in range(n_chunks)]
        self._read_at = [self.layout.read_word(c, reader) for c in range(n_chunks)]
        self._next = max(1, self._words[self.layout.start_word(reader)])
        self._held: list[RingMessage] = []
        self.rejected = 0

    @classmethod
    def from_env(cls, environ: dict[str, str]) -> RingReader | None:
        path = environ.get(ENV_PATH)
        if not path:
            return None
        spin = environ.get(ENV_SPIN_US)
        return cls(
            path,
            int(environ[ENV_READER]),
            environ[ENV_WAKE],
            spin_s=int(spin) / 1e6 if spin else DEFAULT_SPIN_S,
        )

    def _mark_read(self, chunk: int, seq: int) -> None:
        self._fence()  # our last access to the payload before the writer may reuse the chunk
        self._words[self._read_at[chunk]] = seq

    def poll(self) -> RingMessage | None:
        """The next message addressed to this reader, if one is written; never blocks.

        Raises `RingReadError` for a malformed message (which it skips: the next call goes on after it)."""
        words = self._words
        n_chunks = self._n_chunks
        for _ in range(n_chunks + 1):  # bounded: skipping others' messages, never looping on junk
            seq = self._next
            chunk = (seq - 1) % n_chunks
            written_at = self._written_at[chunk]
            written = words[written_at]
            if written < seq:
                return None
            if written > seq:
                # Overwritten since: every message up to written - n_chunks was read by those it was for
                # (so not for us), and any later one is still in its chunk.
                self._next = max(seq + 1, written - n_chunks + 1)
                continue
            self._fence()  # the written flag before the payload
            self._next = seq + 1
            if not words[written_at + 1] >> self.reader & 1:  # targets
                continue
            base, frames = self._frames(chunk)
            if words[written_at] != seq:
                self._mark_read(chunk, seq)
                raise RingReadError(f"chunk {chunk} was overwritten while read (seq {seq})")
            return RingMessage(self, seq, chunk, weakref.ref(base), frames)
        return None

    def _frames(self, chunk: int) -> tuple[np.ndarray[Any, Any], list[memoryview]]:
        chunk_bytes = self.layout.chunk_bytes
        base = self.layout.chunk_offset(chunk)
        seq = self._next - 1
        n_frames = self._words[base // 8]
        offset = _aligned(8 + 8 * n_frames)
        if not 1 <= n_frames <= MAX_FRAMES or offset > chunk_bytes:
            self._mark_read(chunk, seq)
            raise RingReadError(f"chunk {chunk}: frame count {n_frames} out of range")
        array = np.frombuffer(self._mmap, np.uint8, chunk_bytes, base)
        array.flags.writeable = False
        view = memoryview(array)  # type: ignore[arg-type]  # numpy arrays export the buffer protocol
        frames = []
        for i, n in enumerate(self._words[base // 8 + 1 : base // 8 + 1 + n_frames].tolist()):
            if n > chunk_bytes - offset:
                self._mark_read(chunk, seq)
                raise RingReadError(f"chunk {chunk}: frame {i} of {n} bytes overruns the chunk")
            frames.append(view[offset : offset + n])
            offset += (n + _ALIGN - 1) // _ALIGN * _ALIGN
        return array, frames

    def hold(self, message: RingMessage) -> None:
        """Keep ``message``'s chunk until the views into it are gone (see `release_held`)."""
        self._held.append(message)

    def release_held(self) -> int:
        """Release held chunks whose views are gone; how many are still held."""
        if self._held:
            self._held = [m for m in self._held if not m.release()]
        return len(self._held)

    def drain_wake(self) -> None:
        # One read takes every byte there is (the writer never has 64 KiB of wake-ups outstanding for long,
        # and a byte left over only costs one extra look at the ring).
        with contextlib.suppress(BlockingIOError):
            os.read(self.wake_fd, 65536)

    def wait(self, timeout: float, also: Callable[[float], bool] | None = None) -> bool:
        """Block until the writer may have written for us (True) or ``timeout`` s pass (False).

        The writer writes a byte to our FIFO after every message for us. Draining the FIFO, then looking at
        the ring once more, then sleeping in ``poll`` loses no wake-up: a byte written after the drain
        wakes the poll; one written before it is ordered (by the pipe's lock) before our second look.
        ``also``, when given, does the sleeping instead of ``select.poll`` (it receives the timeout and
        must return when the FIFO or its own sockets are readable): the worker polls its ZMQ socket too."""
        self.drain_wake()
        seq = self._next
        if self._words[self._written_at[(seq - 1) % self._n_chunks]] >= seq:
            return True
        if also is not None:
            return also(timeout)
        poller = select.poll()
        poller.register(self.wake_fd, select.POLLIN)
        return bool(poller.poll(timeout * 1000))

    def close(self) -> None:
        os.close(self.wake_fd)
        self._held.clear()
        self._words.release()
        with contextlib.suppress(BufferError):  # a tensor still refers to the ring: it goes with the process
            self._mmap.close()
