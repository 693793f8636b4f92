"""`helm install` into the real control plane, then the operator run with the chart's own ServiceAccount.

The operator runs as a process (its console script, with the exact arguments of the installed Deployment)
and a token of the chart's ServiceAccount from the TokenRequest API. It talks to the API server through a
recording proxy, so every request it makes, Kopf's watches included, is known with its RBAC attributes
and status code: the run must see no 403, and the chart must grant no rule the run did not use.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import pytest
import yaml
from iwg_operator import metrics
from kubernetes import client
from kubernetes.client import ApiClient
from kubernetes.client.exceptions import ApiException
from prometheus_client.parser import text_string_to_metric_families

from tests.cluster.control_plane import ControlPlane, free_port
from tests.cluster.waiting import eventually
from tests.helm import chart
from tests.helm.apiproxy import RecordingProxy, Request, rules_used

pytestmark = pytest.mark.cluster

CRD_NAME = "inferenceworkergroups.inference.iwg.dev"
GPU_TOLERATION = {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}
T = TypeVar("T")


@dataclass
class Release:
    name: str
    namespace: str
    manifest: list[dict[str, Any]]
    health_port: int
    metrics_port: int

    def objects(self, kind: str) -> list[dict[str, Any]]:
        return chart.of_kind(self.manifest, kind)


def _install(control_plane: ControlPlane, namespace: str, *values: str) -> Release:
    health_port, metrics_port = free_port(), free_port()
    name = "iwg"
    chart.helm(
        "install", name, str(chart.CHART), "--namespace", namespace,
        "--set", f"healthPort={health_port}", "--set", f"metrics.port={metrics_port}", *values,
        env=control_plane.env(),
    )  # fmt: skip
    manifest = chart.documents(
        chart.helm("get", "manifest", name, "--namespace", namespace, env=control_plane.env()).stdout
    )
    return Release(name, namespace, manifest, health_port, metrics_port)


def _exists(control_plane: ControlPlane, doc: dict[str, Any]) -> bool:
    namespace = doc["metadata"].get("namespace")
    args = ["get", doc["kind"].lower(), doc["metadata"]["name"], "--ignore-not-found", "-o", "name"]
    done = control_plane.kubectl(*args, *(["-n", namespace] if namespace else []))
    return bool(done.stdout.strip())


class OperatorProcess:
    """`iwg-operator` started exactly as the chart's Deployment starts it, outside the cluster."""

    def __init__(self, release: Release, kubeconfig: Path, log: Path) -> None:
        deployment = release.objects("Deployment")[0]
        container = deployment["spec"]["template"]["spec"]["containers"][0]
        self.command = [str(Path(sys.executable).parent / container["command"][0]), *container["args"]]
        env = {**os.environ, "KUBECONFIG": str(kubeconfig)}
        for var in container["env"]:
            if "value" in var:
                env[var["name"]] = var["value"]
        env["IWG_OPERATOR_NAMESPACE"] = release.namespace  # the Deployment's fieldRef
        env["IWG_OPERATOR_POD_NAME"] = "iwg-operator-test"
        env.pop("TMPDIR", None)
        self.log = log
        with log.open("wb") as out:
            self.popen = subprocess.Popen(
                self.command, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True
            )

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def healthy(self, port: int) -> bool:
        assert self.popen.poll() is None, f"the operator exited:\n{self.output()[-4000:]}"
        url = f"http://127.0.0.1:{port}/healthz"
        with contextlib.suppress(OSError), urllib.request.urlopen(url, timeout=2) as response:
            return bool(response.status == 200)
        return False

    def stop(self) -> int:
        if self.popen.poll() is None:
            os.killpg(self.popen.pid, signal.SIGTERM)
            try:
                self.popen.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(self.popen.pid, signal.SIGKILL)
                self.popen.wait(timeout=10)
        return self.popen.returncode


