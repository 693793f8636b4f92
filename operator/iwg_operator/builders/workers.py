"""Worker pods: one per (replica, rank), named `<group>-r<replica>-w<rank>`."""

from __future__ import annotations

import copy
import re

from iwg_operator import labels
from iwg_operator.api import wiring
from iwg_operator.builders.common import (
    CURVE_MOUNT,
    DRIVER_PUBLIC_KEY,
    WORKER_PUBLIC_KEY,
    WORKER_SECRET_KEY,
    BuildSettings,
    Group,
    Manifest,
    curve_volume,
    driver_host,
    field_env,
    headless_service_name,
    keys_annotations,
    metadata,
    model_env,
    model_volume,
    pod_host,
    pod_name,
    resources,
    restricted_container_security,
    restricted_pod_security,
    stable_hash,
    tmp_volume,
)

GPU_RESOURCE = "nvidia.com/gpu"
GPU_PRODUCT_LABEL = "nvidia.com/gpu.product"
HOSTNAME_TOPOLOGY = "kubernetes.io/hostname"
HEALTH_PORT_NAME = "health"
# Model loading can take minutes; the startup probe holds liveness off until the worker first answers.
STARTUP_PROBE_BUDGET_SECONDS = 900
LIVENESS_LAG_PERIODS = 2
# A worker the kubelet restarts for liveness has answered no health check for failureThreshold + 2 periods: it
# drains nothing, so it gets this long after SIGTERM (the probe's own terminationGracePeriodSeconds) instead of
# the pod's drain grace, and a hung worker is back in seconds, not after the drain's 50.
LIVENESS_KILL_GRACE_SECONDS = 5


def revision(group: Group, settings: BuildSettings) -> str:
    """Hash of everything that shapes a worker pod; pods of another revision are rolled."""
    spec = group.spec
    shaping = {
        "model": spec.model.to_manifest(),
        "worldSize": spec.world_size,
        # Egress is the NetworkPolicy's, applied to running pods in place: not a pod's shape.
        "worker": {k: v for k, v in spec.worker.to_manifest().items() if k != "egress"},
        "scheduling": spec.scheduling.to_manifest(),
        "health": {
            "period": spec.health.period_seconds,
            "timeout": spec.health.timeout_seconds,
            "failures": spec.health.failure_threshold,
        },
        "domain": settings.cluster_domain,
    }
    if group.keys:
        shaping["keys"] = group.keys  # new keys (a rotation) roll the pods
    return stable_hash(shaping)


def worker_env(group: Group, replica: int, rank: int, settings: BuildSettings) -> list[Manifest]:
    spec = group.spec
    driver = driver_host(group, settings)
    env: list[Manifest] = [
        {"name": wiring.GROUP, "value": group.name},
        field_env(wiring.NAMESPACE, "metadata.namespace"),
        field_env(wiring.POD_NAME, "metadata.name"),
        field_env(wiring.POD_IP, "status.podIP"),
        {"name": wiring.REPLICA, "value": str(replica)},
        {"name": wiring.RANK, "value": str(rank)},
        {"name": wiring.WORLD_SIZE, "value": str(spec.world_size)},
        {"name": wiring.RPC_ENDPOINT, "value": f"tcp://{driver}:{wiring.DEFAULT_RPC_PORT}"},
        {"name": wiring.RESPONSE_ENDPOINT, "value": f"tcp://{driver}:{wiring.DEFAULT_RESPONSE_PORT}"},
        {"name": wiring.CURVE_DIR, "value": CURVE_MOUNT},
        {"name": wiring.HEALTH_PORT, "value": str(wiring.DEFAULT_HEALTH_PORT)},
        {"name": wiring.MASTER_ADDR, "value": pod_host(group, replica, 0, settings)},
        {"name": wiring.MASTER_PORT, "value": str(wiring.DEFAULT_MASTER_PORT)},
        {"name": wiring.TORCH_RANK, "value": str(rank)},
        {"name": wiring.TORCH_WORLD_SIZE, "value": str(spec.world_size)},
        # One rank per pod: its GPUs (spec.worker.gpus, numbered from 0 inside the pod) are its own, and
        # it runs on the first.
        {"name": wiring.LOCAL_RANK, "value": "0"},
        *model_env(group),
        # Workers only (not in model_env): the driver does not read it, so a change rolls no driver.
        {"name": wiring.ENGINE, "value": spec.model.engine},
        {"name": wiring.DEVICE, "value": spec.worker.device},
    ]
    if spec.model.chat_template:  # workers only: they render chats
        env.append({"name": wiring.CHAT_TEMPLATE, "value": spec.model.chat_template})
    if spec.model.enforce_eager:
        # Workers only, like IWG_ENGINE; written only when true, as `iwg serve`'s workers get it.
        env.append({"name": wiring.ENFORCE_EAGER, "value": "1"})
    if spec.worker.worker_cls:
        env.append({"name": wiring.WORKER_CLS, "value": spec.worker.worker_cls})
    if spec.worker.worker_extension_cls:
        env.append({"name": wiring.WORKER_EXTENSION_CLS, "value": spec.worker.worker_extension_cls})
    env.append({"name": "HOME", "value": "/tmp"})
    env.extend({"name": e.name, "value": e.value} for e in spec.worker.env)
    return env


