"""The group's CURVE keys on the real control plane: distinct driver and worker keypairs, an old one-keypair
Secret migrated, and `rotate-keys` making new keys and rolling every pod (issue 30, item 11)."""

from __future__ import annotations

import base64
from typing import Any

import pytest
import zmq
from iwg_operator import builders, labels
from iwg_operator.api import v1alpha1 as api
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from tests.cluster.waiting import eventually
from tests.iwg_operator.conftest import Groups, running_operator

pytestmark = pytest.mark.cluster

TOLERATE_GPU = [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]


def _b64(value: bytes) -> str:
    return base64.b64encode(value).decode()


def test_an_old_secret_is_migrated_and_rotate_keys_rolls_every_pod_onto_new_keys(
    scheduler: Any,
    gpu_nodes: list[str],
    controller_manager: Any,
    iwg_crd: Any,
    control_plane: Any,
    namespace: str,
    monkeypatch: pytest.MonkeyPatch,
    groups: Groups,
    k8s: Any,
) -> None:
    core, apps = client.CoreV1Api(k8s), client.AppsV1Api(k8s)
    ns, name = groups.namespace, "keys"
    body = groups.create(name, replicas=2, worker={"gpus": 0}, scheduling={"tolerations": TOLERATE_GPU})
    # The group as an operator before distinct keys left it: one keypair for the driver and every worker.
    public, secret = zmq.curve_keypair()
    owner = {"apiVersion": api.API_VERSION, "kind": api.KIND, "name": name, "uid": body["metadata"]["uid"],
             "controller": True, "blockOwnerDeletion": True}  # fmt: skip
    core.create_namespaced_secret(ns, {
        "metadata": {"name": f"{name}-curve", "labels": labels.group_labels(name, labels.COMPONENT_WORKER),
                     "ownerReferences": [owner]},
        "immutable": True,
        "data": {"curve.pub": _b64(public), "curve.key": _b64(secret), "admin.token": _b64(b"old-token")},
    })  # fmt: skip

    def stored() -> dict[str, str]:
        """The Secret's data ({} while it is gone: an immutable Secret is migrated by deleting and creating it)."""
        try:
            return dict(core.read_namespaced_secret(f"{name}-curve", ns).data or {})
        except ApiException as error:
            if error.status != 404:
                raise
            return {}

    def rolled_onto(digest: str, old_uids: set[str]) -> bool:
        pods = groups.live_pods(name)
        try:
            template = apps.read_namespaced_deployment(f"{name}-driver", ns).spec.template.metadata
        except ApiException as error:  # not created yet: the operator is slow under load
            if error.status != 404:
                raise
            return False
        return (
            len(pods) == 2
            and all((p.metadata.annotations or {}).get(labels.KEYS) == digest for p in pods)
            and not {p.metadata.uid for p in pods} & old_uids
            and (template.annotations or {}).get(labels.KEYS) == digest
            and (groups.get(name).get("status") or {}).get("readyReplicas") == 2
        )

    with running_operator(control_plane, namespace, monkeypatch):
        # Migrated: the one-keypair Secret replaced by the driver's and the workers' pairs.
        eventually(lambda: "driver.pub" in stored(), what="the Secret migrated to two keypairs")
        first = stored()
        assert set(first) == {"driver.pub", "driver.key", "worker.pub", "worker.key", "admin.token"}
        keys = {k: base64.b64decode(v) for k, v in first.items()}
        assert zmq.curve_public(keys["driver.key"]) == keys["driver.pub"]
        assert zmq.curve_public(keys["worker.key"]) == keys["worker.pub"]
        assert keys["driver.pub"] != keys["worker.pub"] and public not in (
            keys["driver.pub"],
            keys["worker.pub"],
        )
        digest = builders.keys_digest(first)
        eventually(lambda: rolled_onto(digest, set()), what="pods and driver on the migrated keys")
        uids = {p.metadata.uid for p in groups.live_pods(name)}

        # Rotation: the annotation makes new keys (and admin token) and rolls the driver and every worker.
        groups.custom.patch_namespaced_custom_object(
            api.GROUP, api.VERSION, ns, api.PLURAL, name,
            {"metadata": {"annotations": {labels.ROTATE_KEYS: "2026-12-04T16:00:00Z"}}},
        )  # fmt: skip
        eventually(
            lambda: stored().get("driver.pub", first["driver.pub"]) != first["driver.pub"], what="new keys"
        )
        second = core.read_namespaced_secret(f"{name}-curve", ns)
        assert second.metadata.annotations[labels.ROTATE_KEYS] == "2026-12-04T16:00:00Z"
        assert all(second.data[k] != first[k] for k in first), "every key and the admin token are new"
        eventually(lambda: rolled_onto(builders.keys_digest(second.data), uids), what="every pod rolled")
        # The same value again changes nothing more.
        assert stored() == second.data
    groups.delete(name)