def _service_account_kubeconfig(
    control_plane: ControlPlane, release: Release, server: str, path: Path
) -> Path:
    sa = release.objects("ServiceAccount")[0]["metadata"]["name"]
    # TokenRequest API: a short-lived, audience-bound token of the chart's ServiceAccount.
    token = control_plane.kubectl(
        "create", "token", sa, "-n", release.namespace, "--duration=1h"
    ).stdout.strip()
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "proxy", "cluster": {"server": server}}],
        "users": [{"name": sa, "user": {"token": token}}],
        "contexts": [
            {"name": "sa", "context": {"cluster": "proxy", "user": sa, "namespace": release.namespace}}
        ],
        "current-context": "sa",
    }
    path.write_text(yaml.safe_dump(config))
    path.chmod(0o600)
    return path


def _scrape(port: int) -> dict[str, list[tuple[dict[str, str], float]]]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        text = response.read().decode()
    families: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(text):
        families[family.name] = [(s.labels, s.value) for s in family.samples]
    return families


def _total(samples: list[tuple[dict[str, str], float]], **labels: str) -> float:
    return sum(v for lbl, v in samples if all(lbl.get(k) == val for k, val in labels.items()))


class Workload:
    """The example group in its own namespace, driven through kubectl like a user would."""

    def __init__(
        self, control_plane: ControlPlane, k8s: ApiClient, namespace: str, world_size: int = 1
    ) -> None:
        self.cp = control_plane
        self.ns = namespace
        self.core = client.CoreV1Api(k8s)
        self.custom = client.CustomObjectsApi(k8s)
        example = yaml.safe_load((chart.ROOT / "examples" / "minilm.yaml").read_text())
        # The simulated nodes are GPU nodes with the usual taint; the CPU example tolerates it to land there.
        example["spec"].setdefault("scheduling", {})["tolerations"] = [GPU_TOLERATION]
        # The autoscaler runs too (it holds: the simulated driver serves no metrics), with the same RBAC.
        example["spec"]["autoscaling"]["enabled"] = True
        example["spec"]["worldSize"] = self.world_size = world_size  # more than 1: gang placement by default
        self.name = example["metadata"]["name"]
        self.example = example

    def apply(self) -> None:
        self.cp.kubectl("apply", "-n", self.ns, "-f", "-", input=yaml.safe_dump(self.example))

    def patch(self, spec: dict[str, Any]) -> None:
        self.cp.kubectl(
            "patch", "-n", self.ns, f"iwg/{self.name}", "--type=merge", "-p", json.dumps({"spec": spec})
        )

    def group(self) -> dict[str, Any]:
        body: dict[str, Any] = self.custom.get_namespaced_custom_object(
            "inference.iwg.dev", "v1alpha1", self.ns, "inferenceworkergroups", self.name
        )
        return body

    def pods(self) -> list[Any]:
        selector = f"inference.iwg.dev/group={self.name},app.kubernetes.io/component=worker"
        items = self.core.list_namespaced_pod(self.ns, label_selector=selector).items
        return [p for p in items if p.metadata.deletion_timestamp is None]

    def running(self, replicas: int, image: str | None = None) -> bool:
        group = self.group()
        status = group.get("status") or {}
        pods = self.pods()
        return (
            # Of the spec as last changed: a status from before it can say Running while its pods go.
            status.get("observedGeneration") == group["metadata"]["generation"]
            and status.get("phase") == "Running"
            and status.get("readyReplicas") == replicas
            and len(pods) == replicas * self.world_size
            and (image is None or all(p.spec.containers[0].image == image for p in pods))
        )

    CHILD_KINDS = "services,configmaps,deployments,networkpolicies,poddisruptionbudgets"
    SPEC_HASH = "inference.iwg.dev/spec-hash"

    def tamper_with_children(self) -> None:
        selector = f"inference.iwg.dev/group={self.name}"
        self.cp.kubectl(
            "annotate",
            "-n",
            self.ns,
            self.CHILD_KINDS,
            "-l",
            selector,
            f"{self.SPEC_HASH}=edited",
            "--overwrite",
        )

    def children_repaired(self) -> bool:
        selector = f"inference.iwg.dev/group={self.name}"
        items = json.loads(
            self.cp.kubectl("get", "-n", self.ns, self.CHILD_KINDS, "-l", selector, "-o", "json").stdout
        )["items"]
        hashes = [(i["metadata"].get("annotations") or {}).get(self.SPEC_HASH) for i in items]
        # Three Services (workers', driver's, drivers' headless), the ConfigMap, the driver's Deployment, two
        # NetworkPolicies, two PDBs (workers', drivers').
        return len(items) == 9 and all(h and h != "edited" for h in hashes)

    def secret_data(self) -> dict[str, str]:
        return dict(self.core.read_namespaced_secret(f"{self.name}-curve", self.ns).data or {})

    def gone(self) -> bool:
        try:
            self.group()
        except ApiException as error:
            return error.status == 404
        return False