def tolerations(group: Group) -> list[Manifest]:
    result = [t.to_manifest() for t in group.spec.scheduling.tolerations]
    if group.spec.worker.gpus > 0:
        # As the ExtendedResourceToleration admission plugin would: GPU nodes carry this taint.
        result.append({"key": GPU_RESOURCE, "operator": "Exists", "effect": "NoSchedule"})
    return result


def node_selector(group: Group) -> dict[str, str]:
    selector = dict(group.spec.scheduling.node_selector)
    if group.spec.scheduling.gpu_product:
        selector[GPU_PRODUCT_LABEL] = group.spec.scheduling.gpu_product
    return selector


def affinity(group: Group, replica: int) -> Manifest | None:
    """The user's affinity plus, when asked, a required pod affinity keeping one replica on one node."""
    scheduling = group.spec.scheduling
    result: Manifest = copy.deepcopy(scheduling.affinity) if scheduling.affinity else {}
    if scheduling.colocate_ranks and group.spec.world_size > 1:
        pod_affinity = result.setdefault("podAffinity", {})
        terms = pod_affinity.setdefault("requiredDuringSchedulingIgnoredDuringExecution", [])
        terms.append(
            {
                "labelSelector": {"matchLabels": {labels.GROUP: group.name, labels.REPLICA: str(replica)}},
                "topologyKey": HOSTNAME_TOPOLOGY,
            }
        )
    return result or None


