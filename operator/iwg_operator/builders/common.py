"""What every builder shares: the group as builders see it, object names, ownership and hashing."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import Any

from iwg_operator import labels
from iwg_operator.api import v1alpha1 as api
from iwg_operator.api import wiring

Manifest = dict[str, Any]

CURVE_MOUNT = "/etc/iwg/curve"
ADMIN_TOKEN_KEY = "admin.token"
# The group's Secret: the driver's keypair, the workers' keypair (Z85) and the driver's admin token. Each pod
# mounts its own pair as curve.key / curve.pub and the other side's public key as peer.pub (wiring).
DRIVER_SECRET_KEY = "driver.key"
DRIVER_PUBLIC_KEY = "driver.pub"
WORKER_SECRET_KEY = "worker.key"
WORKER_PUBLIC_KEY = "worker.pub"
CONFIG_KEY = "group.json"
# The worker image's user and group (`USER 65532:65532` in worker_image/Dockerfile), as the chart runs the
# operator image: the pods run as the user the image's files were made for.
RUN_AS_USER = 65532


@dataclass(frozen=True)
class Group:
    """The group as the builders need it: identity plus the validated spec."""

    name: str
    namespace: str
    uid: str
    spec: api.InferenceWorkerGroupSpec
    generation: int = 1
    keys: str = ""  # hash of the public keys in the group's Secret (`keys_digest`); "" before it is read

    @property
    def served_name(self) -> str:
        return self.spec.model.served_name or self.name


@dataclass(frozen=True)
class BuildSettings:
    """Cluster facts the builders cannot read from the spec."""

    cluster_domain: str = "cluster.local"
    operator_namespace: str = "iwg-system"
    operator_pod_labels: dict[str, str] = field(default_factory=lambda: dict(labels.OPERATOR_POD_LABELS))


def pod_name(group: str, replica: int, rank: int) -> str:
    return f"{group}-r{replica}-w{rank}"


def driver_name(group: str) -> str:
    return f"{group}-driver"


def drivers_service_name(group: str) -> str:
    """The headless Service of the driver pods: workers resolve it to every driver and connect to each."""
    return f"{group}-drivers"


def driver_pdb_name(group: str) -> str:
    return f"{group}-driver"


def headless_service_name(group: str) -> str:
    return f"{group}-workers"


def secret_name(group: str) -> str:
    return f"{group}-curve"


def config_map_name(group: str) -> str:
    return f"{group}-config"


def network_policy_name(group: str) -> str:
    return f"{group}-workers"


def pdb_name(group: str) -> str:
    return f"{group}-workers"


def driver_host(group: Group, settings: BuildSettings) -> str:
    """What workers connect to: the drivers' headless Service, whose name resolves to every driver pod."""
    return f"{drivers_service_name(group.name)}.{group.namespace}.svc.{settings.cluster_domain}"


def pod_host(group: Group, replica: int, rank: int, settings: BuildSettings) -> str:
    """Per-pod DNS name through the headless Service (hostname + subdomain)."""
    service = headless_service_name(group.name)
    return f"{pod_name(group.name, replica, rank)}.{service}.{group.namespace}.svc.{settings.cluster_domain}"


def owner_reference(group: Group) -> Manifest:
    return {
        "apiVersion": api.API_VERSION,
        "kind": api.KIND,
        "name": group.name,
        "uid": group.uid,
        "controller": True,
        "blockOwnerDeletion": True,
    }


def metadata(group: Group, name: str, component: str, extra_labels: dict[str, str] | None = None) -> Manifest:
    return {
        "name": name,
        "namespace": group.namespace,
        "labels": labels.group_labels(group.name, component) | (extra_labels or {}),
        "ownerReferences": [owner_reference(group)],
    }


def stable_hash(value: object, length: int = 10) -> str:
    text = json.dumps(value, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:length]


def keys_digest(data: dict[str, str]) -> str:
    """A hash of the public keys in a Secret's data (base64 values): what pods carry, so new keys roll them.
    Public keys only: the hash says nothing of a secret key."""
    return stable_hash({key: data.get(key) for key in (DRIVER_PUBLIC_KEY, WORKER_PUBLIC_KEY)})