def _run_operator_through_a_scenario(
    control_plane: ControlPlane,
    k8s: ApiClient,
    release: Release,
    workload_ns: str,
    tmp_path: Path,
    world_size: int = 1,
) -> tuple[list[Request], dict[str, list[tuple[dict[str, str], float]]], str]:
    proxy = RecordingProxy(control_plane.server, control_plane.ca_file).start()
    operator: OperatorProcess | None = None
    try:
        kubeconfig = _service_account_kubeconfig(
            control_plane, release, proxy.url, tmp_path / "sa.kubeconfig"
        )
        operator = OperatorProcess(release, kubeconfig, tmp_path / "operator.log")
        eventually(lambda: operator.healthy(release.health_port), 60, "the operator's liveness endpoint")

        workload = Workload(control_plane, k8s, workload_ns, world_size)
        workload.apply()
        eventually(lambda: workload.running(2), 60, "the example group running with 2 replicas")
        control_plane.kubectl("scale", "-n", workload_ns, f"iwg/{workload.name}", "--replicas=3")
        eventually(lambda: workload.running(3), 60, "scaled up to 3")
        workload.patch({"worker": {"image": "ghcr.io/iwg-dev/iwg-worker:0.1.1"}})
        eventually(
            lambda: workload.running(3, "ghcr.io/iwg-dev/iwg-worker:0.1.1"), 60, "rolled to a new image"
        )
        # Drift: someone edits the group's children; the next spec change puts them back (patch).
        workload.tamper_with_children()
        control_plane.kubectl("scale", "-n", workload_ns, f"iwg/{workload.name}", "--replicas=1")
        eventually(lambda: workload.running(1), 60, "scaled down to 1")
        eventually(workload.children_repaired, 60, "the edited children repaired")
        # Key rotation as docs/operations.md says it: new keys (the Secret replaced), every pod rolled.
        before = workload.secret_data()
        control_plane.kubectl(
            "annotate",
            "-n",
            workload_ns,
            f"iwg/{workload.name}",
            "inference.iwg.dev/rotate-keys=1",
            "--overwrite",
        )
        eventually(lambda: workload.secret_data() != before, 60, "new keys")
        eventually(lambda: workload.running(1), 60, "rolled onto the new keys")
        # The autoscaler brings replicas within new bounds (through the scale subresource), metrics or not.
        workload.patch({"autoscaling": {"minReplicas": 2}})
        eventually(lambda: workload.running(2), 60, "the autoscaler raised replicas to minReplicas")
        if world_size > 1:
            # One rank per replica: no gang any more, its PodGroups and Workload go.
            workload.patch({"worldSize": 1})
            workload.world_size = 1
            eventually(lambda: workload.running(2), 60, "world size 1")
        # The phase gauge follows the status write the test just read: it may be a moment behind it.
        scraped = _scrape(release.metrics_port)
        deadline = time.monotonic() + 10
        while _total(scraped["iwg_operator_groups"], phase="Running") != 1 and time.monotonic() < deadline:
            time.sleep(0.2)
            scraped = _scrape(release.metrics_port)
        control_plane.kubectl("delete", "-n", workload_ns, f"iwg/{workload.name}", "--wait=false")
        eventually(workload.gone, 60, "the group deleted")
        time.sleep(1.0)  # the operator sees the deletion before it stops
    except AssertionError as error:
        # A step not reached: what the operator did meanwhile is the evidence (CI keeps only this output).
        log = operator.output()[-6000:] if operator is not None else ""
        raise AssertionError(f"{error}\n--- the operator's log, last lines:\n{log}") from error
    finally:
        exit_code = operator.stop() if operator is not None else None
        proxy.stop()
    output = operator.output()
    assert exit_code == 0, f"the operator exited with {exit_code}:\n{output[-4000:]}"
    return proxy.recorded(), scraped, output


