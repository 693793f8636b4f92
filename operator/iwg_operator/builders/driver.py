"""The group's driver: a one-pod Deployment (command `iwg-driver`) and its Service."""

from __future__ import annotations

from iwg_operator import labels
from iwg_operator.api import wiring
from iwg_operator.api.v1alpha1 import MAX_REPLICAS
from iwg_operator.builders.common import (
    ADMIN_TOKEN_KEY,
    CURVE_MOUNT,
    Group,
    Manifest,
    driver_name,
    field_env,
    metadata,
    model_env,
    model_volume,
    resources,
    restricted_container_security,
    restricted_pod_security,
    secret_name,
    tmp_volume,
    with_spec_hash,
)


def driver_env(group: Group) -> list[Manifest]:
    spec = group.spec
    batching = spec.driver.batching
    # The driver binds both sockets on its pod IP (never on all interfaces); workers connect via the Service.
    bind = f"$({wiring.POD_IP})"
    return [
        {"name": wiring.GROUP, "value": group.name},
        field_env(wiring.NAMESPACE, "metadata.namespace"),
        field_env(wiring.POD_NAME, "metadata.name"),
        field_env(wiring.POD_IP, "status.podIP"),
        # The replicas the driver admits: with autoscaling the most it may reach, so that the autoscaler's
        # changes of spec.replicas never change (and so restart) the driver.
        # The bound on replica indices the driver accepts, not the current count: the driver routes only to
        # replicas whose workers joined, so scaling (kubectl scale, HPA, the autoscaler) never changes its pod
        # template, and the driver is never restarted with requests in flight.
        {"name": wiring.REPLICAS, "value": str(MAX_REPLICAS)},
        {"name": wiring.WORLD_SIZE, "value": str(spec.world_size)},
        {"name": wiring.HTTP_PORT, "value": str(spec.driver.port)},
        {"name": wiring.RPC_ENDPOINT, "value": f"tcp://{bind}:{wiring.DEFAULT_RPC_PORT}"},
        {"name": wiring.RESPONSE_ENDPOINT, "value": f"tcp://{bind}:{wiring.DEFAULT_RESPONSE_PORT}"},
        {"name": wiring.CURVE_DIR, "value": CURVE_MOUNT},
        {"name": wiring.ADMIN_TOKEN_FILE, "value": f"{CURVE_MOUNT}/{ADMIN_TOKEN_KEY}"},
        {"name": wiring.MAX_BATCH_SIZE, "value": str(batching.max_batch_size)},
        {"name": wiring.MAX_WAIT_MS, "value": str(batching.max_wait_ms)},
        {"name": wiring.MAX_QUEUE, "value": str(batching.max_queue)},
        *model_env(group),
        {"name": "HOME", "value": "/tmp"},
    ]


def driver_deployment(group: Group) -> Manifest:
    spec = group.spec
    name = driver_name(group.name)
    pod_labels = labels.group_labels(group.name, labels.COMPONENT_DRIVER)
    model_volumes, model_mounts = model_volume(group)
    http_get = {"port": "http", "scheme": "HTTP"}
    container: Manifest = {
        "name": "driver",
        "image": spec.driver.image or spec.worker.image,
        "imagePullPolicy": spec.worker.image_pull_policy,
        "command": ["iwg-driver"],
        "env": driver_env(group),
        "ports": [
            {"name": "http", "containerPort": spec.driver.port, "protocol": "TCP"},
            {"name": "rpc", "containerPort": wiring.DEFAULT_RPC_PORT, "protocol": "TCP"},
            {"name": "response", "containerPort": wiring.DEFAULT_RESPONSE_PORT, "protocol": "TCP"},
        ],
        "resources": resources(spec.driver.cpu, spec.driver.memory, spec.driver.tmp_size),
        "livenessProbe": {
            "httpGet": {**http_get, "path": "/healthz"},
            "periodSeconds": 10,
            "failureThreshold": 3,
        },
        "readinessProbe": {
            "httpGet": {**http_get, "path": "/readyz"},
            "periodSeconds": 5,
            "failureThreshold": 2,
        },
        "securityContext": restricted_container_security(),
        "volumeMounts": [
            {"name": "tmp", "mountPath": "/tmp"},
            {"name": "curve", "mountPath": CURVE_MOUNT, "readOnly": True},
            *model_mounts,
        ],
    }
    manifest: Manifest = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": metadata(group, name, labels.COMPONENT_DRIVER),
        "spec": {
            "replicas": 1,
            # One driver owns the group's sockets: never two at once.
            "strategy": {"type": "Recreate"},
            "selector": {"matchLabels": labels.driver_selector(group.name)},
            "template": {
                "metadata": {"labels": pod_labels},
                "spec": {
                    "enableServiceLinks": False,
                    "automountServiceAccountToken": False,
                    "securityContext": restricted_pod_security(),
                    "containers": [container],
                    "volumes": [
                        tmp_volume(spec.driver.tmp_size),
                        {
                            "name": "curve",
                            "secret": {"secretName": secret_name(group.name), "defaultMode": 0o440},
                        },
                        *model_volumes,
                    ],
                },
            },
        },
    }
    return with_spec_hash(manifest)


def driver_service(group: Group) -> Manifest:
    manifest: Manifest = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": metadata(group, driver_name(group.name), labels.COMPONENT_DRIVER),
        "spec": {
            "type": "ClusterIP",
            "selector": labels.driver_selector(group.name),
            "ports": [
                {"name": "http", "port": group.spec.driver.port, "targetPort": "http", "protocol": "TCP"},
                {"name": "rpc", "port": wiring.DEFAULT_RPC_PORT, "targetPort": "rpc", "protocol": "TCP"},
                {
                    "name": "response",
                    "port": wiring.DEFAULT_RESPONSE_PORT,
                    "targetPort": "response",
                    "protocol": "TCP",
                },
            ],
        },
    }
    return with_spec_hash(manifest)
