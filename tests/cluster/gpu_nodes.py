"""Simulated GPU nodes: Node objects that kwok keeps Ready and whose bound pods it runs."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from kubernetes import client
from kubernetes.client import ApiClient
from kubernetes.client.exceptions import ApiException

GPU_RESOURCE = "nvidia.com/gpu"
GPU_PRODUCT_LABEL = "nvidia.com/gpu.product"
GPU_PRODUCT = "NVIDIA-H100-80GB-HBM3"
GPU_TAINT = {"key": GPU_RESOURCE, "value": "present", "effect": "NoSchedule"}
NODE_PREFIX = "kwok-gpu-"
NOT_READY_TAINT = "node.kubernetes.io/not-ready"


def gpu_node_manifest(name: str, gpus: int, extra_labels: dict[str, str] | None = None) -> dict[str, Any]:
    capacity = {
        "cpu": "64",
        "memory": "512Gi",
        "pods": "110",
        "ephemeral-storage": "1Ti",
        GPU_RESOURCE: str(gpus),
    }
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {
            "name": name,
            # kwok manages only the nodes that carry its annotation (see --manage-nodes-with-annotation-selector).
            "annotations": {GpuNodePool.KWOK_ANNOTATION: "fake", "node.alpha.kubernetes.io/ttl": "0"},
            "labels": {
                "type": "kwok",
                "kubernetes.io/arch": "amd64",
                "kubernetes.io/os": "linux",
                "kubernetes.io/hostname": name,
                "node-role.kubernetes.io/agent": "",
                GPU_PRODUCT_LABEL: GPU_PRODUCT,
                "nvidia.com/gpu.count": str(gpus),
                "nvidia.com/gpu.present": "true",
                **(extra_labels or {}),
            },
        },
        "spec": {"taints": [GPU_TAINT]},
        "status": {"capacity": capacity, "allocatable": capacity},
    }


class GpuNodePool:
    KWOK_ANNOTATION = "kwok.x-k8s.io/node"

    def __init__(self, api: ApiClient) -> None:
        self._api = api
        self._core = client.CoreV1Api(api)

    def ensure(
        self,
        *,
        count: int,
        gpus_per_node: int,
        alive: Callable[[], bool],
        timeout: float = 60,
        prefix: str = NODE_PREFIX,
        labels: dict[str, str] | None = None,
    ) -> list[str]:
        """Creates the nodes `<prefix>0..count-1` that are missing (with `labels` besides the GPU ones);
        returns all names once each is Ready with its GPUs."""
        names = [f"{prefix}{i}" for i in range(count)]
        for name in names:
            try:
                node = client.V1Node.from_dict(gpu_node_manifest(name, gpus_per_node, labels))
                assert node is not None
                self._core.create_node(node)
            except ApiException as exc:
                if exc.status != 409:
                    raise
        deadline = time.monotonic() + timeout
        while True:
            pending = [n for n in names if not self._ready_with_gpus(n, gpus_per_node)]
            if not pending:
                for name in names:
                    self._lift_not_ready_taint(name)
                return names
            if not alive():
                raise RuntimeError("kwok exited before the GPU nodes became Ready")
            if time.monotonic() > deadline:
                raise RuntimeError(f"GPU nodes not Ready after {timeout:.0f}s: {pending}")
            time.sleep(0.2)

    def _ready_with_gpus(self, name: str, gpus: int) -> bool:
        status = self._core.read_node(name).status or client.V1NodeStatus()
        conditions = {c.type: c.status for c in (status.conditions or [])}
        allocatable = status.allocatable or {}
        return conditions.get("Ready") == "True" and allocatable.get(GPU_RESOURCE) == str(gpus)

    def _lift_not_ready_taint(self, name: str) -> None:
        """Admission taints every new node not-ready; the node-lifecycle controller, which would lift
        it once the node is Ready, is not run here (it would also need kubelet-like heartbeats)."""
        spec = self._core.read_node(name).to_dict(serialize=True)["spec"]
        taints = spec.get("taints") or []
        kept = [t for t in taints if t["key"] != NOT_READY_TAINT]
        if kept != taints:
            self._core.patch_node(name, {"spec": {"taints": kept}})

    def delete(self, names: list[str]) -> None:
        for name in names:
            try:
                self._core.delete_node(name)
            except ApiException as exc:
                if exc.status != 404:
                    raise

    def close(self) -> None:
        self._api.close()  # type: ignore[no-untyped-call]
