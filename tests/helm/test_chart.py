"""The chart without a cluster: lint, rendering per value set, least-privilege RBAC, values schema."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

from tests.cluster import binaries
from tests.helm import chart
from tests.helm.chart import CHART, ROOT, VALUE_SETS, one, render


def test_the_chart_installs_the_generated_crd() -> None:
    generated = ROOT / "crds" / "inference.iwg.dev_inferenceworkergroups.yaml"
    copies = list((CHART / "crds").iterdir())
    assert [p.name for p in copies] == [generated.name]
    assert copies[0].read_bytes() == generated.read_bytes(), "chart CRD differs from crds/: run `make crds`"


@pytest.mark.parametrize("value_set", VALUE_SETS, ids=str)
def test_lint_strict_is_clean(value_set: str | None) -> None:
    done = chart.helm(
        "lint", "--strict", str(CHART), "--kube-version", chart.KUBE_VERSION, *chart.values_args(value_set)
    )
    assert "0 chart(s) failed" in done.stdout
    assert not re.search(r"\[(WARNING|ERROR)\]", done.stdout + done.stderr), done.stdout


def test_there_are_at_least_three_other_value_sets() -> None:
    assert len(VALUE_SETS) >= 4


def _container(docs: list[dict[str, Any]]) -> dict[str, Any]:
    pod = one(docs, "Deployment")["spec"]["template"]["spec"]
    assert len(pod["containers"]) == 1
    container: dict[str, Any] = pod["containers"][0]
    return container


def _flag(args: list[str], name: str) -> list[str]:
    return [a.split("=", 1)[1] for a in args if a.startswith(f"--{name}=")]


def test_default_values_run_one_restricted_operator_cluster_wide() -> None:
    docs = render()
    deployment = one(docs, "Deployment")
    # Two replicas, one leading: a rolling update starts a standby before it stops a replica.
    assert deployment["spec"]["replicas"] == 2
    assert deployment["spec"]["strategy"] == {
        "type": "RollingUpdate",
        "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0},
    }
    pod = deployment["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == one(docs, "ServiceAccount")["metadata"]["name"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    container = _container(docs)
    security = container["securityContext"]
    assert security["allowPrivilegeEscalation"] is False
    assert security["readOnlyRootFilesystem"] is True
    assert security["capabilities"] == {"drop": ["ALL"]}
    tmp_volumes = [v["name"] for v in pod["volumes"] if "emptyDir" in v]
    assert {m["mountPath"] for m in container["volumeMounts"] if m["name"] in tmp_volumes} == {"/tmp"}
    assert container["resources"]["requests"] and container["resources"]["limits"]
    args = container["args"]
    assert "--all-namespaces" in args and not _flag(args, "namespace")
    assert "--leader-elect" in args
    assert _flag(args, "leader-elect-lease-name") == [deployment["metadata"]["name"]]
    # The replicas prefer different nodes; a drain evicts one at a time.
    selector = deployment["spec"]["selector"]["matchLabels"]
    anti = pod["affinity"]["podAntiAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"]
    assert [t["podAffinityTerm"] for t in anti] == [
        {"topologyKey": "kubernetes.io/hostname", "labelSelector": {"matchLabels": selector}}
    ]
    pdb = one(docs, "PodDisruptionBudget")
    assert pdb["spec"] == {"maxUnavailable": 1, "selector": {"matchLabels": selector}}
    # The Lease: created in the release's namespace, then read and renewed by its name only.
    role = one(docs, "Role")
    assert role["metadata"]["namespace"] == deployment["metadata"]["namespace"]
    assert role["rules"] == [
        {"apiGroups": ["coordination.k8s.io"], "resources": ["leases"], "verbs": ["create"]},
        {
            "apiGroups": ["coordination.k8s.io"],
            "resources": ["leases"],
            "resourceNames": [deployment["metadata"]["name"]],
            "verbs": ["get", "update"],
        },
    ]
    assert one(docs, "RoleBinding")["roleRef"]["name"] == role["metadata"]["name"]
    # The probe calls the port Kopf's liveness endpoint listens on; the metrics port is the flag's.
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert container["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "health"}
    assert _flag(args, "liveness") == [f"http://0.0.0.0:{ports['health']}/healthz"]
    assert _flag(args, "metrics-port") == [str(ports["metrics"])]
    service = one(docs, "Service")
    assert service["spec"]["ports"][0]["targetPort"] == "metrics"
    assert service["spec"]["selector"].items() <= container_labels(docs).items()
    assert {d["kind"] for d in docs} == {
        "ServiceAccount",
        "ClusterRole",
        "ClusterRoleBinding",
        "Role",
        "RoleBinding",
        "Deployment",
        "Service",
        "NetworkPolicy",
        "PodDisruptionBudget",
    }


def container_labels(docs: list[dict[str, Any]]) -> dict[str, str]:
    labels: dict[str, str] = one(docs, "Deployment")["spec"]["template"]["metadata"]["labels"]
    return labels


@pytest.mark.parametrize("value_set", VALUE_SETS, ids=str)
def test_every_object_carries_the_standard_labels(value_set: str | None) -> None:
    for doc in render(value_set):
        labels = doc["metadata"]["labels"]
        for key in ("name", "instance", "version", "component", "part-of", "managed-by"):
            assert labels.get(f"app.kubernetes.io/{key}"), f"{doc['kind']} lacks app.kubernetes.io/{key}"
        # The groups' NetworkPolicies admit the operator's pods by this label (iwg_operator.labels).
        assert labels["app.kubernetes.io/name"] == "iwg-operator"


@pytest.mark.parametrize("value_set", VALUE_SETS, ids=str)
def test_rbac_has_no_wildcards(value_set: str | None) -> None:
    granted = list(chart.rules(render(value_set)))
    assert granted
    for rule in granted:
        assert "*" not in "".join(rule), rule


def test_watch_namespaces_grant_roles_there_and_run_kopf_on_them() -> None:
    cluster_wide = render()
    docs = render("namespaced.yaml")
    namespaces = ["iwg-team-a", "iwg-team-b"]
    args = _container(docs)["args"]
    assert _flag(args, "namespace") == namespaces and "--all-namespaces" not in args
    election = one(cluster_wide, "Role")["metadata"]["name"]  # the Lease's, in the release namespace
    roles = {
        d["metadata"]["namespace"] for d in docs if d["kind"] == "Role" and d["metadata"]["name"] != election
    }
    bindings = {
        d["metadata"]["namespace"]: d
        for d in docs
        if d["kind"] == "RoleBinding" and d["metadata"]["name"] != election
    }
    assert roles == set(bindings) == set(namespaces)
    sa = one(docs, "ServiceAccount")["metadata"]
    for binding in bindings.values():
        assert binding["subjects"] == [
            {"kind": "ServiceAccount", "name": sa["name"], "namespace": sa["namespace"]}
        ]
    # Per namespace: what the cluster-wide install grants everywhere, and nothing cluster-wide.
    assert not chart.of_kind(docs, "ClusterRole") and not chart.of_kind(docs, "ClusterRoleBinding")
    wide = {r[1:] for r in chart.rules(cluster_wide) if r[0] == "cluster"}
    granted = list(chart.rules(docs))
    for namespace in namespaces:
        assert {r[1:] for r in granted if r[0] == namespace} == wide


def test_custom_values_reach_the_deployment() -> None:
    docs = render("custom.yaml")
    assert not chart.of_kind(docs, "ServiceAccount"), "serviceAccount.create=false must not create one"
    assert not chart.of_kind(docs, "NetworkPolicy") and not chart.of_kind(docs, "Service")
    deployment = one(docs, "Deployment")
    assert deployment["metadata"]["name"] == "inference-operator"
    assert deployment["spec"]["replicas"] == 0
    pod = deployment["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == "platform-iwg-operator"
    binding = one(docs, "ClusterRoleBinding")
    assert binding["subjects"][0]["name"] == "platform-iwg-operator"
    container = _container(docs)
    assert container["image"].startswith("registry.example.com/ml/iwg-operator@sha256:")
    assert _flag(container["args"], "log-level") == ["warning"]
    assert not _flag(container["args"], "metrics-port")
    assert _flag(container["args"], "liveness") == ["http://0.0.0.0:8081/healthz"]
    assert pod["priorityClassName"] == "system-cluster-critical"
    assert {"name": "IWG_EXTRA", "value": "1"} in container["env"]


def test_monitoring_values_create_a_service_monitor_for_the_metrics_service() -> None:
    docs = render("monitoring.yaml")
    monitor = one(docs, "ServiceMonitor")
    service = one(docs, "Service")
    assert monitor["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    assert monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    assert monitor["spec"]["endpoints"][0]["port"] == service["spec"]["ports"][0]["name"]
    assert service["spec"]["ports"][0]["port"] == 9100
    policy = one(docs, "NetworkPolicy")["spec"]
    assert policy["ingress"] == [
        {
            "ports": [{"port": "metrics", "protocol": "TCP"}],
            "from": [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}],
        }
    ]


BAD_VALUES = [
    # (helm --set argument, what the schema's message must say)
    ("--set-string=replicas=1", "at '/replicas': got string, want integer"),
    ("--set=replicas=-1", "at '/replicas': minimum: got -1, want 0"),
    ("--set=logLevel=verbose", "at '/logLevel': value must be one of 'debug', 'info', 'warning', 'error'"),
    ("--set=metrics.port=80", "at '/metrics/port': minimum: got 80, want 1,024"),
    ("--set=watchNamespaces[0]=Team_A", "at '/watchNamespaces/0'"),
    ("--set=image.pullPolicy=Sometimes", "at '/image/pullPolicy'"),
    ("--set=replica=1", "additional properties 'replica' not allowed"),
]


@pytest.mark.parametrize(("argument", "message"), BAD_VALUES, ids=[b[0] for b in BAD_VALUES])
def test_bad_values_fail_with_the_schema_message(argument: str, message: str) -> None:
    done = chart.helm(
        "template", "iwg", str(CHART), "--kube-version", chart.KUBE_VERSION, argument, check=False
    )
    assert done.returncode != 0
    assert "values don't meet the specifications of the schema" in done.stderr
    assert message in done.stderr, done.stderr


def test_the_values_file_documents_every_key() -> None:
    """Each key of values.yaml has a comment above it (or above its parent block)."""
    lines = (CHART / "values.yaml").read_text().splitlines()
    undocumented = []
    for index, line in enumerate(lines):
        if not re.match(r"^\s*[A-Za-z][\w.-]*:", line):
            continue
        previous = lines[index - 1].strip() if index else ""
        opens_block = line.rstrip().endswith(":")
        if not previous.startswith("#") and not opens_block:
            undocumented.append(line.strip())
    assert not undocumented, f"values.yaml keys without a comment: {undocumented}"


def test_helm_is_the_pinned_approved_version_and_assumes_the_pinned_kubernetes(tmp_path: Path) -> None:
    assert chart.helm("version", "--template", "{{ .Version }}").stdout == binaries.pin("HELM_VERSION")
    assert binaries.pin("HELM_VERSION") != "v3.22.0", (
        "helm v3.22.0 is served by the package mirror but not approved"
    )
    # Without --kube-version helm assumes its default version, set at link time to the pinned cluster's
    # (unset it is v1.20, which the chart's kubeVersion refuses).
    rendered = chart.documents(chart.helm("template", "iwg", str(CHART), "--namespace", "iwg-system").stdout)
    assert one(rendered, "Deployment")["metadata"]["name"] == "iwg-iwg-operator"
    probe = tmp_path / "probe"
    (probe / "templates").mkdir(parents=True)
    (probe / "Chart.yaml").write_text("apiVersion: v2\nname: probe\nversion: 0.1.0\n")
    (probe / "templates" / "version.yaml").write_text("kube: {{ .Capabilities.KubeVersion.Version }}\n")
    assumed = chart.documents(chart.helm("template", "probe", str(probe)).stdout)[0]["kube"]
    major, minor = binaries.pin("KUBERNETES_VERSION").split(".")[:2]
    assert assumed == f"{major}.{minor}.0"