def _granted(release: Release, scope: str) -> set[tuple[str, str, str]]:
    return {rule[1:] for rule in chart.rules(release.manifest) if rule[0] == scope}


def _served(control_plane: ControlPlane) -> set[tuple[str, str]]:
    """(API group, resource) of everything the cluster serves."""
    names = control_plane.kubectl("api-resources", "-o", "name").stdout.split()
    return {(name.partition(".")[2], name.partition(".")[0]) for name in names}


GANG_RESOURCES = {("scheduling.k8s.io", "workloads"), ("scheduling.k8s.io", "podgroups")}


@pytest.mark.parametrize("mode", ["cluster-wide", "namespaced"])
def test_the_operator_runs_with_exactly_the_charts_rbac(
    mode: str,
    control_plane: ControlPlane,
    scheduler: ControlPlane,
    controller_manager: ControlPlane,
    gpu_nodes: list[str],
    k8s: ApiClient,
    namespace: str,
    tmp_path: Path,
) -> None:
    _check_rbac(mode, control_plane, k8s, namespace, tmp_path, world_size=1)


def test_the_operator_runs_with_exactly_the_charts_rbac_under_gang_placement(
    gang_control_plane: ControlPlane, gang_k8s: ApiClient, gang_namespace: str, tmp_path: Path
) -> None:
    """On a cluster serving Workload and PodGroup, a group of world size 2 uses every gang rule too."""
    gang_control_plane.start_gpu_nodes()
    _check_rbac("namespaced", gang_control_plane, gang_k8s, gang_namespace, tmp_path, world_size=2)


