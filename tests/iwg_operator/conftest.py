"""Fixtures for the operator's control-plane tests: the CRD installed, the operator running (KopfRunner)."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest
import yaml
from iwg_operator import crdgen
from iwg_operator.api import v1alpha1 as api
from kopf.testing import KopfRunner
from kubernetes import client
from kubernetes.client import ApiClient
from kubernetes.client.exceptions import ApiException

from tests.cluster.waiting import eventually

ROOT = Path(__file__).resolve().parents[2]
T = TypeVar("T")


class Groups:
    """InferenceWorkerGroups and their pods in one namespace, through the real API server."""

    def __init__(self, k8s: ApiClient, namespace: str) -> None:
        self.namespace = namespace
        self.custom = client.CustomObjectsApi(k8s)
        self.core = client.CoreV1Api(k8s)

    def manifest(self, name: str, **spec: Any) -> dict[str, Any]:
        return {
            "apiVersion": api.API_VERSION,
            "kind": api.KIND,
            "metadata": {"name": name, "namespace": self.namespace},
            "spec": {"model": {"task": "embed", "path": "/models/m"}, **spec},
        }

    def create(self, name: str, **spec: Any) -> dict[str, Any]:
        body: dict[str, Any] = self.custom.create_namespaced_custom_object(
            api.GROUP, api.VERSION, self.namespace, api.PLURAL, self.manifest(name, **spec)
        )
        return body

    def get(self, name: str) -> dict[str, Any]:
        body: dict[str, Any] = self.custom.get_namespaced_custom_object(
            api.GROUP, api.VERSION, self.namespace, api.PLURAL, name
        )
        return body

    def patch(self, name: str, spec: dict[str, Any]) -> None:
        self.custom.patch_namespaced_custom_object(
            api.GROUP, api.VERSION, self.namespace, api.PLURAL, name, {"spec": spec}
        )

    def delete(self, name: str) -> None:
        try:
            self.custom.delete_namespaced_custom_object(
                api.GROUP, api.VERSION, self.namespace, api.PLURAL, name, propagation_policy="Background"
            )
        except ApiException as error:
            if error.status != 404:
                raise

    def pods(self, name: str) -> list[Any]:
        selector = f"inference.iwg.dev/group={name},app.kubernetes.io/component=worker"
        return list(self.core.list_namespaced_pod(self.namespace, label_selector=selector).items)

    def live_pods(self, name: str) -> list[Any]:
        return [p for p in self.pods(name) if p.metadata.deletion_timestamp is None]

    def condition(self, name: str, kind: str) -> dict[str, Any] | None:
        for item in (self.get(name).get("status") or {}).get("conditions") or []:
            if item["type"] == kind:
                return dict(item)
        return None

    def events(self, name: str) -> list[Any]:
        selector = f"involvedObject.name={name},involvedObject.kind={api.KIND}"
        return list(self.core.list_namespaced_event(self.namespace, field_selector=selector).items)


def install_crd(control_plane: Any) -> dict[str, Any]:
    """The generated CRD, installed and Established."""
    manifest = yaml.safe_load(crdgen.render_crd())
    control_plane.kubectl("apply", "--server-side", "-f", "-", input=yaml.safe_dump(manifest))
    # `kubectl wait` fails instead of waiting while the new CRD has no conditions yet: poll.
    extensions = client.ApiextensionsV1Api(control_plane.api_client())
    eventually(
        lambda: any(
            c.type == "Established" and c.status == "True"
            for c in extensions.read_custom_resource_definition(
                manifest["metadata"]["name"]
            ).status.conditions
            or []
        ),
        timeout=60,
        what="the CRD Established",
    )
    return manifest


@contextlib.contextmanager
def running_operator(
    control_plane: Any, namespace: str, monkeypatch: pytest.MonkeyPatch
) -> Iterator[KopfRunner]:
    """The real operator (Kopf in a thread) handling one namespace of a control plane."""
    monkeypatch.setenv("KUBECONFIG", str(control_plane.kubeconfig))
    args = ["run", "--standalone", "--namespace", namespace, "-m", "iwg_operator.handlers"]
    with KopfRunner(args, timeout=60) as runner:
        time.sleep(1.0)  # Kopf lists and starts watching
        yield runner
    assert runner.exception is None, runner.output[-4000:]
    assert runner.exit_code == 0, runner.output[-4000:]
    assert "Traceback" not in runner.output, runner.output[-4000:]


@pytest.fixture(scope="session")
def iwg_crd(control_plane: Any) -> dict[str, Any]:
    return install_crd(control_plane)


@pytest.fixture
def groups(controller_manager: Any, k8s: ApiClient, namespace: str) -> Groups:
    """Groups in a fresh namespace (the controller manager first: pods need the default ServiceAccount)."""
    return Groups(k8s, namespace)


@pytest.fixture
def operator(
    iwg_crd: dict[str, Any], control_plane: Any, namespace: str, monkeypatch: pytest.MonkeyPatch
) -> Iterator[KopfRunner]:
    """The real operator (Kopf in a thread) handling the test's namespace."""
    with running_operator(control_plane, namespace, monkeypatch) as runner:
        yield runner
