"""kube-score on what reaches a cluster: the chart's objects and the objects the operator builds for three
example groups. Every finding must be listed as accepted, with its reason, in docs/operations.md."""

from __future__ import annotations

import json
import re
import subprocess
from dataclasses import dataclass
from typing import Any

import pytest
import yaml
from iwg_operator import builders
from iwg_operator.controller import group_from_body

from tests.cluster import binaries
from tests.helm import chart
from tests.helm.chart import ROOT

OPERATIONS = ROOT / "docs" / "operations.md"
ACCEPTED_HEADING = "### kube-score findings accepted"
# kube-score's grades: 10 is a passed check; below it warnings (5, 7) and critical findings (1).
GRADE_OK = 10


def _minilm() -> dict[str, Any]:
    body: dict[str, Any] = yaml.safe_load((ROOT / "examples" / "minilm.yaml").read_text())
    body["metadata"].update(namespace="ml", uid="00000000-0000-0000-0000-000000000001")
    return body


def _tensor_parallel() -> dict[str, Any]:
    """A generating group on GPUs: two ranks per replica on one node, the model on a volume."""
    body = _minilm()
    body["metadata"] = {"name": "llm", "namespace": "ml", "uid": "00000000-0000-0000-0000-000000000002"}
    body["spec"] = {
        "model": {
            "task": "generate",
            "path": "/models/llm",
            "volume": {"claimName": "models", "mountPath": "/models"},
            "dtype": "bfloat16",
        },
        "replicas": 2,
        "worldSize": 2,
        "worker": {"gpus": 4, "cpu": "8", "memory": "64Gi", "shmSize": "16Gi", "tmpSize": "8Gi"},
        "driver": {"cpu": "2", "memory": "4Gi"},
        "scheduling": {"gpuProduct": "NVIDIA-H100-80GB-HBM3", "gpusPerNode": 8, "colocateRanks": True},
    }
    return body


def _autoscaled() -> dict[str, Any]:
    """A CPU embedding group that scales with load, its driver defaulted and reachable from one namespace."""
    body = _minilm()
    body["metadata"] = {"name": "embed", "namespace": "search", "uid": "00000000-0000-0000-0000-000000000003"}
    body["spec"]["autoscaling"] = {"enabled": True, "minReplicas": 1, "maxReplicas": 6, "target": 8}
    # The driver's resources and /tmp as the CRD defaults them.
    body["spec"]["driver"] = {key: body["spec"]["driver"][key] for key in ("port", "batching")}
    body["spec"]["driver"]["networkPolicy"] = {
        "httpFrom": [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "web"}}}]
    }
    return body


EXAMPLE_GROUPS = {"minilm": _minilm, "tensor-parallel": _tensor_parallel, "autoscaled": _autoscaled}


def group_objects(body: dict[str, Any]) -> list[dict[str, Any]]:
    """Everything the operator creates for a group (its Secret with placeholder keys)."""
    group = group_from_body(body)
    settings = builders.BuildSettings()
    spec = group.spec
    pods = [
        builders.worker_pod(group, replica, rank, settings)
        for replica in range(spec.replicas)
        for rank in range(spec.world_size)
    ]
    return [
        *pods,
        builders.driver_deployment(group),
        builders.driver_service(group),
        builders.headless_service(group),
        builders.network_policy(group, settings),
        builders.driver_network_policy(group, settings),
        builders.pod_disruption_budget(group),
        builders.config_map(group, settings),
        builders.curve_secret(group, (b"p" * 40, b"s" * 40), (b"q" * 40, b"t" * 40), "token"),
    ]


@dataclass(frozen=True, order=True)
class Finding:
    """One comment of a failed check: what kube-score found on one object."""

    check: str
    kind: str
    name: str
    grade: int
    summary: str

    def matches(self, row: Accepted) -> bool:
        return (
            self.check == row.check
            and self.summary == row.summary
            and re.fullmatch(row.object_pattern, f"{self.kind}/{self.name}") is not None
        )


@dataclass(frozen=True)
class Accepted:
    """A row of the accepted-findings table: check, object (Kind/name regex), finding, reason."""

    check: str
    object_pattern: str
    summary: str
    reason: str