def _check_rbac(
    mode: str, control_plane: ControlPlane, k8s: ApiClient, namespace: str, tmp_path: Path, world_size: int
) -> None:
    core = client.CoreV1Api(k8s)
    workload_ns = f"{namespace[:50]}-work"
    core.create_namespace(client.V1Namespace(metadata=client.V1ObjectMeta(name=workload_ns)))
    values = ["--set", f"watchNamespaces={{{workload_ns}}}"] if mode == "namespaced" else []
    release = _install(control_plane, namespace, *values)
    try:
        requests, scraped, output = _run_operator_through_a_scenario(
            control_plane, k8s, release, workload_ns, tmp_path, world_size
        )
    finally:
        chart.helm("uninstall", release.name, "--namespace", namespace, env=control_plane.env())
        core.delete_namespace(workload_ns, propagation_policy="Background")

    # A cluster-wide operator also sees groups of namespaces being deleted (other tests'): a create there is
    # refused because the namespace is closing, not by RBAC, and the operator stops trying at once.
    closing = [r for r in requests if r.status == 403 and "NamespaceTerminating" in r.causes]
    assert all(r.namespace not in (workload_ns, namespace) for r in closing), closing
    forbidden = [r for r in requests if r.status == 403 and r not in closing]
    assert not forbidden, f"403 responses: {sorted({(r.method, r.path) for r in forbidden})}"
    messages = re.sub(r"^\[[^]]*\]", "", output, flags=re.MULTILINE)  # a timestamp's ",403" is no refusal
    assert not re.search(r"\b403\b|Forbidden", messages), output[-4000:]

    resource_requests = [r for r in requests if r.resource is not None]
    assert resource_requests, "the proxy saw no API requests"
    # Leader election: the replicas' Lease in the release's namespace, under a Role of its own there. A single
    # replica creates it, reads it and renews it: each of the Role's rules is used.
    elections = [r for r in resource_requests if (r.group, r.resource) == ("coordination.k8s.io", "leases")]
    assert {r.namespace for r in elections} == {namespace}, elections
    assert rules_used(elections) == _granted(release, namespace), "the leader election's Role"
    resource_requests = [r for r in resource_requests if r not in elections]
    used = rules_used(resource_requests)
    if mode == "cluster-wide":
        granted = _granted(release, "cluster")
    else:
        assert not _granted(release, "cluster"), "a namespaced install needs no cluster-wide rule"
        granted = _granted(release, workload_ns)
        assert {r.namespace for r in resource_requests} == {workload_ns}
    assert used <= granted, f"used but not granted: {used - granted}"
    # A rule on a resource this cluster does not serve cannot be used: only the gang rules may be such.
    served = _served(control_plane)
    unserved = {rule for rule in granted if (rule[0], rule[1].split("/")[0]) not in served}
    assert {rule[:2] for rule in unserved} <= GANG_RESOURCES, unserved
    if world_size > 1:
        assert not unserved, f"the gang control plane serves every resource granted: {unserved}"
    assert granted - unserved <= used, (
        f"granted but never used by the operator: {sorted(granted - unserved - used)}"
    )

    # The metrics endpoint, scraped mid-run: every iwg_operator_ metric is there, and what it counted
    # agrees with what the API server saw.
    names = set(scraped)
    for name in metrics.METRIC_NAMES:
        assert name.removesuffix("_total") in names, f"{name} missing from /metrics"
    assert _total(scraped["iwg_operator_reconciles"], handler="reconcile") > 0
    assert _total(scraped["iwg_operator_reconciles"], handler="health") > 0, "the health prober never ran"
    assert _total(scraped["iwg_operator_pods_created"]) >= 3
    assert _total(scraped["iwg_operator_pods_replaced"], reason="rollout") >= 3
    assert _total(scraped["iwg_operator_reconciles"], handler="autoscale") > 0
    assert _total(scraped["iwg_operator_autoscaler_decisions"], decision="hold") > 0
    assert _total(scraped["iwg_operator_autoscaler_decisions"], decision="up") == 1
    api_requests = scraped["iwg_operator_api_requests"]
    assert _total(api_requests) > 0
    assert _total(api_requests, code="403") <= len(closing)  # scraped mid-run: only the closing namespaces'
    assert _total(scraped["iwg_operator_groups"], phase="Running") == 1


