"""Scheduling onto simulated GPU nodes, and garbage collection of owned objects."""

from __future__ import annotations

import ipaddress
from typing import Any, TypeVar

import pytest
import yaml
from kubernetes import client
from kubernetes.client import ApiClient
from kubernetes.client.exceptions import ApiException

from tests.cluster.control_plane import KWOK_STAGES, ControlPlane
from tests.cluster.gpu_nodes import GPU_PRODUCT, GPU_PRODUCT_LABEL, GPU_RESOURCE
from tests.cluster.waiting import eventually

pytestmark = pytest.mark.cluster

T = TypeVar("T")


def gpu_pod(name: str, gpus: int, tolerate: bool = True) -> client.V1Pod:
    return client.V1Pod(
        metadata=client.V1ObjectMeta(name=name),
        spec=client.V1PodSpec(
            containers=[
                client.V1Container(
                    name="worker",
                    image="ghcr.io/example/iwg-worker:test",
                    resources=client.V1ResourceRequirements(limits={GPU_RESOURCE: str(gpus)}),
                )
            ],
            tolerations=[client.V1Toleration(key=GPU_RESOURCE, operator="Exists", effect="NoSchedule")]
            if tolerate
            else None,
        ),
    )


@pytest.fixture
def core(k8s: ApiClient) -> client.CoreV1Api:
    return client.CoreV1Api(k8s)


def test_gpu_nodes_are_ready_with_their_gpus(gpu_nodes: list[str], core: client.CoreV1Api) -> None:
    assert len(gpu_nodes) == 4
    for name in gpu_nodes:
        node = core.read_node(name).to_dict(serialize=True)
        assert node["metadata"]["labels"][GPU_PRODUCT_LABEL] == GPU_PRODUCT
        assert node["status"]["allocatable"][GPU_RESOURCE] == "8"
        assert [(t["key"], t["effect"]) for t in node["spec"]["taints"]] == [(GPU_RESOURCE, "NoSchedule")]


def test_pod_requesting_two_gpus_is_bound_to_a_gpu_node_and_runs(
    scheduler: ControlPlane,
    controller_manager: ControlPlane,
    gpu_nodes: list[str],
    core: client.CoreV1Api,
    namespace: str,
) -> None:
    core.create_namespaced_pod(namespace, gpu_pod("two-gpus", 2))

    def running() -> dict[str, Any] | None:
        pod = core.read_namespaced_pod("two-gpus", namespace).to_dict(serialize=True)
        return pod if pod["status"]["phase"] == "Running" else None

    pod = eventually(running, what="pod Running")
    assert pod["spec"]["nodeName"] in gpu_nodes
    kwok_options = next(yaml.safe_load_all(KWOK_STAGES.read_text()))["options"]
    assert ipaddress.ip_address(pod["status"]["podIP"]) in ipaddress.ip_network(kwok_options["cidr"])

    # Graceful deletion needs the node's agent to confirm; kwok plays that part too.
    core.delete_namespaced_pod("two-gpus", namespace)

    def gone() -> bool:
        try:
            core.read_namespaced_pod("two-gpus", namespace)
        except ApiException as exc:
            return bool(exc.status == 404)
        return False

    eventually(gone, what="pod deleted")


def _unschedulable_reason(core: client.CoreV1Api, name: str, namespace: str) -> str | None:
    status = core.read_namespaced_pod(name, namespace).to_dict(serialize=True)["status"]
    for cond in status.get("conditions") or []:
        if cond["type"] == "PodScheduled" and cond["status"] == "False":
            return f"{status['phase']}/{cond['reason']}: {cond['message']}"
    return None


def test_pod_requesting_more_gpus_than_any_node_has_stays_pending(
    scheduler: ControlPlane,
    controller_manager: ControlPlane,
    gpu_nodes: list[str],
    core: client.CoreV1Api,
    namespace: str,
) -> None:
    core.create_namespaced_pod(namespace, gpu_pod("hundred-gpus", 100))
    core.create_namespaced_pod(namespace, gpu_pod("untolerated", 1, tolerate=False))

    too_big = eventually(lambda: _unschedulable_reason(core, "hundred-gpus", namespace), what="Unschedulable")
    assert too_big.startswith("Pending/Unschedulable:")
    assert f"Insufficient {GPU_RESOURCE}" in too_big
    # Without the toleration even one GPU is out of reach: the nodes' taint is what keeps others off.
    untainted = eventually(
        lambda: _unschedulable_reason(core, "untolerated", namespace), what="Unschedulable"
    )
    assert "untolerated taint" in untainted
    assert (
        core.read_namespaced_pod("hundred-gpus", namespace).to_dict(serialize=True)["spec"].get("nodeName")
        is None
    )


def test_deleting_an_owner_garbage_collects_its_child(
    controller_manager: ControlPlane, core: client.CoreV1Api, namespace: str
) -> None:
    owner = core.create_namespaced_config_map(
        namespace, client.V1ConfigMap(metadata=client.V1ObjectMeta(name="owner"))
    )
    uid = owner.to_dict(serialize=True)["metadata"]["uid"]
    ref = client.V1OwnerReference(api_version="v1", kind="ConfigMap", name="owner", uid=uid)
    for name, refs in (("child", [ref]), ("bystander", None)):
        core.create_namespaced_config_map(
            namespace, client.V1ConfigMap(metadata=client.V1ObjectMeta(name=name, owner_references=refs))
        )

    core.delete_namespaced_config_map("owner", namespace)

    def child_gone() -> bool:
        try:
            core.read_namespaced_config_map("child", namespace)
        except ApiException as exc:
            return bool(exc.status == 404)
        return False

    eventually(child_gone, what="child garbage-collected")
    assert (
        core.read_namespaced_config_map("bystander", namespace).to_dict()["metadata"]["name"] == "bystander"
    )
