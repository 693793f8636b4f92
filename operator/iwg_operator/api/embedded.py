"""Schemas of the Kubernetes types a group embeds (spec.scheduling.affinity is a core/v1 Affinity).

The CRD embeds the real schema of each type, so the API server refuses a misspelt key there (with
`kubectl`'s strict field validation) instead of dropping it, and `iwg serve` and the operator refuse the same
keys. The schemas come from a real kube-apiserver's OpenAPI v3 document (`/openapi/v3/api/v1`) and are kept
in `kubernetes_schemas.json` beside this module, a generated file: `python -m tests.cluster.kubernetes_schemas`
rewrites it from the test control plane, and a cluster test fails when it drifts from the live API server.

A CRD schema cannot use `$ref`: `extract` inlines every reference and keeps only what a structural CRD
schema admits. Defaults are dropped: the group keeps the value as written, and the API server applies its
own defaults when the operator copies it into a pod.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Mapping
from functools import cache
from importlib import resources
from typing import Any

import jsonschema

Schema = dict[str, Any]

SCHEMA_FILE = "kubernetes_schemas.json"
# The embedded types, by their OpenAPI v3 names.
AFFINITY = "io.k8s.api.core.v1.Affinity"
EMBEDDED_TYPES = (AFFINITY,)

# What a CRD's JSONSchemaProps holds that these documents use; anything else (patch strategies, `default`,
# `format` names the API server does not know for CRDs) is left out.
_KEPT_KEYS = frozenset(
    {
        "description",
        "type",
        "format",
        "properties",
        "items",
        "required",
        "enum",
        "additionalProperties",
        "x-kubernetes-int-or-string",
        "x-kubernetes-list-type",
        "x-kubernetes-list-map-keys",
        "x-kubernetes-map-type",
        "x-kubernetes-preserve-unknown-fields",
    }
)
_REF_PREFIX = "#/components/schemas/"


def extract(openapi: Mapping[str, Any], name: str) -> Schema:
    """The schema `name` of an OpenAPI v3 document with every reference inlined, as a CRD admits it."""
    components: Mapping[str, Schema] = openapi["components"]["schemas"]

    def inline(schema: Mapping[str, Any], seen: tuple[str, ...]) -> Schema:
        schema = dict(schema)
        refs = [schema.pop("$ref")] if "$ref" in schema else []
        refs += [part["$ref"] for part in schema.pop("allOf", []) if "$ref" in part]
        for ref in refs:
            target = ref.removeprefix(_REF_PREFIX)
            if target in seen:
                raise ValueError(f"{name}: recursive reference to {target} cannot be inlined")
            # The referring field's own keys (its description) win over the target's.
            schema = {**inline(components[target], (*seen, target)), **schema}
        result: Schema = {}
        for key, value in schema.items():
            if key not in _KEPT_KEYS:
                continue
            if key == "properties":
                result[key] = {prop: inline(sub, seen) for prop, sub in value.items()}
            elif key in ("items", "additionalProperties") and isinstance(value, Mapping):
                result[key] = inline(value, seen)
            else:
                result[key] = copy.deepcopy(value)
        return result

    return inline(components[name], (name,))


def extract_all(openapi: Mapping[str, Any]) -> dict[str, Schema]:
    return {name: extract(openapi, name) for name in EMBEDDED_TYPES}


def render(schemas: Mapping[str, Schema], source: str) -> str:
    """The checked-in file's text."""
    document = {"source": source, "schemas": dict(schemas)}
    return json.dumps(document, indent=1, sort_keys=True) + "\n"


@cache
def _document() -> dict[str, Any]:
    text = resources.files(__package__).joinpath(SCHEMA_FILE).read_text()
    document: dict[str, Any] = json.loads(text)
    return document


def schema(name: str) -> Schema:
    """The embedded type's schema as the CRD holds it (a fresh copy)."""
    return copy.deepcopy(_document()["schemas"][name])


def _closed(schema: Schema) -> Schema:
    """The schema with unknown keys refused: what the API server's strict field validation does."""
    result = dict(schema)
    if "properties" in result:
        result["properties"] = {k: _closed(v) for k, v in result["properties"].items()}
        result.setdefault("additionalProperties", False)
    for key in ("items", "additionalProperties"):
        if isinstance(result.get(key), dict):
            result[key] = _closed(result[key])
    return result


@cache
def _validator(name: str) -> jsonschema.protocols.Validator:
    closed = _closed(schema(name))
    validator_class = jsonschema.validators.validator_for(closed, default=jsonschema.Draft202012Validator)
    validator: jsonschema.protocols.Validator = validator_class(closed)
    return validator


def errors(name: str, value: Any) -> list[tuple[str, str]]:
    """Every way `value` breaks the type's schema: (path inside the value, message), e.g.
    ('.nodeAffinity', "Additional properties are not allowed ('nodeAfinity' was unexpected)")."""
    found = []
    for error in sorted(_validator(name).iter_errors(value), key=lambda e: list(map(str, e.absolute_path))):
        path = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in error.absolute_path)
        found.append((path, error.message))
    return found
