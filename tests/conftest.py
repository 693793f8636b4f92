"""Shared test configuration: the real control-plane fixtures (see tests/cluster/fixtures.py) and the lanes
`make test` runs side by side (tests/lanes.py)."""

import pytest

from tests import lanes
from tests.cluster.fixtures import (
    control_plane,
    controller_manager,
    gang_control_plane,
    gang_k8s,
    gang_namespace,
    gpu_nodes,
    k8s,
    namespace,
    pytest_terminal_summary,
    scheduler,
)

__all__ = [
    "control_plane",
    "controller_manager",
    "gang_control_plane",
    "gang_k8s",
    "gang_namespace",
    "gpu_nodes",
    "k8s",
    "namespace",
    "pytest_terminal_summary",
    "scheduler",
]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    lanes.select(config, items)
