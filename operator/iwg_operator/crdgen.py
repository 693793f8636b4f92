"""Generate the CustomResourceDefinition and its reference page from the pydantic models.

`python -m iwg_operator.crdgen [--root DIR] [--check]` writes (or, with --check, compares)
crds/inference.iwg.dev_inferenceworkergroups.yaml and docs/crd-reference.md. Pydantic's JSON schema is
rewritten into a Kubernetes structural schema: references inlined, `null` alternatives dropped,
`additionalProperties: false` removed (the API server prunes and kubectl's strict field validation reports
unknown fields), exclusive bounds in OpenAPI v3.0 form, and a default on optional objects (their fields'
defaults) so that an omitted section is filled in.
"""

from __future__ import annotations

import argparse
import copy
import sys
from pathlib import Path
from typing import Any

import yaml

from iwg_operator.api import v1alpha1 as api

CRD_PATH = Path("crds") / f"{api.GROUP}_{api.PLURAL}.yaml"
REFERENCE_PATH = Path("docs") / "crd-reference.md"
# The Helm chart installs the same CRD (helm/iwg-operator/crds/): generated here, never edited by hand.
CHART_CRD_PATH = Path("helm") / "iwg-operator" / CRD_PATH

_DROPPED_KEYS = {"title", "additionalProperties"}
# Fields holding an embedded Kubernetes type (iwg_operator/api/embedded.py): the reference page names the type
# instead of repeating its schema.
EMBEDDED_FIELDS = {"spec.scheduling.affinity": "core/v1 Affinity"}
_OBJECT_KEY_ORDER = ("description", "type")

Schema = dict[str, Any]


def _resolve(schema: Schema, defs: dict[str, Schema]) -> Schema:
    """Inline `$ref`s, keeping a referring field's own description and default over the target's."""
    if "$ref" in schema:
        target = copy.deepcopy(defs[schema["$ref"].split("/")[-1]])
        extras = {k: v for k, v in schema.items() if k != "$ref"}
        schema = {**target, **extras}
    return schema


def _structural(schema: Schema, defs: dict[str, Schema]) -> Schema:
    schema = _resolve(schema, defs)
    any_of = schema.get("anyOf")
    if any_of is not None:
        alternatives = [a for a in any_of if a.get("type") != "null"]
        if len(alternatives) == 1:  # Optional[X]: the field is simply not required
            rest = {k: v for k, v in schema.items() if k != "anyOf"}
            return _structural({**_resolve(alternatives[0], defs), **rest}, defs)
    result: Schema = {}
    for key, value in schema.items():
        if key in _DROPPED_KEYS or key == "$defs":
            continue
        if key == "default" and value is None:
            continue
        if key == "properties":
            result[key] = {name: _structural(prop, defs) for name, prop in value.items()}
        elif key == "items":
            result[key] = _structural(value, defs)
        elif key == "exclusiveMinimum":
            result["minimum"] = value
            result["exclusiveMinimum"] = True
        elif key == "exclusiveMaximum":
            result["maximum"] = value
            result["exclusiveMaximum"] = True
        else:
            result[key] = value
    additional = schema.get("additionalProperties")
    if isinstance(additional, dict):
        result["additionalProperties"] = _structural(additional, defs)
    elif additional is True and "x-kubernetes-preserve-unknown-fields" not in result:
        result["x-kubernetes-preserve-unknown-fields"] = True
    if result.get("type") == "object" and "properties" in result:
        for prop in result["properties"].values():
            # An optional nested object with its own defaults defaults to those (not to {}: the API server
            # checks a default against the CEL rules before nested defaults apply).
            is_object = prop.get("type") == "object" and "properties" in prop
            if is_object and "default" not in prop and not prop.get("required") and _has_defaults(prop):
                prop["default"] = _defaults_of(prop)
    return _ordered(result)


def _has_defaults(schema: Schema) -> bool:
    return any("default" in p for p in schema.get("properties", {}).values())


def _defaults_of(schema: Schema) -> dict[str, Any]:
    return {
        name: copy.deepcopy(p["default"])
        for name, p in schema.get("properties", {}).items()
        if "default" in p
    }


def _ordered(schema: Schema) -> Schema:
    head = {k: schema[k] for k in _OBJECT_KEY_ORDER if k in schema}
    return head | {k: v for k, v in schema.items() if k not in head}


