"""Session fixtures for the real control plane; tests/conftest.py re-exports them.

`control_plane` (etcd + kube-apiserver) starts on first use; `scheduler`, `controller_manager` and
`gpu_nodes` each add their component to that same control plane on first use.
"""

from __future__ import annotations

import contextlib
import re
import secrets
import time
from collections.abc import Iterator

import pytest
from kubernetes import client
from kubernetes.client import ApiClient
from kubernetes.client.exceptions import ApiException

from tests.cluster.control_plane import ControlPlane

_started: list[ControlPlane] = []


@pytest.fixture(scope="session")
def control_plane() -> Iterator[ControlPlane]:
    cp = ControlPlane().start()
    _started.append(cp)
    try:
        yield cp
    finally:
        cp.stop()


@pytest.fixture(scope="session")
def gang_control_plane() -> Iterator[ControlPlane]:
    """A second control plane with gang placement on (feature gate GenericWorkload, scheduling.k8s.io/v1beta1
    served), with its scheduler, controller manager and kwok; tests add their own GPU nodes
    (`start_gpu_nodes(prefix=..., labels=...)`). The default fixtures stay without it."""
    cp = ControlPlane.with_gang_scheduling(name="iwg-gang").start()
    _started.append(cp)
    try:
        cp.start_scheduler()
        cp.start_controller_manager()
        cp.start_gpu_nodes(count=0)
        yield cp
    finally:
        cp.stop()


@pytest.fixture(scope="session")
def gang_k8s(gang_control_plane: ControlPlane) -> Iterator[ApiClient]:
    api = gang_control_plane.api_client()
    try:
        yield api
    finally:
        api.close()  # type: ignore[no-untyped-call]


@pytest.fixture
def gang_namespace(
    request: pytest.FixtureRequest, gang_control_plane: ControlPlane, gang_k8s: ApiClient
) -> Iterator[str]:
    """A fresh namespace on the gang control plane (its default ServiceAccount exists)."""
    with fresh_namespace(request, gang_control_plane, gang_k8s) as name:
        yield name


@pytest.fixture(scope="session")
def scheduler(control_plane: ControlPlane) -> ControlPlane:
    control_plane.start_scheduler()
    return control_plane


@pytest.fixture(scope="session")
def controller_manager(control_plane: ControlPlane) -> ControlPlane:
    control_plane.start_controller_manager()
    return control_plane


@pytest.fixture(scope="session")
def gpu_nodes(control_plane: ControlPlane) -> list[str]:
    return control_plane.start_gpu_nodes()


@pytest.fixture(scope="session")
def k8s(control_plane: ControlPlane) -> Iterator[ApiClient]:
    api = control_plane.api_client()
    try:
        yield api
    finally:
        api.close()  # type: ignore[no-untyped-call]


@pytest.fixture
def namespace(request: pytest.FixtureRequest, control_plane: ControlPlane, k8s: ApiClient) -> Iterator[str]:
    """A fresh namespace; deleted afterwards without waiting for its finalization.

    Pods need the namespace's `default` ServiceAccount; it is waited for when the
    controller manager runs (ask for `controller_manager` before `namespace`).
    """
    with fresh_namespace(request, control_plane, k8s) as name:
        yield name


@contextlib.contextmanager
def fresh_namespace(
    request: pytest.FixtureRequest, control_plane: ControlPlane, k8s: ApiClient
) -> Iterator[str]:
    core = client.CoreV1Api(k8s)
    stem = re.sub(r"[^a-z0-9]+", "-", request.node.name.lower()).strip("-")[:40].strip("-")
    name = f"t-{stem}-{secrets.token_hex(3)}"
    core.create_namespace(client.V1Namespace(metadata=client.V1ObjectMeta(name=name)))
    if control_plane.running("kube-controller-manager"):
        _wait_for_default_service_account(core, name)
    try:
        yield name
    finally:
        core.delete_namespace(name, propagation_policy="Background")


def _wait_for_default_service_account(core: client.CoreV1Api, namespace: str, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            core.read_namespaced_service_account("default", namespace)
            return
        except ApiException as exc:
            if exc.status != 404 or time.monotonic() > deadline:
                raise
        time.sleep(0.1)


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    for cp in _started:
        figures = ", ".join(f"{name} {secs:.1f}s" for name, secs in cp.startup_seconds.items())
        terminalreporter.write_line(f"control plane start times: {figures}")
