"""What the chart's RBAC lets the operator's ServiceAccount do, as the real API server's authorizer answers it
(a SubjectAccessReview, what `kubectl auth can-i --as` asks): with watchNamespaces nothing outside those namespaces; with
the default (every namespace) the same rules in every namespace (issue 30, item 11)."""

from __future__ import annotations

import pytest
from kubernetes import client
from kubernetes.client import ApiClient

from tests.cluster.control_plane import ControlPlane
from tests.helm import chart

pytestmark = pytest.mark.cluster

# What a tenant could most abuse through the operator's identity: run pods, read or replace Secrets.
SENSITIVE = [("create", "pods"), ("delete", "pods"), ("get", "secrets"), ("list", "secrets"),
             ("create", "secrets"), ("delete", "secrets")]  # fmt: skip


def _can(
    k8s: ApiClient, subject: str, verb: str, resource: str, namespace: str, subresource: str = ""
) -> bool:
    """The API server's authorizer on one request of `subject` (a SubjectAccessReview)."""
    plural, _, group = resource.partition(".")
    review = client.V1SubjectAccessReview(
        spec=client.V1SubjectAccessReviewSpec(
            user=subject,
            groups=["system:serviceaccounts", f"system:serviceaccounts:{subject.split(':')[2]}"],
            resource_attributes=client.V1ResourceAttributes(
                verb=verb, group=group, resource=plural, subresource=subresource or None, namespace=namespace
            ),
        )
    )
    answer = client.AuthorizationV1Api(k8s).create_subject_access_review(review)
    return bool(answer.status.allowed)


def test_the_operator_can_touch_only_the_namespaces_it_watches(
    control_plane: ControlPlane, k8s: ApiClient, namespace: str
) -> None:
    core = client.CoreV1Api(k8s)
    watched, other = f"{namespace[:50]}-watched", f"{namespace[:50]}-other"
    for name in (watched, other):
        core.create_namespace(client.V1Namespace(metadata=client.V1ObjectMeta(name=name)))
    release, env = "iwg-scope", control_plane.env()
    subject = f"system:serviceaccount:{namespace}:{release}-iwg-operator"
    try:
        chart.helm("install", release, str(chart.CHART), "--namespace", namespace,
                   "--set", f"watchNamespaces={{{watched}}}", env=env)  # fmt: skip
        for verb, resource in SENSITIVE:
            assert _can(k8s, subject, verb, resource, watched), (verb, resource, watched)
            assert not _can(k8s, subject, verb, resource, other), (verb, resource, other)
            assert not _can(k8s, subject, verb, resource, "kube-system"), (verb, resource)
        assert not _can(k8s, subject, "list", "inferenceworkergroups.inference.iwg.dev", other)
        chart.helm("uninstall", release, "--namespace", namespace, env=env)

        # The default (watchNamespaces empty): a ClusterRole, so the same rules in every namespace, kube-system's
        # Secrets included. values.yaml and docs/operations.md say so.
        chart.helm("install", release, str(chart.CHART), "--namespace", namespace, env=env)
        for verb, resource in SENSITIVE:
            assert _can(k8s, subject, verb, resource, other), (verb, resource, other)
            assert _can(k8s, subject, verb, resource, "kube-system"), (verb, resource)
        # Nothing beyond the rules: no Secret update or patch, no other kinds' writes.
        for verb, resource in [("update", "secrets"), ("patch", "secrets"), ("create", "roles"),
                               ("create", "serviceaccounts")]:  # fmt: skip
            assert not _can(k8s, subject, verb, resource, other), (verb, resource)
        assert not _can(k8s, subject, "create", "pods", other, "exec")
    finally:
        chart.helm("uninstall", release, "--namespace", namespace, "--ignore-not-found", env=env)
        for name in (watched, other):
            core.delete_namespace(name, propagation_policy="Background")