def worker_pod(
    group: Group,
    replica: int,
    rank: int,
    settings: BuildSettings,
    pod_group: str | None = None,
    incarnation: int = 0,
    epoch: int = 0,
) -> Manifest:
    """One rank's pod; `pod_group` names the replica's PodGroup under gang placement (immutable on a pod);
    `incarnation` numbers this creation of the rank (0: none), for the drivers to fence older ones; `epoch` this
    creation of the replica (0: none), for its ranks to meet only each other (wiring.REPLICA_EPOCH)."""
    spec = group.spec
    name = pod_name(group.name, replica, rank)
    rev = revision(group, settings)
    meta = metadata(
        group,
        name,
        labels.COMPONENT_WORKER,
        {labels.REPLICA: str(replica), labels.RANK: str(rank), labels.REVISION: rev},
    )
    meta["annotations"] = {labels.WORLD_SIZE_ANNOTATION: str(spec.world_size), **keys_annotations(group)}
    env = worker_env(group, replica, rank, settings)
    if incarnation:
        meta["annotations"][labels.INCARNATION] = str(incarnation)
        env.append({"name": wiring.INCARNATION, "value": str(incarnation)})
    if epoch:
        meta["annotations"][labels.REPLICA_EPOCH] = str(epoch)
        env.append({"name": wiring.REPLICA_EPOCH, "value": str(epoch)})
    model_volumes, model_mounts = model_volume(group)
    health = spec.health
    http_get = {"port": HEALTH_PORT_NAME, "scheme": "HTTP"}
    container: Manifest = {
        "name": "worker",
        "image": spec.worker.image,
        "imagePullPolicy": spec.worker.image_pull_policy,
        "command": ["iwg-worker"],
        "env": env,
        "ports": [
            {"name": HEALTH_PORT_NAME, "containerPort": wiring.DEFAULT_HEALTH_PORT, "protocol": "TCP"},
            {"name": "rendezvous", "containerPort": wiring.DEFAULT_MASTER_PORT, "protocol": "TCP"},
        ],
        "resources": resources(spec.worker.cpu, spec.worker.memory, spec.worker.tmp_size, spec.worker.gpus),
        "startupProbe": {
            "httpGet": {**http_get, "path": "/healthz"},
            "periodSeconds": health.period_seconds,
            "timeoutSeconds": health.timeout_seconds,
            "failureThreshold": max(1, STARTUP_PROBE_BUDGET_SECONDS // health.period_seconds),
        },
        "livenessProbe": {
            "httpGet": {**http_get, "path": "/healthz"},
            "periodSeconds": health.period_seconds,
            "timeoutSeconds": health.timeout_seconds,
            # Two periods behind the operator's prober, which replaces the pod (or its replica) at
            # failureThreshold; an in-place restart by the kubelet is the fallback while no operator runs.
            "failureThreshold": health.failure_threshold + LIVENESS_LAG_PERIODS,
            "terminationGracePeriodSeconds": LIVENESS_KILL_GRACE_SECONDS,
        },
        "readinessProbe": {
            "httpGet": {**http_get, "path": "/readyz"},
            "periodSeconds": health.period_seconds,
            "timeoutSeconds": health.timeout_seconds,
            "failureThreshold": health.failure_threshold,
        },
        "securityContext": restricted_container_security(),
        # Why the worker ended: the message it wrote, else the end of its log (which ends with the reason).
        "terminationMessagePath": wiring.TERMINATION_MESSAGE_PATH,
        "terminationMessagePolicy": "FallbackToLogsOnError",
        "volumeMounts": [
            {"name": "dshm", "mountPath": "/dev/shm"},
            {"name": "tmp", "mountPath": "/tmp"},
            {"name": "curve", "mountPath": CURVE_MOUNT, "readOnly": True},
            *model_mounts,
        ],
    }
    pod_spec: Manifest = {
        "hostname": name,
        "subdomain": headless_service_name(group.name),
        "restartPolicy": "Always",
        "enableServiceLinks": False,
        "automountServiceAccountToken": False,
        # SIGTERM to SIGKILL: the worker's drain (its replica's running generation requests) and its exit.
        "terminationGracePeriodSeconds": round(wiring.WORKER_DRAIN_S) + wiring.WORKER_GRACE_AFTER_DRAIN_S,
        "securityContext": restricted_pod_security(),
        "containers": [container],
        "volumes": [
            {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": spec.worker.shm_size}},
            tmp_volume(spec.worker.tmp_size),
            curve_volume(
                group,
                [
                    (WORKER_SECRET_KEY, wiring.CURVE_SECRET_FILE),
                    (WORKER_PUBLIC_KEY, wiring.CURVE_PUBLIC_FILE),
                    (DRIVER_PUBLIC_KEY, wiring.CURVE_PEER_FILE),
                ],
            ),
            *model_volumes,
        ],
    }
    selector = node_selector(group)
    if selector:
        pod_spec["nodeSelector"] = selector
    tolerated = tolerations(group)
    if tolerated:
        pod_spec["tolerations"] = tolerated
    placement = affinity(group, replica)
    if placement:
        pod_spec["affinity"] = placement
    if spec.scheduling.priority_class_name:
        pod_spec["priorityClassName"] = spec.scheduling.priority_class_name
    if spec.scheduling.scheduler_name:
        pod_spec["schedulerName"] = spec.scheduling.scheduler_name
    if pod_group is not None:
        pod_spec["schedulingGroup"] = {"podGroupName": pod_group}
    return {"apiVersion": "v1", "kind": "Pod", "metadata": meta, "spec": pod_spec}


# Pod fields the operator fills from the group's fields, as the API server names them in a refusal. What it
# copies under another name that the pod could refuse (spec.scheduling.gpuProduct into the node selector) is
# checked at admission already.
_FROM_GROUP = (
    (r"spec\.nodeSelector", "spec.scheduling.nodeSelector"),
    (r"spec\.tolerations", "spec.scheduling.tolerations"),
    (r"spec\.affinity", "spec.scheduling.affinity"),
    (r"spec\.priorityClassName", "spec.scheduling.priorityClassName"),
    (r"spec\.schedulerName", "spec.scheduling.schedulerName"),
    (r"spec\.containers\[0\]\.image", "spec.worker.image"),
    (r"spec\.containers\[0\]\.resources\.(?:limits|requests)\[cpu\]", "spec.worker.cpu"),
    (r"spec\.containers\[0\]\.resources\.(?:limits|requests)\[memory\]", "spec.worker.memory"),
)


def name_group_fields(message: str) -> str:
    """A refusal of a worker pod with the pod's fields renamed to the group's fields they came from: the user
    reads the field they wrote (`spec.scheduling.tolerations[0].key`), not the pod's (`spec.tolerations`)."""
    for pod_field, group_field in _FROM_GROUP:
        message = re.sub(r"(?<![\w.\]])" + pod_field + r"(?!\w)", group_field, message)
    return message
