"""The API server itself: CRD validation with CEL, PodSecurity admission, kubectl and helm against it."""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import pytest
import yaml
from kubernetes import client
from kubernetes.client import ApiClient
from kubernetes.client.exceptions import ApiException

from tests.cluster.binaries import pin
from tests.cluster.control_plane import ControlPlane, KubectlError

pytestmark = pytest.mark.cluster

CEL_MESSAGE = "minReplicas must not exceed maxReplicas"


def _crd(group: str) -> dict[str, object]:
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": f"widgets.{group}"},
        "spec": {
            "group": group,
            "scope": "Namespaced",
            "names": {"plural": "widgets", "singular": "widget", "kind": "Widget"},
            "versions": [
                {
                    "name": "v1",
                    "served": True,
                    "storage": True,
                    "schema": {
                        "openAPIV3Schema": {
                            "type": "object",
                            "properties": {
                                "spec": {
                                    "type": "object",
                                    "properties": {
                                        "minReplicas": {"type": "integer"},
                                        "maxReplicas": {"type": "integer"},
                                    },
                                    "x-kubernetes-validations": [
                                        {
                                            "rule": "self.minReplicas <= self.maxReplicas",
                                            "message": CEL_MESSAGE,
                                        }
                                    ],
                                }
                            },
                        }
                    },
                }
            ],
        },
    }


def _widget(group: str, name: str, lo: int, hi: int) -> str:
    body = {
        "apiVersion": f"{group}/v1",
        "kind": "Widget",
        "metadata": {"name": name},
        "spec": {"minReplicas": lo, "maxReplicas": hi},
    }
    return json.dumps(body)


def test_crd_cel_rule_rejects_violating_object_with_its_message(
    control_plane: ControlPlane, namespace: str
) -> None:
    group = f"{namespace}.test.iwg.dev"
    control_plane.kubectl("apply", "-f", "-", input=json.dumps(_crd(group)))
    try:
        control_plane.kubectl("wait", "--for=condition=Established", f"crd/widgets.{group}", "--timeout=30s")
        control_plane.kubectl("-n", namespace, "create", "-f", "-", input=_widget(group, "ok", 1, 3))

        with pytest.raises(KubectlError) as rejected:
            control_plane.kubectl("-n", namespace, "create", "-f", "-", input=_widget(group, "bad", 5, 2))

        assert CEL_MESSAGE in rejected.value.stderr
        assert "spec" in rejected.value.stderr  # the error names the field the rule sits on
        names = control_plane.kubectl("-n", namespace, "get", "widgets", "-o", "name").stdout.split()
        assert names == [f"widget.{group}/ok"]
    finally:
        control_plane.kubectl("delete", f"crd/widgets.{group}", "--wait=false")


def _privileged_pod(name: str) -> client.V1Pod:
    return client.V1Pod(
        metadata=client.V1ObjectMeta(name=name),
        spec=client.V1PodSpec(
            containers=[
                client.V1Container(
                    name="c",
                    image="busybox",
                    security_context=client.V1SecurityContext(privileged=True),
                )
            ]
        ),
    )


def test_restricted_namespace_rejects_privileged_pod(
    controller_manager: ControlPlane, k8s: ApiClient, namespace: str
) -> None:
    core = client.CoreV1Api(k8s)
    # The same pod passes admission in a namespace without the label, so it is PodSecurity
    # that refuses it below, not some other check.
    core.create_namespaced_pod(namespace, _privileged_pod("allowed"), dry_run="All")

    core.patch_namespace(
        namespace, {"metadata": {"labels": {"pod-security.kubernetes.io/enforce": "restricted"}}}
    )
    # PodSecurity reads namespaces from an informer cache: wait until it has seen the label.
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            core.create_namespaced_pod(namespace, _privileged_pod("probe"), dry_run="All")
        except ApiException:
            break
        time.sleep(0.1)
    with pytest.raises(ApiException) as rejected:
        core.create_namespaced_pod(namespace, _privileged_pod("refused"))

    assert rejected.value.status == 403
    message = json.loads(rejected.value.body or "{}")["message"]
    assert 'violates PodSecurity "restricted:latest"' in message
    assert 'privileged (container "c" must not set securityContext.privileged=true)' in message


def test_kubectl_talks_to_the_server_without_version_skew(control_plane: ControlPlane) -> None:
    done = control_plane.kubectl("version", "-o", "json")
    versions = json.loads(done.stdout)
    assert versions["serverVersion"]["gitVersion"] == "v1.37.2"
    assert versions["serverVersion"]["minor"] == "37"
    assert "skew" not in done.stderr.lower()
    assert (
        control_plane.kubectl("auth", "can-i", "create", "pods", "--all-namespaces").stdout.strip() == "yes"
    )


def _tiny_chart(root: Path) -> Path:
    chart = root / "tiny"
    (chart / "templates").mkdir(parents=True)
    (chart / "Chart.yaml").write_text("apiVersion: v2\nname: tiny\nversion: 0.1.0\n")
    (chart / "values.yaml").write_text("greeting: hello\n")
    (chart / "templates" / "configmap.yaml").write_text(
        "apiVersion: v1\nkind: ConfigMap\nmetadata:\n  name: {{ .Release.Name }}-cm\n"
        "data:\n  greeting: {{ .Values.greeting | quote }}\n"
    )
    return chart


def test_helm_version_template_and_install(
    control_plane: ControlPlane, k8s: ApiClient, namespace: str, tmp_path: Path
) -> None:
    helm = str(control_plane.bin("helm"))
    env = {
        **control_plane.env(),
        "HELM_CACHE_HOME": str(tmp_path / "cache"),
        "HELM_CONFIG_HOME": str(tmp_path),
    }

    def run(*args: str) -> str:
        return subprocess.run([helm, *args], env=env, check=True, capture_output=True, text=True).stdout

    assert run("version", "--short").startswith(pin("HELM_VERSION"))
    chart = _tiny_chart(tmp_path)
    # --validate checks the rendered objects against the live API server's schema.
    rendered = run("template", "rel", str(chart), "-n", namespace, "--set", "greeting=hi", "--validate")
    assert yaml.safe_load(rendered)["data"] == {"greeting": "hi"}

    run("install", "rel", str(chart), "-n", namespace, "--set", "greeting=installed", "--wait")
    cm = client.CoreV1Api(k8s).read_namespaced_config_map("rel-cm", namespace)
    assert cm.data == {"greeting": "installed"}
