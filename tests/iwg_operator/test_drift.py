"""Comparing an owned object with its manifest, and the patch that puts a hand edit back (pure)."""

from __future__ import annotations

import copy
from decimal import Decimal
from typing import Any

from iwg_operator import builders, drift
from iwg_operator.controller import group_from_body

from tests.iwg_operator.test_controller import body


def served(manifest: dict[str, Any]) -> dict[str, Any]:
    """The manifest as an API server would show it: defaults, status, other managers' labels, normalised
    quantities."""
    seen = copy.deepcopy(manifest)
    seen["metadata"].update(uid="c1", resourceVersion="7", managedFields=[{"manager": "iwg-operator"}])
    seen["metadata"]["labels"]["team"] = "a"
    seen["metadata"].setdefault("annotations", {})["deployment.kubernetes.io/revision"] = "1"
    seen["status"] = {"replicas": 1}
    return seen


def test_quantities_compare_by_value() -> None:
    assert drift.quantity("500m") == Decimal("0.5")
    assert drift.quantity("1Gi") == 2**30
    assert drift.quantity("1e3") == 1000
    assert drift.quantity("http") is None
    assert drift.matches({"cpu": "0.5", "memory": "1024Mi"}, {"cpu": "500m", "memory": "1Gi"})
    assert not drift.matches({"cpu": "1"}, {"cpu": "2"})


def test_a_digest_that_reads_as_a_huge_quantity_compares_as_text() -> None:
    """A hex digest of digits and one "e" matches the quantity syntax with an exponent no Decimal context
    holds: its comparison raised decimal.Overflow out of the reconcile (a digest in the key-rotation unit test,
    in the full run of c2dbb01; about one 16-character hex digest in 1,200 reads so)."""
    assert drift.quantity("3e43715140629679") is None
    desired = {"metadata": {"annotations": {"inference.iwg.dev/spec-hash": "3e43715140629679"}}}
    assert drift.matches(desired, copy.deepcopy(desired))
    assert not drift.matches(
        desired, {"metadata": {"annotations": {"inference.iwg.dev/spec-hash": "3e4371"}}}
    )


def test_an_object_as_served_is_in_sync_and_a_hand_edit_is_not() -> None:
    group = group_from_body(body(replicas=1))
    for manifest in (builders.driver_deployment(group), builders.driver_service(group)):
        seen = served(manifest)
        assert drift.in_sync(manifest, seen)
        # Another owner beside the group's is no drift either.
        seen["metadata"]["ownerReferences"].append({"uid": "other"})
        assert drift.in_sync(manifest, seen) and drift.owned_by(seen, group.uid)
    service = served(builders.driver_service(group))
    service["spec"]["ports"][0]["port"] = 9999
    assert not drift.in_sync(builders.driver_service(group), service)
    deployment = served(builders.driver_deployment(group))
    deployment["spec"]["replicas"] = 3
    assert not drift.in_sync(builders.driver_deployment(group), deployment)
    del deployment["metadata"]["labels"]["app.kubernetes.io/managed-by"]
    assert not drift.in_sync(builders.driver_deployment(group), deployment)


def test_what_an_apply_could_not_mend_is_accepted_once() -> None:
    group = group_from_body(body(replicas=1))
    manifest = builders.driver_service(group)
    left = served(manifest)
    left["spec"]["ports"].append({"name": "extra", "port": 1})  # another manager's port
    accepted = drift.accepted_after_apply(manifest, left)
    assert accepted is not None and drift.in_sync(manifest, left, accepted)
    left["spec"]["ports"][0]["port"] = 2
    assert not drift.in_sync(manifest, left, accepted), "a further edit is drift again"
    assert drift.accepted_after_apply(manifest, served(manifest)) is None


def test_the_repair_patch_puts_back_lists_whole_and_selectors_exact_and_keeps_other_labels() -> None:
    group = group_from_body(body(replicas=1))
    manifest = builders.driver_service(group)
    edited = served(manifest)
    edited["spec"]["clusterIP"] = "10.96.0.7"
    edited["spec"]["selector"] = {"app": "somebody-else"}
    edited["spec"]["ports"] = [{"name": "http", "port": 9999, "targetPort": "http", "protocol": "TCP"}]
    patch = drift.repair_patch(manifest, edited)
    assert patch["spec"]["ports"] == manifest["spec"]["ports"]
    assert patch["spec"]["selector"] == {**manifest["spec"]["selector"], "app": None}
    assert "clusterIP" not in patch["spec"], "fields the operator does not set stay"
    assert "team" not in patch["metadata"]["labels"], "other labels stay"
    assert "ownerReferences" not in patch["metadata"]


def test_status_updates_keep_the_metadata_digest_and_edits_change_it() -> None:
    group = group_from_body(body(replicas=1))
    deployment = served(builders.driver_deployment(group))
    assert drift.metadata_digest(deployment) is None, "no generation: always compared"
    deployment["metadata"]["generation"] = 1
    seen = drift.metadata_digest(deployment)
    deployment["status"] = {"replicas": 1, "readyReplicas": 1}
    assert drift.metadata_digest(deployment) == seen
    deployment["metadata"]["generation"] = 2  # a spec edit
    assert drift.metadata_digest(deployment) != seen
    deployment["metadata"]["generation"] = 1
    deployment["metadata"]["labels"]["app.kubernetes.io/managed-by"] = "someone"
    assert drift.metadata_digest(deployment) != seen