def test_install_and_uninstall_leave_only_the_crd(
    control_plane: ControlPlane, controller_manager: ControlPlane, k8s: ApiClient, namespace: str
) -> None:
    core = client.CoreV1Api(k8s)
    core.patch_namespace(
        namespace, {"metadata": {"labels": {"pod-security.kubernetes.io/enforce": "restricted"}}}
    )
    release = _install(control_plane, namespace)
    kinds = {doc["kind"] for doc in release.manifest}
    assert {
        "ServiceAccount",
        "ClusterRole",
        "ClusterRoleBinding",
        "Role",
        "RoleBinding",
        "Deployment",
        "Service",
        "NetworkPolicy",
    } <= kinds
    for doc in release.manifest:
        assert _exists(control_plane, doc), f"{doc['kind']}/{doc['metadata']['name']} was not installed"
        assert doc["metadata"]["labels"]["app.kubernetes.io/instance"] == release.name
    assert _exists(control_plane, {"kind": "CustomResourceDefinition", "metadata": {"name": CRD_NAME}})
    # The Deployment's pod is admitted where the restricted Pod Security level is enforced.
    selector = "app.kubernetes.io/name=iwg-operator,app.kubernetes.io/instance=iwg"
    eventually(
        lambda: core.list_namespaced_pod(namespace, label_selector=selector).items, 60, "the operator pod"
    )
    status = chart.helm("status", release.name, "--namespace", namespace, env=control_plane.env()).stdout
    assert "STATUS: deployed" in status and "Next steps" in status

    chart.helm("uninstall", release.name, "--namespace", namespace, "--wait", env=control_plane.env())
    for doc in release.manifest:
        assert not _exists(control_plane, doc), f"{doc['kind']}/{doc['metadata']['name']} left behind"
    assert _exists(control_plane, {"kind": "CustomResourceDefinition", "metadata": {"name": CRD_NAME}})
    listed = chart.helm("list", "--namespace", namespace, "-q", env=control_plane.env()).stdout
    assert not listed.strip()


@pytest.mark.parametrize(
    ("argument", "message"),
    [
        ("--set-string=replicas=1", "at '/replicas': got string, want integer"),
        (
            "--set=logLevel=verbose",
            "at '/logLevel': value must be one of 'debug', 'info', 'warning', 'error'",
        ),
    ],
)
def test_bad_values_fail_the_install_with_the_schemas_message(
    argument: str, message: str, control_plane: ControlPlane, namespace: str
) -> None:
    done = chart.helm(
        "install", "bad", str(chart.CHART), "--namespace", namespace, argument,
        check=False, env=control_plane.env(),
    )  # fmt: skip
    assert done.returncode != 0
    assert message in done.stderr, done.stderr
    assert not chart.helm("list", "-n", namespace, "-q", "-a", env=control_plane.env()).stdout.strip()
    assert not control_plane.kubectl("get", "all", "-n", namespace, "-o", "name").stdout.strip()


def _readme_commands(section: str) -> Iterator[str]:
    text = (chart.ROOT / "README.md").read_text()
    match = re.search(rf"^## {re.escape(section)}\n(.*?)(?=^## |\Z)", text, re.S | re.M)
    assert match, f"README has no '## {section}' section"
    for block in re.findall(r"```sh\n(.*?)```", match.group(1), re.S):
        for line in block.splitlines():
            command = line.split(" #", 1)[0].strip()
            if command and not command.startswith("#"):
                yield command


def test_the_readme_install_commands_work_as_written(
    control_plane: ControlPlane, controller_manager: ControlPlane, k8s: ApiClient
) -> None:
    commands = list(_readme_commands("Install on a cluster"))
    assert any(c.startswith("helm install") for c in commands)
    assert any(c.startswith("helm uninstall") for c in commands)
    env = control_plane.env()
    env["PATH"] = os.pathsep.join([str(chart.helm_binary().parent), env["PATH"]])
    namespaces = {arg for c in commands for arg in re.findall(r"(?:-n|--namespace)[ =](\S+)", c)}
    try:
        for command in commands:
            if " rollout status " in f" {command} " or " port-forward " in command:
                continue  # need a kubelet running the operator's image: the install test runs the operator
            done = subprocess.run(
                shlex.split(command), cwd=chart.ROOT, env=env, capture_output=True, text=True, timeout=120
            )
            assert done.returncode == 0, f"`{command}` failed:\n{done.stderr}"
    finally:
        for command in commands:
            if command.startswith("helm install"):
                args = shlex.split(command)
                release, namespace = args[2], args[args.index("--namespace") + 1]
                chart.helm("uninstall", release, "-n", namespace, "--ignore-not-found", env=env)
        core = client.CoreV1Api(k8s)
        for namespace in namespaces:
            with contextlib.suppress(ApiException):
                core.delete_namespace(namespace, propagation_policy="Background")