def curve_volume(group: Group, items: list[tuple[str, str]]) -> Manifest:
    """The group's Secret as a volume holding only `items` ((Secret key, file) pairs): a pod sees the keys of
    its own side and never the other side's secret key."""
    return {
        "name": "curve",
        "secret": {
            "secretName": secret_name(group.name),
            "defaultMode": 0o440,
            "items": [{"key": key, "path": path} for key, path in items],
        },
    }


def keys_annotations(group: Group) -> dict[str, str]:
    return {labels.KEYS: group.keys} if group.keys else {}


def with_spec_hash(manifest: Manifest) -> Manifest:
    """Stamp a child with the hash of its desired content, so an unchanged child is never written."""
    digest = stable_hash(manifest, 16)
    annotations = manifest["metadata"].setdefault("annotations", {})
    annotations[labels.SPEC_HASH] = digest
    return manifest


def service(group: Group, name: str, component: str, spec: Manifest) -> Manifest:
    """A Service of the group's, stamped with its spec hash."""
    return with_spec_hash(
        {"apiVersion": "v1", "kind": "Service", "metadata": metadata(group, name, component), "spec": spec}
    )


def restricted_container_security() -> Manifest:
    return {
        "allowPrivilegeEscalation": False,
        "capabilities": {"drop": ["ALL"]},
        "readOnlyRootFilesystem": True,
        "runAsNonRoot": True,
        "runAsUser": RUN_AS_USER,
        "runAsGroup": RUN_AS_USER,
        "seccompProfile": {"type": "RuntimeDefault"},
    }


def restricted_pod_security() -> Manifest:
    return {
        "runAsNonRoot": True,
        "runAsUser": RUN_AS_USER,
        "runAsGroup": RUN_AS_USER,
        "fsGroup": RUN_AS_USER,
        "seccompProfile": {"type": "RuntimeDefault"},
    }


def resources(cpu: str | None, memory: str | None, tmp_size: str, gpus: int = 0) -> Manifest:
    """Requests equal to limits; ephemeral storage is /tmp's size (the root filesystem is read-only)."""
    amounts: dict[str, str] = {}
    if cpu is not None:
        amounts["cpu"] = cpu
    if memory is not None:
        amounts["memory"] = memory
    amounts["ephemeral-storage"] = tmp_size
    if gpus:
        amounts["nvidia.com/gpu"] = str(gpus)
    return {"requests": dict(amounts), "limits": dict(amounts)}


def tmp_volume(tmp_size: str) -> Manifest:
    """/tmp: the one writable directory of a pod whose root filesystem is read-only, bounded."""
    return {"name": "tmp", "emptyDir": {"sizeLimit": tmp_size}}


def field_env(name: str, field_path: str) -> Manifest:
    return {"name": name, "valueFrom": {"fieldRef": {"fieldPath": field_path}}}


def model_env(group: Group) -> list[Manifest]:
    model = group.spec.model
    env = [
        {"name": wiring.MODEL_TASK, "value": model.task},
        {"name": wiring.MODEL_PATH, "value": model.path},
        {"name": wiring.SERVED_NAME, "value": group.served_name},
        {"name": wiring.DTYPE, "value": model.dtype},
    ]
    if model.kv_cache is not None and model.kv_cache.blocks is not None:
        env.append({"name": wiring.KV_CACHE_BLOCKS, "value": str(model.kv_cache.blocks)})
    if model.kv_cache is not None and model.kv_cache.memory_fraction is not None:
        env.append({"name": wiring.KV_CACHE_MEMORY_FRACTION, "value": str(model.kv_cache.memory_fraction)})
    return env


def model_volume(group: Group) -> tuple[list[Manifest], list[Manifest]]:
    """(volumes, mounts) for the model's PersistentVolumeClaim, if the spec names one."""
    volume = group.spec.model.volume
    if volume is None:
        return [], []
    return (
        [{"name": "model", "persistentVolumeClaim": {"claimName": volume.claim_name, "readOnly": True}}],
        [{"name": "model", "mountPath": volume.mount_path, "readOnly": True}],
    )
