"""The prober's restart budget as kept in status.recentRestarts: what an operator restart reads back."""

from __future__ import annotations

import time

from iwg_operator.health.prober import MAX_RECENT_RESTARTS, GroupProber, restarts_from_status


def test_recent_restarts_round_trip_through_the_status_and_leave_it_with_the_window() -> None:
    now = time.monotonic()
    prober = GroupProber(restart_count=3, restarts=[(now - 7200, 0), (now - 60, 1), (now - 5, 1)])
    written = prober.recent_restarts(3600)
    assert [e["replica"] for e in written] == [1, 1], "the one older than the window is gone"
    assert all(e["time"].endswith("Z") for e in written)
    assert prober.group_restarts == sorted(prober.group_restarts) and len(prober.group_restarts) == 2

    restored = GroupProber(restarts=restarts_from_status(written))
    assert sorted(restored.replica_restarts) == [1]
    ages = sorted(time.monotonic() - t for t in restored.group_restarts)
    assert 4 <= ages[0] <= 7 and 59 <= ages[1] <= 62, ages  # to the second: RFC 3339 without fractions
    assert restored.recent_restarts(3600) == written


def test_at_most_the_newest_entries_are_kept_and_garbage_is_skipped() -> None:
    now = time.monotonic()
    prober = GroupProber(restarts=[(now - i, i % 3) for i in range(MAX_RECENT_RESTARTS + 50)])
    assert len(prober.recent_restarts(3600)) == MAX_RECENT_RESTARTS
    assert restarts_from_status([{"time": "yesterday", "replica": 0}, {"replica": 1}, "x", None]) == []
    assert restarts_from_status(None) == [] and restarts_from_status({"time": 1}) == []
