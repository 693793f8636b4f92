"""The chart under test, its value sets, and `helm` run against it."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml

from tests.cluster import binaries

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "helm" / "iwg-operator"
VALUES_DIR = Path(__file__).resolve().parent / "values"
KUBE_VERSION = "v1.37.2"

# The default values (None) and every file under values/: what lint, template and dry-run tests cover.
VALUE_SETS: list[str | None] = [None, *sorted(p.name for p in VALUES_DIR.glob("*.yaml"))]


def helm_binary() -> Path:
    """helm from the versioned cache `make cluster-bins` (tests/cluster/build.sh) fills."""
    return binaries.binary("helm")


def values_args(value_set: str | None) -> list[str]:
    return [] if value_set is None else ["-f", str(VALUES_DIR / value_set)]


def helm(
    *args: str, check: bool = True, env: dict[str, str] | None = None, timeout: float = 120
) -> subprocess.CompletedProcess[str]:
    # helm keeps its state (repositories, caches) under HELM_* paths: keep them out of $HOME.
    state = ROOT / ".pytest_cache" / "helm"
    helm_env = {
        **(env or os.environ),
        "HELM_CACHE_HOME": str(state / "cache"),
        "HELM_CONFIG_HOME": str(state / "config"),
        "HELM_DATA_HOME": str(state / "data"),
    }
    done = subprocess.run(
        [str(helm_binary()), *args], capture_output=True, text=True, env=helm_env, timeout=timeout
    )
    if check and done.returncode != 0:
        raise AssertionError(f"helm {' '.join(args)} failed ({done.returncode}):\n{done.stderr}{done.stdout}")
    return done


def template(
    value_set: str | None = None, *extra: str, namespace: str = "iwg-system", release: str = "iwg"
) -> str:
    return helm(
        "template",
        release,
        str(CHART),
        "--namespace",
        namespace,
        "--kube-version",
        KUBE_VERSION,
        *values_args(value_set),
        *extra,
    ).stdout


def documents(text: str) -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all(text) if doc]


def render(value_set: str | None = None, *extra: str, namespace: str = "iwg-system") -> list[dict[str, Any]]:
    return documents(template(value_set, *extra, namespace=namespace))


def of_kind(docs: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [doc for doc in docs if doc["kind"] == kind]


def one(docs: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    found = of_kind(docs, kind)
    assert len(found) == 1, f"expected one {kind}, found {len(found)}"
    return found[0]


def rules(docs: list[dict[str, Any]]) -> Iterator[tuple[str, str, str, str]]:
    """Every (scope, apiGroup, resource, verb) the rendered (Cluster)Roles grant."""
    for doc in docs:
        if doc["kind"] not in ("ClusterRole", "Role"):
            continue
        scope = "cluster" if doc["kind"] == "ClusterRole" else doc["metadata"]["namespace"]
        for rule in doc.get("rules") or []:
            for group in rule.get("apiGroups", []):
                for resource in rule.get("resources", []):
                    for verb in rule.get("verbs", []):
                        yield scope, group, resource, verb
