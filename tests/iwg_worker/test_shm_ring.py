"""The shared-memory ring under MultiprocExecutor: the ring itself (writer and readers in this process,
fuzzed contents), the reply FIFO beside it, then real worker processes reading the ring and writing the
FIFO (a killed reader, restarts, idle readers)."""

from __future__ import annotations

import os
import pickle
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import psutil
import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from iwg_worker import protocol
from iwg_worker.executor import ReplicaLostError
from iwg_worker.executor.multiproc import MultiprocExecutor
from iwg_worker.executor.multiproc import _make_ring as make_ring
from iwg_worker.executor.reply_pipe import MAX_MESSAGE_BYTES, ReplyPipeReader, ReplyPipeWriter
from iwg_worker.executor.shm_ring import (
    RingBusyError,
    RingMessage,
    RingReader,
    RingReadError,
    RingWriter,
)
from iwg_worker.executor.shm_ring import _shm_dir as shm_dir
from iwg_worker.worker_base import WorkerConfig

from .test_executors import _health_port, _metric

EXT = "tests.iwg_worker.extensions.RingProbeExtension"
# A ring write waits up to the heartbeat timeout (3 heartbeats) for a chunk: 6 s, past a 2-3 s stall of a
# loaded CI machine, which must not end a write in RingBusyError or count a live worker gone.
HEARTBEAT_S = 2.0
CHUNK = 256 << 10


def alive(_reader: int) -> bool:
    return True


@pytest.fixture
def ring(tmp_path: Path) -> Iterator[tuple[RingWriter, list[RingReader]]]:
    writer = RingWriter(3, tmp_path, n_chunks=4, chunk_bytes=CHUNK)
    readers = []
    for r in range(3):
        writer.admit(r)
        readers.append(RingReader(writer.path, r, str(writer.wake_paths[r]), spin_s=0))
    yield writer, readers
    for reader in readers:
        reader.close()
    writer.close()


def take(reader: RingReader) -> RingMessage:
    message = reader.poll()
    assert message is not None
    return message


def test_one_write_reaches_each_addressed_reader_as_a_view_of_the_ring(
    ring: tuple[RingWriter, list[RingReader]],
) -> None:
    writer, readers = ring
    tensor = torch.arange(20_000, dtype=torch.float32)  # 80 KB: a frame of its own, not inline
    array = np.arange(5_000, dtype=np.int64)
    writer.write(protocol.encode_call(7, "m", (tensor, array)), [0, 2], alive, timeout=1)
    for reader in (readers[0], readers[2]):
        message = take(reader)
        call = protocol.decode(message.frames)
        assert isinstance(call, protocol.Call) and call.id == 7
        got = call.args[0]
        assert torch.equal(got, tensor)
        # No copy: the tensor's memory is inside this reader's mapping of the ring, and read-only.
        mapping = np.frombuffer(reader._mmap, np.uint8)
        start = mapping.ctypes.data
        assert start <= got.data_ptr() < start + mapping.nbytes
        assert np.array_equal(call.args[1], array)
        assert not call.args[
            1
        ].flags.writeable  # workers get read-only views: one reader cannot touch another's
        del call, got, mapping
        assert message.release()
    assert readers[1].poll() is None  # not addressed to reader 1


