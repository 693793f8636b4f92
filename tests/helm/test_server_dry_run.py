"""Every value set's rendered manifests are accepted by the real API server (server-side dry run, strict
field validation), and the operator's pod template passes the `restricted` Pod Security level; so do the
objects the operator builds for the example groups."""

from __future__ import annotations

import contextlib

import pytest
import yaml
from kubernetes import client
from kubernetes.client import ApiClient
from kubernetes.client.exceptions import ApiException

from tests.cluster.control_plane import ControlPlane
from tests.helm import chart
from tests.helm.test_kube_score import EXAMPLE_GROUPS, group_objects

pytestmark = pytest.mark.cluster

# A stand-in for prometheus-operator's CRD, so that the ServiceMonitor kind exists on the test cluster.
SERVICE_MONITOR_CRD = {
    "apiVersion": "apiextensions.k8s.io/v1",
    "kind": "CustomResourceDefinition",
    "metadata": {"name": "servicemonitors.monitoring.coreos.com"},
    "spec": {
        "group": "monitoring.coreos.com",
        "scope": "Namespaced",
        "names": {"plural": "servicemonitors", "singular": "servicemonitor", "kind": "ServiceMonitor"},
        "versions": [
            {
                "name": "v1",
                "served": True,
                "storage": True,
                "schema": {
                    "openAPIV3Schema": {
                        "type": "object",
                        "properties": {
                            "spec": {"type": "object", "x-kubernetes-preserve-unknown-fields": True}
                        },
                    }
                },
            }
        ],
    },
}


def _ensure_namespace(core: client.CoreV1Api, name: str) -> None:
    with contextlib.suppress(ApiException):
        core.create_namespace(client.V1Namespace(metadata=client.V1ObjectMeta(name=name)))


@pytest.fixture(scope="module")
def prerequisites(control_plane: ControlPlane, k8s: ApiClient) -> None:
    """What the value sets expect to exist: their watched namespaces and the ServiceMonitor kind."""
    core = client.CoreV1Api(k8s)
    for value_set in chart.VALUE_SETS:
        for doc in chart.render(value_set):
            if doc["kind"] == "Role":
                _ensure_namespace(core, doc["metadata"]["namespace"])
    with contextlib.suppress(ApiException):
        client.ApiextensionsV1Api(k8s).create_custom_resource_definition(SERVICE_MONITOR_CRD)
    control_plane.kubectl(
        "wait", "--for=condition=Established", "crd/servicemonitors.monitoring.coreos.com", "--timeout=30s"
    )


@pytest.mark.parametrize("value_set", chart.VALUE_SETS, ids=str)
def test_the_api_server_accepts_the_rendered_chart(
    value_set: str | None, prerequisites: None, control_plane: ControlPlane, k8s: ApiClient, namespace: str
) -> None:
    core = client.CoreV1Api(k8s)
    restricted = {f"pod-security.kubernetes.io/{mode}": "restricted" for mode in ("enforce", "warn")}
    core.patch_namespace(namespace, {"metadata": {"labels": restricted}})
    manifests = chart.template(value_set, "--include-crds", namespace=namespace)
    docs = chart.documents(manifests)
    # No --namespace: every namespaced object must name its own (Roles live in the watched namespaces).
    done = control_plane.kubectl("apply", "--dry-run=server", "--validate=strict", "-f", "-", input=manifests)
    accepted = [line for line in done.stdout.splitlines() if line.endswith("(server dry run)")]
    assert len(accepted) == len(docs), done.stdout
    # Workload templates are checked against the namespace's level with a warning (pods are enforced).
    assert "PodSecurity" not in done.stderr, done.stderr


@pytest.mark.parametrize("example", sorted(EXAMPLE_GROUPS), ids=str)
def test_the_api_server_accepts_what_the_operator_builds_for_the_example_groups(
    example: str, controller_manager: ControlPlane, k8s: ApiClient, namespace: str
) -> None:
    """The objects kube-score is run on (tests/helm/test_kube_score.py), in a `restricted` namespace (pods
    need its `default` ServiceAccount, which the controller manager creates)."""
    control_plane = controller_manager
    core = client.CoreV1Api(k8s)
    restricted = {f"pod-security.kubernetes.io/{mode}": "restricted" for mode in ("enforce", "warn")}
    core.patch_namespace(namespace, {"metadata": {"labels": restricted}})
    body = EXAMPLE_GROUPS[example]()
    body["metadata"]["namespace"] = namespace
    docs = group_objects(body)
    done = control_plane.kubectl(
        "apply", "--dry-run=server", "--validate=strict", "-f", "-", input=yaml.safe_dump_all(docs)
    )
    accepted = [line for line in done.stdout.splitlines() if line.endswith("(server dry run)")]
    assert len(accepted) == len(docs), done.stdout
    assert "PodSecurity" not in done.stderr and "Warning" not in done.stderr, done.stderr