def _model_schema(model: type[api.ApiModel] | type[api.InferenceWorkerGroupStatus]) -> Schema:
    raw = model.model_json_schema(by_alias=True, mode="validation")
    defs = raw.get("$defs", {})
    return _structural(raw, defs)


def spec_schema() -> Schema:
    return _model_schema(api.InferenceWorkerGroupSpec)


def status_schema() -> Schema:
    schema = _model_schema(api.InferenceWorkerGroupStatus)
    # The operator owns status; Kopf and later features may add fields there: never prune them.
    schema["x-kubernetes-preserve-unknown-fields"] = True
    schema.pop("default", None)
    return schema


def openapi_schema() -> Schema:
    return {
        "description": api.InferenceWorkerGroup.__doc__,
        "type": "object",
        "required": ["spec"],
        "properties": {
            "apiVersion": {"type": "string", "description": "inference.iwg.dev/v1alpha1"},
            "kind": {"type": "string", "description": "InferenceWorkerGroup"},
            # Declared so that the root rules' fieldPath can point at it (only name may be constrained here).
            "metadata": {"type": "object", "properties": {"name": {"type": "string"}}},
            "spec": spec_schema(),
            "status": status_schema(),
        },
        # Rules at the root name the field they check; without fieldPath the server reports `<nil>`.
        "x-kubernetes-validations": [
            {
                "rule": f"size(self.metadata.name) <= {api.MAX_GROUP_NAME_LENGTH}",
                "message": (
                    f"metadata.name must be at most {api.MAX_GROUP_NAME_LENGTH} characters "
                    "(pod names <name>-r<replica>-w<rank> must stay DNS labels)"
                ),
                "fieldPath": ".metadata.name",
                "reason": "FieldValueInvalid",
            },
            {
                "rule": "self.metadata.name.matches('^[a-z]([-a-z0-9]*[a-z0-9])?$')",
                "message": "metadata.name must be a DNS label starting with a letter (it names Services)",
                "fieldPath": ".metadata.name",
                "reason": "FieldValueInvalid",
            },
        ],
    }


def crd() -> dict[str, Any]:
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": f"{api.PLURAL}.{api.GROUP}"},
        "spec": {
            "group": api.GROUP,
            "names": {
                "kind": api.KIND,
                "listKind": f"{api.KIND}List",
                "plural": api.PLURAL,
                "singular": api.SINGULAR,
                "shortNames": list(api.SHORT_NAMES),
                "categories": ["all", "iwg"],
            },
            "scope": "Namespaced",
            "versions": [
                {
                    "name": api.VERSION,
                    "served": True,
                    "storage": True,
                    "schema": {"openAPIV3Schema": openapi_schema()},
                    "subresources": {
                        "status": {},
                        "scale": {
                            "specReplicasPath": ".spec.replicas",
                            "statusReplicasPath": ".status.replicas",
                            "labelSelectorPath": ".status.selector",
                        },
                    },
                    "additionalPrinterColumns": [
                        _column("Replicas", "integer", ".spec.replicas", "Desired replicas"),
                        _column(
                            "Ready", "integer", ".status.readyReplicas", "Replicas with every rank ready"
                        ),
                        _column("World", "integer", ".spec.worldSize", "Ranks per replica"),
                        _column(
                            "Phase", "string", ".status.phase", "Pending, Progressing, Running, Degraded"
                        ),
                        _column(
                            "Engine",
                            "string",
                            ".status.engine",
                            "Generation engine the workers report (vllm, transformers; both while they differ)",
                        ),
                        _column("Age", "date", ".metadata.creationTimestamp", ""),
                    ],
                }
            ],
        },
    }


def _column(name: str, kind: str, path: str, description: str) -> dict[str, str]:
    column = {"name": name, "type": kind, "jsonPath": path}
    if description:
        column["description"] = description
    return column


def render_crd() -> str:
    header = (
        "# Generated by `python -m iwg_operator.crdgen` from iwg_operator/api/v1alpha1.py. Do not edit.\n"
    )
    return header + yaml.safe_dump(crd(), sort_keys=False, width=120, allow_unicode=True)


# ------------------------------------------------------------------------------------------ reference page


def _type_of(schema: Schema) -> str:
    if schema.get("x-kubernetes-int-or-string"):
        return "quantity"
    kind = schema.get("type", "object")
    if kind == "array":
        item = schema.get("items", {})
        return f"[]{_type_of(item) if 'properties' not in item else 'object'}"
    if kind == "object" and "additionalProperties" in schema:
        return f"map[string]{_type_of(schema['additionalProperties'])}"
    if "enum" in schema:
        return " | ".join(f"`{v}`" for v in schema["enum"])
    return str(kind)