def test_a_kept_tensor_holds_its_chunk_until_dropped(ring: tuple[RingWriter, list[RingReader]]) -> None:
    writer, readers = ring
    big = torch.ones(CHUNK // 8, dtype=torch.uint8)
    writer.write(protocol.encode_call(1, "m", (big,)), [0], alive, timeout=1)
    message = take(readers[0])
    kept = protocol.decode(message.frames).args[0]  # type: ignore[union-attr]
    assert not message.release()
    readers[0].hold(message)
    for i in range(2, 5):  # the other chunks
        writer.write(protocol.encode_ping(i), [1], alive, timeout=1)
    with pytest.raises(RingBusyError, match=r"held by reader\(s\) \[0\]"):
        writer.write(protocol.encode_ping(5.0), [1], alive, timeout=0.2)
    assert int(kept.sum()) == CHUNK // 8  # still intact
    del kept
    assert readers[0].release_held() == 0
    writer.write(protocol.encode_ping(5.0), [1], alive, timeout=0.2)


def test_a_dead_reader_does_not_block_the_writer(ring: tuple[RingWriter, list[RingReader]]) -> None:
    writer, readers = ring
    writer.write(protocol.encode_ping(0.0), [0, 1], alive, timeout=1)
    take(readers[0]).release()  # reader 1 never reads: it "died" holding chunk 0
    for i in range(3):
        writer.write(protocol.encode_ping(i), [0], alive, timeout=1)
        take(readers[0]).release()
    with pytest.raises(RingBusyError):
        writer.write(protocol.encode_ping(9.0), [0], alive, timeout=0.1)
    dead = writer.write(protocol.encode_ping(9.0), [0], lambda r: r != 1, timeout=1)
    assert dead == [1]
    assert not writer.admitted(1)
    assert isinstance(protocol.decode(take(readers[0]).frames), protocol.Ping)


def test_a_readmitted_reader_skips_what_was_written_for_its_predecessor(
    ring: tuple[RingWriter, list[RingReader]],
) -> None:
    writer, _readers = ring
    writer.write(protocol.encode_call(1, "old", ()), [1], alive, timeout=1)
    writer.exclude(1)
    writer.admit(1)
    successor = RingReader(writer.path, 1, str(writer.wake_paths[1]), spin_s=0)
    try:
        assert successor.poll() is None
        writer.write(protocol.encode_call(2, "new", ()), [1], alive, timeout=1)
        call = protocol.decode(take(successor).frames)
        assert isinstance(call, protocol.Call) and call.method == "new"
    finally:
        successor.close()


def test_a_reader_falls_asleep_and_is_woken_by_the_writer(ring: tuple[RingWriter, list[RingReader]]) -> None:
    writer, readers = ring
    started = time.monotonic()
    assert not readers[0].wait(0.2)  # nothing written: sleeps the whole timeout
    assert time.monotonic() - started >= 0.19
    writer.write(protocol.encode_ping(1.0), [0], alive, timeout=1)
    started = time.monotonic()
    assert readers[0].wait(5)
    assert time.monotonic() - started < 2
    assert readers[1].poll() is None  # not addressed: skipped,
    assert not readers[1].wait(0.05)  # and not woken


words = st.integers(min_value=0, max_value=2**64 - 1)
small_or_any = st.one_of(st.integers(min_value=0, max_value=8), words)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    written=st.lists(small_or_any, min_size=4, max_size=4),
    targets=st.lists(small_or_any, min_size=4, max_size=4),
    frame_words=st.lists(st.tuples(st.integers(min_value=0, max_value=3), small_or_any), max_size=6),
    writes=st.lists(
        st.tuples(st.integers(min_value=0, max_value=4 * 8192 - 512), st.binary(min_size=1, max_size=512)),
        max_size=8,
    ),
)
@example(written=[2**64 - 1] * 4, targets=[1] * 4, frame_words=[], writes=[])  # far ahead everywhere
@example(written=[1, 2, 3, 4], targets=[1] * 4, frame_words=[(0, 2**64 - 1)], writes=[])  # frame count
@example(written=[1, 2, 3, 4], targets=[1] * 4, frame_words=[(0, 3), (2, 2**63)], writes=[])  # length
def test_fuzzed_ring_contents_never_crash_or_hang_a_reader(
    tmp_path: Path,
    written: list[int],
    targets: list[int],
    frame_words: list[tuple[int, int]],
    writes: list[tuple[int, bytes]],
) -> None:
    root = tmp_path / f"r{time.monotonic_ns()}"
    root.mkdir()
    writer = RingWriter(2, root, n_chunks=4, chunk_bytes=8192)
    writer.admit(0)
    reader = RingReader(writer.path, 0, str(writer.wake_paths[0]), spin_s=0)
    try:
        writer.write(protocol.encode_call(1, "m", (np.arange(1000, dtype=np.int32),)), [0], alive, timeout=1)
        layout = writer.layout
        # Junk in the written flags, the target masks, chunk 0's frame count and lengths, and the bytes.
        for chunk in range(layout.n_chunks):
            writer._words[layout.written_word(chunk)] = written[chunk]
            writer._words[layout.targets_word(chunk)] = targets[chunk]
        for index, value in frame_words:
            writer._words[layout.chunk_offset(0) // 8 + index] = value
        for offset, data in writes:
            start = layout.data_offset + offset
            writer._bytes[start : start + len(data)] = data
        started = time.monotonic()
        outcomes = []
        for _ in range(2 * layout.n_chunks):
            try:
                message = reader.poll()
            except RingReadError:
                outcomes.append("rejected")
                continue
            if message is None:
                outcomes.append("nothing")
                continue
            try:
                protocol.decode(message.frames)
                outcomes.append("message")
            except protocol.ProtocolError:
                outcomes.append("rejected")
            message.release()
        reader.wait(0.001)  # returns, whatever the FIFO and the flags say
        assert time.monotonic() - started < 5, outcomes
    finally:
        reader.close()
        writer.close()


def test_a_ring_that_cannot_be_had_leaves_the_calls_on_the_sockets(tmp_path: Path) -> None:
    before = set(Path(shm_dir()).iterdir())
    with pytest.raises(OSError):
        RingWriter(1, tmp_path, n_chunks=1, chunk_bytes=1 << 50)  # more than any /dev/shm holds
    assert set(Path(shm_dir()).iterdir()) == before  # nothing left behind
    assert make_ring(1, tmp_path, 1, 1 << 50) is None
    assert make_ring(65, tmp_path, 1, 4096) is None  # more readers than a mask has bits
    ring = make_ring(64, tmp_path, 1, 4096)
    assert ring is not None
    ring.close()


# -- the reply FIFO ------------------------------------------------------------------------------------------


def test_reply_fifo_records_from_several_writers_arrive_whole_in_each_writers_order(tmp_path: Path) -> None:
    reader = ReplyPipeReader(tmp_path)
    writers = [ReplyPipeWriter(reader.path) for _ in range(3)]
    try:
        sent = {
            w: [bytes([w]) * (1 + (w * 997 + i * 131) % MAX_MESSAGE_BYTES) for i in range(40)]
            for w in range(3)
        }
        got: list[bytes] = []
        for i in range(40):
            for w, writer in enumerate(writers):
                assert writer.send(sent[w][i])
            got += reader.read()  # 120 KiB in all: more than a FIFO holds, so read as it goes
        while len(got) < 120:
            more = reader.read()
            assert more
            got += more
        for w in range(3):
            assert [m for m in got if m[0] == w] == sent[w]
        assert reader.received == 120
        assert reader.rejected == 0
    finally:
        for writer in writers:
            writer.close()
        reader.close()


def test_reply_fifo_refuses_what_it_cannot_write_whole(tmp_path: Path) -> None:
    reader = ReplyPipeReader(tmp_path)
    writer = ReplyPipeWriter(reader.path)
    try:
        assert not writer.send(b"x" * (MAX_MESSAGE_BYTES + 1))  # more than one atomic write
        assert reader.read() == []
        record = b"y" * 1000
        written = 0
        while writer.send(record):  # until the FIFO is full: the write fails whole, nothing torn
            written += 1
        got: list[bytes] = []
        while more := reader.read():
            got += more
        assert got == [record] * written
    finally:
        writer.close()
        reader.close()


@settings(max_examples=200, deadline=None)
@given(chunks=st.lists(st.binary(min_size=1, max_size=6000), min_size=1, max_size=6))
@example(chunks=[b"\xff\xff\xff\xff" + b"x" * 10])  # a length past the limit
@example(chunks=[b"\x00\x00\x00\x00"])  # a zero length
@example(chunks=[b"\x10\x00\x00\x00abc"])  # a record cut short: kept for the next read
def test_fuzzed_reply_fifo_contents_never_crash_or_hang_the_reader(chunks: list[bytes]) -> None:
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        reader = ReplyPipeReader(Path(tmp))
        fd = os.open(reader.path, os.O_WRONLY | os.O_NONBLOCK)
        try:
            started = time.monotonic()
            for chunk in chunks:
                os.write(fd, chunk)  # raw bytes, not the writer's framing
                for message in reader.read():
                    assert 0 < len(message) <= MAX_MESSAGE_BYTES
                    with pytest.raises(protocol.ProtocolError):
                        protocol.decode([message])
            while reader.read():
                pass
            assert time.monotonic() - started < 5
        finally:
            os.close(fd)
            reader.close()


# -- real workers --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def group() -> Iterator[MultiprocExecutor]:
    """Two one-rank replicas of ``task: none`` workers on a ring of 2 small chunks, so it wraps quickly."""
    executor = MultiprocExecutor(
        WorkerConfig(task="none", device="cpu", group="ring"),
        replicas=2,
        worker_extension_cls=EXT,
        heartbeat_interval_s=HEARTBEAT_S,
        startup_timeout_s=300,
        ring_chunks=2,
        ring_chunk_bytes=CHUNK,
        restart_backoff_s=0.5,
        # Also how long a replica must run for its next failure to start a new series: far longer than a
        # restart and wait_until_serving take on a loaded CI machine (test_restarts_back_off).
        restart_backoff_max_s=300,
    )
    assert executor.uses_shm_ring
    yield executor
    executor.shutdown()


def cpu_seconds(pid: int) -> float:
    times = psutil.Process(pid).cpu_times()
    return float(times.user + times.system)


def test_idle_workers_sleep_instead_of_spinning(group: MultiprocExecutor) -> None:
    group.collective_rpc("record", (0,), timeout=30)  # each worker just read the ring, then idles
    time.sleep(0.5)
    pids = [wp.process.pid for wp in group.processes]
    before = [cpu_seconds(pid) for pid in pids]
    time.sleep(2.0)
    used = [cpu_seconds(pid) - b for pid, b in zip(pids, before, strict=True)]
    # A worker polling the ring would use most of a core (at least a fifth of one on a loaded machine);
    # one asleep on its FIFO wakes 10 times a second and to send its heartbeats.
    assert all(u < 0.1 for u in used), used


def test_malformed_messages_in_the_ring_are_rejected_counted_and_the_worker_keeps_serving(
    group: MultiprocExecutor,
) -> None:
    port = _health_port(group, 0)  # type: ignore[arg-type]
    before = _metric(port, "iwg_worker_rejected_messages_total")
    junk = [
        [b"junk"],
        [pickle.dumps({"kind": "call", "method": "record"})],
        [*protocol.encode_ping(1.0)[:1], b"extra frame"],
    ]
    ring = group._ring
    assert ring is not None
    for frames in junk:
        with group._send_lock:
            ring.write(frames, [0], alive, timeout=5)
    assert group.collective_rpc("record", (5,), timeout=30, replica=0)[0][-1] == 5
    assert _metric(port, "iwg_worker_rejected_messages_total") - before == len(junk)
    assert "rejected a malformed message" in group.worker_process(0, 0).log_path.read_text()


def test_small_replies_come_through_the_fifo_and_large_ones_over_the_socket(group: MultiprocExecutor) -> None:
    pipe = group._reply_pipe
    assert pipe is not None
    before = pipe.received
    for _ in range(2):
        result = group.collective_rpc("echo", (torch.arange(8),), timeout=30)
        assert [r[0][0].tolist() for r in result] == [list(range(8))] * 2
    assert pipe.received - before == 4  # one reply from each of the two workers, twice
    # A reply with a 64 KiB tensor has a frame of its own: the socket; small and large ones overtake
    # each other freely and every call gets its own.
    big = torch.full((64 << 10,), 7, dtype=torch.uint8)
    before = pipe.received
    futures = [
        group.collective_rpc_future("echo", (big if i % 2 else i,), timeout=60, replica=0) for i in range(6)
    ]
    results = [f.result(60)[0][0] for f in futures]
    assert [int(r[0]) if i % 2 else r for i, r in enumerate(results)] == [0, 7, 2, 7, 4, 7]
    assert pipe.received - before == 3


def test_calls_too_large_for_a_chunk_go_on_the_socket_in_their_place(group: MultiprocExecutor) -> None:
    big = 1 << 20  # 4x a chunk
    futures = []
    for i in range(1, 7):
        value: Any = torch.full((big,), i, dtype=torch.uint8) if i % 2 else i
        futures.append(group.collective_rpc_future("record", (value,), timeout=60, replica=0))
    logs = [f.result(60)[0] for f in futures]
    assert logs[-1][-6:] == [1, 2, 3, 4, 5, 6]


def test_sigkilled_worker_mid_read_fails_its_calls_the_other_keeps_serving_and_it_comes_back(
    group: MultiprocExecutor,
) -> None:
    group.wait_until_serving(timeout=60)
    victim = group.worker_process(1, 0).process
    tensor = torch.ones(64 << 10, dtype=torch.uint8)  # a view into the ring while the call runs
    pending = group.collective_rpc_future("hold", (tensor, 30.0), timeout=60, replica=1)
    time.sleep(0.5)
    victim.kill()
    killed_at = time.monotonic()
    # The process exit (the executor's tick) or the lost connection (a ping), whichever is seen first.
    with pytest.raises(ReplicaLostError, match=r"'hold' failed: replica 1 lost ranks \[0\]"):
        pending.result(timeout=30)
    assert time.monotonic() - killed_at < group.heartbeat_timeout_s
    # The ring wraps many times past the chunk the dead worker held.
    for _i in range(20):
        assert group.collective_rpc("hold", (tensor, 0.0), timeout=10, replica=0) == [16]
    group.wait_until_serving([1], timeout=120)
    assert group.restarts(1) >= 1
    assert group.worker_process(1, 0).process.pid != victim.pid
    assert group.collective_rpc("hold", (tensor, 0.0), timeout=30, replica=1) == [16]


def test_a_worker_that_stops_heartbeating_is_killed_and_comes_back(group: MultiprocExecutor) -> None:
    group.wait_until_serving(timeout=120)
    stopped = group.worker_process(1, 0).process
    stopped.send_signal(signal.SIGSTOP)  # alive, but silent
    try:
        deadline = time.monotonic() + 120
        while group.worker_process(1, 0).process is stopped:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert stopped.wait(timeout=10) == -signal.SIGKILL
    finally:
        if stopped.poll() is None:
            stopped.kill()
    group.wait_until_serving([1], timeout=120)
    assert group.collective_rpc("record", (3,), timeout=30, replica=1)[0][-1] == 3


def test_restarts_back_off(group: MultiprocExecutor) -> None:
    group.wait_until_serving(timeout=120)
    delays = []
    for _ in range(2):
        old = group.worker_process(0, 0).process
        old.kill()
        killed_at = time.monotonic()
        while group.worker_process(0, 0).process is old:
            time.sleep(0.01)
        delays.append(time.monotonic() - killed_at)
        group.wait_until_serving([0], timeout=120)
    # Each failure in a row doubles the wait: 0.5 s, then 1 s (the replica ran far less than the 300 s cap).
    assert delays[0] >= 0.5
    assert delays[1] >= 1.0, delays
    assert group.collective_rpc("record", (1,), timeout=30, replica=0)[0][-1] == 1


def test_a_replica_of_two_ranks_restarts_whole() -> None:
    executor = MultiprocExecutor(
        WorkerConfig(task="none", device="cpu", group="ring2"),
        replicas=1,
        world_size=2,
        worker_extension_cls=EXT,
        heartbeat_interval_s=HEARTBEAT_S,
        startup_timeout_s=300,
        restart_backoff_s=0.2,
    )
    try:
        old = [executor.worker_process(0, k).process for k in range(2)]
        old[1].kill()
        # Its peer goes too (a torch.distributed group cannot take a new member), and both come back.
        assert old[0].wait(timeout=30) == -signal.SIGKILL
        deadline = time.monotonic() + 120
        while any(executor.worker_process(0, k).process is old[k] for k in range(2)):
            assert time.monotonic() < deadline
            time.sleep(0.05)
        executor.wait_until_serving(timeout=120)
        assert executor.restarts(0) == 1
        assert executor.collective_rpc("record", (7,), timeout=30) == [[7], [7]]
    finally:
        executor.shutdown()
