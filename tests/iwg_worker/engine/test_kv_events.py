"""vLLM's KV cache events turned into the driver's block hashes (engine.kv_events): the tracker's bookkeeping,
and the subscriber reading what vLLM's own publisher sends."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from iwg_worker.engine.kv_events import KvBlockTracker, KvEventSubscriber

pytestmark = pytest.mark.timeout(120)

DRIVER_A = [101, 102, 103, 104]  # the driver's hashes of request a's prompt
DRIVER_B = [101, 102, 203]  # request b shares a's first two blocks of text


def tracker_with_two_requests() -> KvBlockTracker:
    t = KvBlockTracker(max_blocks=64)
    t.expect("a", DRIVER_A)
    t.expect("b", DRIVER_B)
    t.stored("a", [b"a0", b"a1"], None)  # a's prefill, in two steps
    t.stored("a", [b"a2", b"a3"], b"a1")
    t.stored("b", [b"b2"], b"a1")  # b found a's first two blocks cached and stored its third
    return t


def held(t: KvBlockTracker) -> set[int]:
    return set(t.report(None, 0)["stored"])


def test_blocks_are_tagged_with_the_driver_hashes_at_their_positions() -> None:
    t = tracker_with_two_requests()
    first = t.report(None, 0)
    assert first["reset"] and set(first["stored"]) == {101, 102, 103, 104, 203}
    assert t.report(first["epoch"], first["seq"]) == {
        "epoch": first["epoch"],
        "seq": first["seq"],
        "reset": False,
        "stored": [],
        "removed": [],
    }
    t.removed([b"a3", b"a2"])  # vLLM evicts a request's last blocks first
    later = t.report(first["epoch"], first["seq"])
    assert not later["reset"] and later["stored"] == [] and sorted(later["removed"]) == [103, 104]
    assert held(t) == {101, 102, 203}


def test_a_driver_hash_is_evicted_with_the_last_block_that_holds_it() -> None:
    t = KvBlockTracker(max_blocks=64)
    t.expect("a", [7, 8])
    t.expect("c", [7, 9])
    t.stored("a", [b"x0", b"x1"], None)
    t.stored(
        "c", [b"y0", b"y1"], None
    )  # the same text, other tokens at its first block: another engine block
    start = t.report(None, 0)
    t.removed([b"x0"])
    assert t.report(start["epoch"], start["seq"])["removed"] == []  # y0 still holds hash 7
    t.removed([b"y0"])
    assert t.report(start["epoch"], start["seq"])["removed"] == [7]


def test_a_block_whose_parent_was_never_seen_has_no_position() -> None:
    t = KvBlockTracker(max_blocks=64)
    t.expect("a", DRIVER_A)
    t.stored("a", [b"a2"], b"a1")  # a1's event came before this tracker began
    assert held(t) == set()


def test_a_clear_a_new_tracker_an_old_sequence_and_an_overflow_each_reset_the_view() -> None:
    t = tracker_with_two_requests()
    r = t.report(None, 0)
    t.cleared()
    after = t.report(r["epoch"], r["seq"])
    assert after["reset"] and after["stored"] == []
    assert t.report(r["epoch"] + 1, after["seq"])["reset"]  # another epoch: an engine restarted

    small = KvBlockTracker(max_blocks=64, log_entries=4)
    small.expect("a", DRIVER_A)
    small.stored("a", [b"a0", b"a1", b"a2", b"a3"], None)
    epoch = small.report(None, 0)["epoch"]
    small.removed([b"a3", b"a2", b"a1"])  # seven changes: the first three fell out of a log of four
    behind = small.report(epoch, 0)
    assert behind["reset"] and behind["stored"] == [101] and behind["removed"] == []

    full = KvBlockTracker(max_blocks=3)
    full.expect("a", DRIVER_A)
    full.stored("a", [b"a0", b"a1", b"a2", b"a3"], None)  # more than the cache holds: removals were missed
    assert full.size() == (0, 0) and full.report(None, 0)["stored"] == []


def wait_for(condition: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def test_the_subscriber_reads_what_vllms_own_publisher_sends(tmp_path: Path) -> None:
    from vllm.distributed.kv_events import BlockRemoved, BlockStored, KVEventBatch, ZmqEventPublisher

    endpoint = f"ipc://{tmp_path}/kv-events"
    publisher = ZmqEventPublisher(0, endpoint=endpoint)
    tracker = KvBlockTracker(max_blocks=64)
    subscriber = KvEventSubscriber(endpoint, tracker)
    try:
        tracker.expect("req-1", [11, 12])

        def stored(session: str, hashes: list[Any], parent: Any) -> BlockStored:
            return BlockStored(
                block_hashes=hashes,
                parent_block_hash=parent,
                token_ids=list(range(16 * len(hashes))),
                block_size=16,
                lora_id=None,
                medium="CPU",
                lora_name=None,
                session_id=session,
            )

        # PUB drops what is sent before the subscription is in place: send until it arrives.
        deadline = time.monotonic() + 10
        while not tracker.size()[0]:
            assert time.monotonic() < deadline, "no event arrived"
            publisher.publish(KVEventBatch(ts=time.time(), events=[stored("req-1", [b"h0", b"h1"], None)]))
            time.sleep(0.1)
        start = tracker.report(None, 0)
        assert sorted(start["stored"]) == [11, 12]
        publisher.publish(
            KVEventBatch(ts=time.time(), events=[BlockRemoved(block_hashes=[b"h1"], medium="CPU")])
        )
        wait_for(lambda: tracker.report(start["epoch"], start["seq"])["removed"] == [12])
    finally:
        subscriber.close()
        publisher.shutdown()


def test_a_gap_in_the_batches_resets_the_view(tmp_path: Path) -> None:
    import msgspec
    import zmq
    from vllm.distributed.kv_events import BlockStored, KVEventBatch

    endpoint = f"ipc://{tmp_path}/kv-events"
    pub = zmq.Context.instance().socket(zmq.PUB)
    pub.bind(endpoint)
    tracker = KvBlockTracker(max_blocks=64)
    subscriber = KvEventSubscriber(endpoint, tracker)
    encode = msgspec.msgpack.Encoder().encode

    def send(seq: int, hashes: list[bytes], parent: bytes | None) -> None:
        event = BlockStored(
            block_hashes=hashes,
            parent_block_hash=parent,
            token_ids=[1] * 16 * len(hashes),
            block_size=16,
            lora_id=None,
            medium="CPU",
            lora_name=None,
            session_id="r",
        )
        pub.send_multipart((b"", seq.to_bytes(8, "big"), encode(KVEventBatch(ts=0.0, events=[event]))))

    try:
        tracker.expect("r", [1, 2, 3])
        deadline = time.monotonic() + 10
        while not tracker.size()[0]:
            assert time.monotonic() < deadline, "no event arrived"
            send(0, [b"r0"], None)  # the first that arrives sets the sequence; repeats of 0 are gaps too
            time.sleep(0.1)
        wait_for(lambda: tracker.size()[0] == 1)
        send(5, [b"r1"], b"r0")  # batches 1 to 4 never came: r0 may be gone, so r1 has no position either
        wait_for(lambda: tracker.report(None, 0)["reset"] and tracker.size() == (0, 0))
    finally:
        subscriber.close()
        pub.close(linger=0)


def test_a_requests_prefix_blocks_are_checked_like_its_other_fields() -> None:
    from iwg_worker.engine.requests import ModelLimits, RequestRejected, parse_request

    limits = ModelLimits(context_length=64, vocab_size=100)
    base = {"id": "r", "prompt_ids": [1, 2, 3, 4]}
    assert parse_request({**base, "prefix_blocks": [0, (1 << 64) - 1]}, limits, None).prefix_blocks == (
        0,
        (1 << 64) - 1,
    )
    assert parse_request(base, limits, None).prefix_blocks == ()
    for bad in ([-1], [1 << 64], ["1"], [1.0], [True], [1, 2, 3, 4, 5], "12"):
        with pytest.raises(RequestRejected) as refused:
            parse_request({**base, "prefix_blocks": bad}, limits, None)
        assert refused.value.as_dict()["param"] == "prefix_blocks", bad
