"""What a test run killed before its teardown leaves of real nodes (cgroups with containers in them) is
swept by the next start."""

from __future__ import annotations

import os
import subprocess

import pytest

from tests.realnodes import nodes


def test_the_cgroups_of_a_dead_owner_are_emptied_and_removed_and_a_live_owners_kept() -> None:
    if os.geteuid() != 0:
        pytest.skip("cgroups need root; CI runs as root")
    gone = subprocess.Popen(["true"])
    gone.wait()  # its pid now names an owner that is gone
    stale, live = f"iwg-{gone.pid}-abc123-realnode-0", f"iwg-{os.getpid()}-abc123-realnode-0"
    container = subprocess.Popen(["sleep", "600"])
    try:
        for name in (stale, live):
            nodes._make_cgroups(name)
            (nodes.CGROUP_ROOT / "pids" / name / "child").mkdir()
        (nodes.CGROUP_ROOT / "pids" / stale / "child" / "cgroup.procs").write_text(str(container.pid))

        assert nodes.sweep_stale() == [stale]
        assert container.wait(timeout=10) == -9
        assert not any((h / stale).exists() for h in nodes._hierarchies())
        assert all((h / live).is_dir() for h in nodes._hierarchies())
    finally:
        container.kill()
        nodes._remove_cgroups(stale)
        nodes._remove_cgroups(live)
