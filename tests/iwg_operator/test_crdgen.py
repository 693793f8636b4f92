"""The checked-in CRD and reference page are exactly what the generator makes from the models."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from iwg_operator import crdgen

ROOT = Path(__file__).resolve().parents[2]


def test_checked_in_files_match_the_generator() -> None:
    for relative, text in crdgen.outputs().items():
        assert (ROOT / relative).read_text() == text, f"{relative} is stale: run `make crds`"


def _walk(schema: dict[str, Any], path: str = "") -> list[tuple[str, dict[str, Any]]]:
    found = [(path, schema)]
    for name, prop in schema.get("properties", {}).items():
        found.extend(_walk(prop, f"{path}.{name}"))
    if "items" in schema:
        found.extend(_walk(schema["items"], f"{path}[]"))
    return found


def test_schema_is_structural() -> None:
    schema = crdgen.openapi_schema()
    for path, node in _walk(schema):
        assert "$ref" not in node and "title" not in node, path
        assert "type" in node or node.get("x-kubernetes-int-or-string"), f"{path} has no type"
        if node.get("type") == "object" and "properties" in node:
            assert node.get("additionalProperties") in (None,), (
                f"{path}: properties with additionalProperties"
            )
        if "anyOf" in node:
            assert node.get("x-kubernetes-int-or-string"), f"{path}: anyOf only for int-or-string"
    spec = schema["properties"]["spec"]
    worker = spec["properties"]["worker"]
    assert worker["default"]["gpus"] == worker["properties"]["gpus"]["default"], (
        "omitted sections get defaults"
    )
    assert schema["properties"]["status"]["x-kubernetes-preserve-unknown-fields"] is True


def test_cross_field_rules_reach_the_crd() -> None:
    spec = crdgen.openapi_schema()["properties"]["spec"]
    rules = spec["properties"]["autoscaling"]["x-kubernetes-validations"]
    assert any("minReplicas" in r["rule"] and "spec.autoscaling.minReplicas" in r["message"] for r in rules)


def test_the_engine_is_a_column_and_vllm_is_refused_for_embed_by_the_api_server() -> None:
    version = crdgen.crd()["spec"]["versions"][0]
    columns = {c["name"]: c["jsonPath"] for c in version["additionalPrinterColumns"]}
    assert columns["Engine"] == ".status.engine"
    assert list(columns).index("Engine") == list(columns).index("Phase") + 1
    model = crdgen.openapi_schema()["properties"]["spec"]["properties"]["model"]
    assert model["properties"]["engine"]["default"] == "auto"
    rule = next(r for r in model["x-kubernetes-validations"] if r.get("fieldPath") == ".engine")
    assert "spec.model.engine" in rule["message"] and "'vllm'" in rule["rule"]


def test_enforce_eager_defaults_to_false_and_is_refused_with_transformers_by_the_api_server() -> None:
    model = crdgen.openapi_schema()["properties"]["spec"]["properties"]["model"]
    eager = model["properties"]["enforceEager"]
    assert eager["type"] == "boolean" and eager["default"] is False
    rule = next(r for r in model["x-kubernetes-validations"] if r.get("fieldPath") == ".enforceEager")
    assert "spec.model.enforceEager" in rule["message"] and "'transformers'" in rule["rule"]


def test_check_mode_detects_drift(tmp_path: Path) -> None:
    assert crdgen.main(["--root", str(tmp_path)]) == 0
    assert crdgen.main(["--root", str(tmp_path), "--check"]) == 0
    (tmp_path / crdgen.CRD_PATH).write_text("stale")
    assert crdgen.main(["--root", str(tmp_path), "--check"]) == 1