def kube_score(objects: list[dict[str, Any]]) -> list[Finding]:
    """Findings of every default check of kube-score on the objects, read from its JSON report."""
    done = subprocess.run(
        [
            str(binaries.binary("kube-score")),
            "score",
            "--output-format",
            "json",
            "--kubernetes-version",
            ".".join(chart.KUBE_VERSION.split(".")[:2]),
            "-",
        ],
        input=yaml.safe_dump_all(objects),
        capture_output=True,
        text=True,
        timeout=120,
    )
    # Exit status 1 means "critical findings"; anything else besides 0 is a failure to run.
    assert done.returncode in (0, 1), done.stderr
    findings = []
    for scored in json.loads(done.stdout):
        for check in scored["checks"]:
            if check["skipped"] or check["grade"] >= GRADE_OK:
                continue
            comments = check.get("comments") or [{"summary": ""}]
            findings.extend(
                Finding(
                    check["check"]["id"],
                    scored["type_meta"]["kind"],
                    scored["object_meta"]["name"],
                    check["grade"],
                    comment["summary"],
                )
                for comment in comments
            )
    return sorted(findings)


def accepted() -> list[Accepted]:
    """The accepted-findings table of docs/operations.md; every row gives its reason."""
    text = OPERATIONS.read_text()
    assert ACCEPTED_HEADING in text, f"{OPERATIONS} has no '{ACCEPTED_HEADING}' section"
    section = text.split(ACCEPTED_HEADING, 1)[1].split("\n#", 1)[0]
    rows = []
    for line in section.splitlines():
        # Cells split at pipes; `\|` is a pipe inside a cell (a regular expression's alternation).
        cells = [c.strip().replace("\\|", "|") for c in re.split(r"(?<!\\)\|", line.strip()[1:-1])]
        if len(cells) != 4 or not cells[0].startswith("`"):
            continue
        check, pattern, summary, reason = cells
        assert len(reason) > 20, f"accepted finding without a reason: {line}"
        rows.append(Accepted(check.strip("`"), pattern.strip("`"), summary, reason))
    assert rows, "the accepted-findings table is empty or unreadable"
    return rows


def _object_sets() -> dict[str, list[dict[str, Any]]]:
    sets = {f"chart ({value_set or 'defaults'})": chart.render(value_set) for value_set in chart.VALUE_SETS}
    sets |= {f"group {name}": group_objects(make()) for name, make in EXAMPLE_GROUPS.items()}
    return sets


@pytest.fixture(scope="module")
def findings() -> dict[str, list[Finding]]:
    return {what: kube_score(objects) for what, objects in _object_sets().items()}


def test_every_kube_score_finding_is_accepted_with_its_reason(findings: dict[str, list[Finding]]) -> None:
    rows = accepted()
    unaccepted = [
        f"{what}: {f.check} on {f.kind}/{f.name} (grade {f.grade}): {f.summary}"
        for what, found in findings.items()
        for f in found
        if not any(f.matches(row) for row in rows)
    ]
    assert not unaccepted, "kube-score findings not accepted in docs/operations.md:\n" + "\n".join(unaccepted)


def test_every_accepted_finding_still_occurs(findings: dict[str, list[Finding]]) -> None:
    """The accepted list says only what is true: a row that matches no finding is stale."""
    every = [f for found in findings.values() for f in found]
    stale = [row for row in accepted() if not any(f.matches(row) for f in every)]
    assert not stale, f"accepted in docs/operations.md but no longer found: {stale}"


def test_kube_score_reports_what_it_checks() -> None:
    """The harness reads real findings: a pod without limits, policy or security context is reported."""
    bare = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "bare", "namespace": "ml"},
        "spec": {"containers": [{"name": "c", "image": "busybox"}]},
    }
    checks = {f.check for f in kube_score([bare])}
    assert {
        "container-resources",
        "pod-networkpolicy",
        "container-security-context-user-group-id",
        "container-image-tag",
        "container-ephemeral-storage-request-and-limit",
    } <= checks, checks
