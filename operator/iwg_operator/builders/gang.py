"""Gang placement by the cluster's own scheduler (scheduling.k8s.io/v1beta1, Kubernetes >= 1.37 with the
GenericWorkload feature): one Workload per group, one PodGroup per replica; worker pods name their PodGroup.

The scheduler binds none of a PodGroup's pods until `minCount` (the world size) of them fit.
Field names follow k8s.io/api v0.37.2 `scheduling/v1beta1/types.go`.
"""

from __future__ import annotations

from iwg_operator import labels
from iwg_operator.api import v1alpha1 as api
from iwg_operator.builders.common import Group, Manifest, metadata, with_spec_hash

SCHEDULING_GROUP = "scheduling.k8s.io"
SCHEDULING_VERSION = "v1beta1"
SCHEDULING_API_VERSION = f"{SCHEDULING_GROUP}/{SCHEDULING_VERSION}"
TEMPLATE_NAME = "workers"  # the Workload's single pod-group template: one replica's ranks


def workload_name(group: str) -> str:
    return group


def pod_group_name(group: str, replica: int) -> str:
    return f"{group}-r{replica}"


def gang_policy(group: Group) -> Manifest:
    return {"gang": {"minCount": group.spec.world_size}}


def priority(group: Group) -> Manifest:
    """The worker pods' priority class, on the template and the PodGroup: the scheduler takes a gang's
    priority from its PodGroup (the priority admission plugin resolves the class into `spec.priority`) and
    refuses to place a gang whose pods' priority differs from it. Immutable on both objects."""
    name = group.spec.scheduling.priority_class_name
    return {"priorityClassName": name} if name else {}


def workload(group: Group) -> Manifest:
    """The group's Workload: one template (a replica's ranks) with a gang policy of minCount = worldSize.
    Its templates are fixed after creation, so a world-size change replaces it (spec-hash annotation)."""
    return with_spec_hash(
        {
            "apiVersion": SCHEDULING_API_VERSION,
            "kind": "Workload",
            "metadata": metadata(group, workload_name(group.name), labels.COMPONENT_GANG),
            "spec": {
                "controllerRef": {"apiGroup": api.GROUP, "kind": api.KIND, "name": group.name},
                "podGroupTemplates": [
                    {"name": TEMPLATE_NAME, "schedulingPolicy": gang_policy(group), **priority(group)}
                ],
            },
        }
    )


def pod_group(group: Group, replica: int) -> Manifest:
    """The PodGroup of one replica: its worldSize pods are bound all together or not at all."""
    return {
        "apiVersion": SCHEDULING_API_VERSION,
        "kind": "PodGroup",
        "metadata": metadata(
            group, pod_group_name(group.name, replica), labels.COMPONENT_GANG, {labels.REPLICA: str(replica)}
        ),
        "spec": {
            "workloadRef": {"workloadName": workload_name(group.name), "templateName": TEMPLATE_NAME},
            "schedulingPolicy": gang_policy(group),
            **priority(group),
        },
    }