def _constraints(schema: Schema, required: bool) -> str:
    parts = ["required"] if required else []
    for key, label in (("minimum", ">="), ("maximum", "<=")):
        if key in schema:
            exclusive = schema.get(f"exclusive{key[:3].title()}imum") is True
            parts.append(f"{label.replace('=', '') if exclusive else label} {schema[key]}")
    for key, label in (("minLength", "min length"), ("maxLength", "max length"), ("maxItems", "max items")):
        if key in schema:
            parts.append(f"{label} {schema[key]}")
    if "pattern" in schema and not schema.get("x-kubernetes-int-or-string"):
        parts.append(f"pattern `{schema['pattern']}`")
    if "properties" not in schema:  # an object's rules are listed under its own table
        parts.extend(rule["message"] for rule in schema.get("x-kubernetes-validations", []))
    return ", ".join(parts)


def _cell(text: object) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def _walk(path: str, schema: Schema, out: list[str]) -> None:
    properties = schema.get("properties")
    if not properties:
        return
    out.append(f"### `{path}`\n")
    if schema.get("description"):
        out.append(f"{schema['description']}\n")
    out.append("| Field | Type | Default | Constraints | Description |")
    out.append("|---|---|---|---|---|")
    required = set(schema.get("required", []))
    nested: list[tuple[str, Schema]] = []
    for name, prop in properties.items():
        default = prop.get("default")
        default_text = (
            ""
            if default is None or default == {}
            else f"`{yaml.safe_dump(default).strip().removesuffix('...').strip()}`"
        )
        kind = EMBEDDED_FIELDS.get(f"{path}.{name}") or _type_of(prop)
        out.append(
            f"| `{name}` | {_cell(kind)} | {_cell(default_text)} | "
            f"{_cell(_constraints(prop, name in required))} | {_cell(prop.get('description', ''))} |"
        )
        if f"{path}.{name}" in EMBEDDED_FIELDS:
            continue
        if "properties" in prop:
            nested.append((f"{path}.{name}", prop))
        elif prop.get("type") == "array" and "properties" in prop.get("items", {}):
            nested.append((f"{path}.{name}[]", prop["items"]))
    rules = schema.get("x-kubernetes-validations", [])
    if rules:
        out.append("\nRules checked by the API server (and by `iwg serve`):\n")
        out.extend(f"- {rule['message']} (CEL: `{rule['rule']}`)" for rule in rules)
    out.append("")
    for nested_path, nested_schema in nested:
        _walk(nested_path, nested_schema, out)


def render_reference() -> str:
    schema = openapi_schema()
    out = [
        "<!-- Generated by `python -m iwg_operator.crdgen` from iwg_operator/api/v1alpha1.py. Do not edit. -->",
        f"# {api.KIND} reference (`{api.API_VERSION}`)\n",
        f"{api.InferenceWorkerGroup.__doc__}\n",
        f"Short name `{api.SHORT_NAMES[0]}`; `kubectl explain {api.PLURAL}.spec` shows the same descriptions. "
        "The `scale` subresource maps `.spec.replicas`, `.status.replicas` and `.status.selector`, so "
        "`kubectl scale`, HPA and KEDA can drive replicas. Cross-field rules are CEL validations; the same "
        "checks run in `iwg serve` through the pydantic models.\n",
        "## Metadata\n",
        *(f"- {rule['message']}" for rule in schema["x-kubernetes-validations"]),
        "",
        "## Spec\n",
    ]
    _walk("spec", schema["properties"]["spec"], out)
    out.append("## Status\n")
    _walk("status", schema["properties"]["status"], out)
    return "\n".join(out).rstrip() + "\n"


def outputs() -> dict[Path, str]:
    return {CRD_PATH: render_crd(), CHART_CRD_PATH: render_crd(), REFERENCE_PATH: render_reference()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--root", type=Path, default=Path.cwd(), help="repository root (default: cwd)")
    parser.add_argument("--check", action="store_true", help="fail if the checked-in files differ")
    args = parser.parse_args(argv)
    stale = []
    for relative, text in outputs().items():
        path = args.root / relative
        if args.check:
            if not path.exists() or path.read_text() != text:
                stale.append(str(relative))
            continue
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        print(f"wrote {relative}")
    if stale:
        print(f"out of date (run `make crds`): {', '.join(stale)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
