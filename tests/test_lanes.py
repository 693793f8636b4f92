"""The lanes `make test` runs side by side: every test file lands in one, by its marker and path; a lane that
does not exist is refused by name."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests import lanes


@pytest.mark.parametrize(
    ("path", "cluster", "lane"),
    [
        ("realnodes/test_drain_sharded.py", True, "e2e"),
        ("realnodes/test_vllm_engine.py", True, "e2e"),
        ("realnodes/test_real_nodes.py", True, "cluster"),
        (
            "realnodes/test_autoscaling.py",
            True,
            "e2e",
        ),  # a real-node cluster of its own, beside the cluster lane's
        ("iwg_operator/test_quiet_cluster.py", True, "cluster"),
        ("iwg_worker/driver/test_driver_streams.py", False, "engine"),
        ("iwg_worker/driver/test_driver_restart.py", False, "engine"),
        ("iwg_worker/engine/test_engine.py", False, "engine"),
        ("realnodes/test_sweep.py", False, "worker"),
        ("iwg_operator/test_builders.py", False, "worker"),
    ],
)
def test_a_test_file_goes_to_the_lane_of_its_marker_and_path(path: str, cluster: bool, lane: str) -> None:
    assert lanes.lane_of(lanes.ROOT / "tests" / path, cluster) == lane


def test_every_test_file_has_a_lane_whatever_its_marker() -> None:
    files = sorted((lanes.ROOT / "tests").rglob("test_*.py"))
    assert len(files) > 50
    for path in files:
        for cluster in (True, False):
            assert lanes.lane_of(path, cluster) in lanes.LANES


def test_an_unknown_lane_is_refused_by_name() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "--collect-only", "tests/test_lanes.py"],
        cwd=lanes.ROOT,
        env={**_env_without_lane(), "IWG_TEST_LANE": "gpu"},
        capture_output=True,
        text=True,
    )
    assert done.returncode != 0
    assert "IWG_TEST_LANE='gpu'" in done.stdout + done.stderr


def test_a_lane_collects_its_own_tests_only() -> None:
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "--collect-only",
            "tests/test_lanes.py",
            "tests/iwg_worker/engine/test_streams.py",
        ],
        cwd=lanes.ROOT,
        env={**_env_without_lane(), "IWG_TEST_LANE": "engine"},
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    collected = [line for line in done.stdout.splitlines() if "::" in line]
    assert collected and all(
        line.startswith("tests/iwg_worker/engine/test_streams.py::") for line in collected
    )
    assert "deselected" in done.stdout


def _env_without_lane() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k != lanes.LANE_ENV}
