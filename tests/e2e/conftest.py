"""End-to-end fixtures: the real operator (KopfRunner) on the real control plane, with the node agent running
the group's pods as real processes. The CRD and group helpers are the operator tests' own."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest
from kopf.testing import KopfRunner
from kubernetes import client
from kubernetes.client import ApiClient
from kubernetes.client.exceptions import ApiException

from tests.iwg_operator.conftest import Groups, iwg_crd
from tests.nodeagent.fixture import NodeAgentProcess

__all__ = ["Groups", "e2e_operator", "iwg_crd", "workspace"]

AUTOSCALE_INTERVAL_S = "1"


@pytest.fixture
def workspace(node_agent: NodeAgentProcess, namespace: str, k8s: ApiClient) -> Iterator[str]:
    """The test's namespace; at the end its pods are killed at once, so the next test starts on a quiet machine."""
    yield namespace
    core = client.CoreV1Api(k8s)
    apps = client.AppsV1Api(k8s)
    for deployment in apps.list_namespaced_deployment(namespace).items:  # or its ReplicaSet brings pods back
        apps.delete_namespaced_deployment(
            deployment.metadata.name, namespace, propagation_policy="Foreground"
        )
    for pod in core.list_namespaced_pod(namespace).items:
        try:
            core.delete_namespaced_pod(pod.metadata.name, namespace, grace_period_seconds=0)
        except ApiException as error:
            if error.status != 404:  # a pod that was terminating may be gone since the list
                raise
    deadline = time.monotonic() + 30
    while core.list_namespaced_pod(namespace).items and time.monotonic() < deadline:
        time.sleep(0.2)


@pytest.fixture
def e2e_operator(
    iwg_crd: dict[str, Any],
    control_plane: Any,
    workspace: str,
    monkeypatch: pytest.MonkeyPatch,
) -> Iterator[KopfRunner]:
    """The real operator handling the test's namespace, its autoscaler looking every second."""
    monkeypatch.setenv("KUBECONFIG", str(control_plane.kubeconfig))
    monkeypatch.setenv("IWG_AUTOSCALE_INTERVAL_S", AUTOSCALE_INTERVAL_S)
    args = ["run", "--standalone", "--namespace", workspace, "-m", "iwg_operator.handlers"]
    with KopfRunner(args, timeout=60) as runner:
        time.sleep(1.0)
        yield runner
    assert runner.exception is None, runner.output[-4000:]
    assert "Traceback" not in runner.output, runner.output[-4000:]
