"""The proxy's mapping from HTTP requests to RBAC attributes, which the install test's comparison relies on."""

from __future__ import annotations

import pytest

from tests.helm.apiproxy import rbac_attributes

G = "inference.iwg.dev"
CASES = [
    ("GET", "/api/v1/namespaces/ns/pods?labelSelector=a%3Db", "", 200, [("", "pods", "list", "ns")]),
    ("GET", "/api/v1/pods?watch=true&resourceVersion=5", "", 200, [("", "pods", "watch", None)]),
    ("GET", "/api/v1/namespaces/ns/secrets/s", "", 200, [("", "secrets", "get", "ns")]),
    ("POST", "/api/v1/namespaces/ns/events", "application/json", 201, [("", "events", "create", "ns")]),
    ("DELETE", "/api/v1/namespaces/ns/pods/p", "application/json", 200, [("", "pods", "delete", "ns")]),
    ("DELETE", "/api/v1/namespaces/ns/pods", "", 200, [("", "pods", "deletecollection", "ns")]),
    ("PUT", "/apis/apps/v1/namespaces/ns/deployments/d", "", 200, [("apps", "deployments", "update", "ns")]),
    (
        "PATCH", f"/apis/{G}/v1alpha1/namespaces/ns/inferenceworkergroups/g/status",
        "application/merge-patch+json", 200, [(G, "inferenceworkergroups/status", "patch", "ns")],
    ),
    (
        "PATCH", "/api/v1/namespaces/ns/services/s?fieldManager=x", "application/apply-patch+yaml", 201,
        [("", "services", "patch", "ns"), ("", "services", "create", "ns")],
    ),
    (
        "PATCH", "/api/v1/namespaces/ns/services/s?fieldManager=x", "application/apply-patch+yaml", 200,
        [("", "services", "patch", "ns")],
    ),
    ("GET", "/api/v1/namespaces/ns", "", 200, [("", "namespaces", "get", "ns")]),
    ("GET", "/api/v1/namespaces", "", 200, [("", "namespaces", "list", None)]),
    ("GET", "/apis/apps/v1", "", 200, [(None, None, "get", None)]),
    ("GET", "/version", "", 200, [(None, None, "get", None)]),
]  # fmt: skip


@pytest.mark.parametrize(("method", "url", "content_type", "status", "expected"), CASES)
def test_requests_map_to_the_attributes_rbac_checks(
    method: str, url: str, content_type: str, status: int, expected: list[tuple[str | None, ...]]
) -> None:
    assert rbac_attributes(method, url, content_type, status) == expected
