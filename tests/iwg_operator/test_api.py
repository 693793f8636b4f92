"""The pydantic models and `load_manifest`: what `iwg serve` and the operator accept and how they refuse."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import yaml
from iwg_operator.api.v1alpha1 import (
    InferenceWorkerGroupSpec,
    ManifestError,
    load_manifest,
    parse_spec,
)

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "minilm.yaml"


def minimal() -> dict[str, Any]:
    return {
        "apiVersion": "inference.iwg.dev/v1alpha1",
        "kind": "InferenceWorkerGroup",
        "metadata": {"name": "g"},
        "spec": {"model": {"task": "embed", "path": "/models/m"}},
    }


def test_example_loads_and_names_an_existing_model_directory() -> None:
    group = load_manifest(EXAMPLE)
    assert group.spec.model.task == "embed"
    assert group.spec.replicas == 2
    model_dir = group.spec.model.resolved_path()
    assert (model_dir / "config.json").is_file()
    assert (model_dir / "model.safetensors").is_file()


@pytest.mark.parametrize("example", sorted(EXAMPLE.parent.glob("*.yaml")), ids=lambda p: p.name)
def test_examples_give_the_driver_cpu_and_memory(example: Path) -> None:
    """The examples show the driver's resources (defaults exist too: never BestEffort)."""
    driver = yaml.safe_load(example.read_text())["spec"]["driver"]
    assert {"cpu", "memory"} <= set(driver), driver
    group = load_manifest(example)
    assert (group.spec.driver.cpu, group.spec.driver.memory) == (str(driver["cpu"]), str(driver["memory"]))


def test_defaults_fill_every_section() -> None:
    group = load_manifest(minimal())
    spec = group.spec
    assert (spec.replicas, spec.world_size, spec.worker.gpus, spec.rollout.max_unavailable) == (1, 1, 1, 1)
    assert spec.driver.batching.max_batch_size == 32
    assert spec.health.restart_policy == "Replica"
    assert group.served_name == "g"
    assert group.namespace == "default"


def test_camel_case_round_trip() -> None:
    data = minimal()
    data["spec"]["worker"] = {"shmSize": 2048, "cpu": 2, "workerCls": "pkg.mod.Cls"}
    spec = load_manifest(data).spec
    assert spec.worker.shm_size == "2048"
    assert spec.worker.cpu == "2"
    manifest = spec.to_manifest()
    assert manifest["worker"]["workerCls"] == "pkg.mod.Cls"
    assert InferenceWorkerGroupSpec.model_validate(manifest) == spec


@pytest.mark.parametrize(
    ("path", "value", "field"),
    [
        (("spec", "replicas"), -1, "spec.replicas"),
        (("spec", "worldSize"), 0, "spec.worldSize"),
        (("spec", "worker", "gpus"), 17, "spec.worker.gpus"),
        (("spec", "worker", "shmSize"), "lots", "spec.worker.shmSize"),
        (("spec", "model", "task"), "classify", "spec.model.task"),
        (("spec", "model", "engine"), "tensorrt", "spec.model.engine"),
        (("spec", "model", "engine"), "vllm", "spec.model.engine"),
        (("spec", "model", "enforceEager"), "maybe", "spec.model.enforceEager"),
        (
            ("spec", "model"),
            {"task": "generate", "path": "/m", "engine": "transformers", "enforceEager": True},
            "spec.model.enforceEager",
        ),
        (("spec", "worker", "imagePull"), "x", "spec.worker.imagePull"),
        (("spec", "health", "restartPolicy"), "Node", "spec.health.restartPolicy"),
        (("spec", "worker", "env"), [{"name": "IWG_RANK", "value": "3"}], "spec.worker.env"),
        (("spec", "autoscaling"), {"minReplicas": 5, "maxReplicas": 2}, "spec.autoscaling.minReplicas"),
        (
            ("spec", "driver", "batching"),
            {"maxBatchSize": 64, "maxQueue": 8},
            "spec.driver.batching.maxQueue",
        ),
        (("metadata", "name"), "Bad_Name", "metadata.name"),
    ],
)
def test_errors_name_the_field(path: tuple[str, ...], value: object, field: str) -> None:
    data = copy.deepcopy(minimal())
    target = data
    for key in path[:-1]:
        target = target.setdefault(key, {})
    target[path[-1]] = value
    with pytest.raises(ManifestError) as info:
        load_manifest(data)
    assert field in str(info.value)


def test_file_errors(tmp_path: Path) -> None:
    with pytest.raises(ManifestError, match="expected one YAML document"):
        bad = tmp_path / "two.yaml"
        bad.write_text("a: 1\n---\nb: 2\n")
        load_manifest(bad)
    with pytest.raises(ManifestError, match=r"missing\.yaml"):
        load_manifest(tmp_path / "missing.yaml")


def test_parse_spec_prefixes_spec() -> None:
    with pytest.raises(ManifestError) as info:
        parse_spec({"model": {"task": "embed", "path": "/m"}, "worldSize": 100})
    assert info.value.errors[0][0] == "spec.worldSize"


def test_engine_defaults_to_auto_and_vllm_is_for_generation_only() -> None:
    assert load_manifest(minimal()).spec.model.engine == "auto"
    for task in ("embed", "generate"):
        for engine in ("auto", "transformers"):
            assert (
                parse_spec({"model": {"task": task, "path": "/m", "engine": engine}}).model.engine == engine
            )
    assert parse_spec({"model": {"task": "generate", "path": "/m", "engine": "vllm"}}).model.engine == "vllm"
    with pytest.raises(ManifestError) as info:
        parse_spec({"model": {"task": "embed", "path": "/m", "engine": "vllm"}})
    assert info.value.errors == [
        (
            "spec.model",
            "spec.model.engine vllm needs spec.model.task generate (an embed group runs no generation engine; "
            "leave spec.model.engine at auto)",
        )
    ]


def test_enforce_eager_defaults_to_false_and_is_refused_with_the_transformers_engine() -> None:
    assert load_manifest(minimal()).spec.model.enforce_eager is False
    for engine in ("auto", "vllm"):
        model = parse_spec(
            {"model": {"task": "generate", "path": "/m", "engine": engine, "enforceEager": True}}
        )
        assert model.model.enforce_eager is True
    # An embed group runs no generation engine: the option is accepted there and does nothing.
    assert parse_spec({"model": {"task": "embed", "path": "/m", "enforceEager": True}}).model.enforce_eager
    assert not parse_spec(
        {"model": {"task": "generate", "path": "/m", "engine": "transformers", "enforceEager": False}}
    ).model.enforce_eager
    with pytest.raises(ManifestError) as info:
        parse_spec(
            {"model": {"task": "generate", "path": "/m", "engine": "transformers", "enforceEager": True}}
        )
    assert info.value.errors == [
        (
            "spec.model",
            "spec.model.enforceEager applies to vLLM's engine only and spec.model.engine transformers would "
            "ignore it (leave spec.model.enforceEager false, or set spec.model.engine to auto or vllm)",
        )
    ]


def test_pkg_path_of_missing_package() -> None:
    data = minimal()
    data["spec"]["model"]["path"] = "pkg:no_such_package_iwg/model"
    with pytest.raises(ValueError, match="no_such_package_iwg"):
        load_manifest(data).spec.model.resolved_path()
