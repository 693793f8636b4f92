"""The group's driver: a Deployment of `spec.driver.replicas` pods (command `iwg-driver`), the Service clients
use, the headless Service workers resolve to reach every driver, and the drivers' PodDisruptionBudget."""

from __future__ import annotations

from iwg_operator import labels
from iwg_operator.api import wiring
from iwg_operator.api.v1alpha1 import MAX_REPLICAS
from iwg_operator.builders.common import (
    ADMIN_TOKEN_KEY,
    CURVE_MOUNT,
    DRIVER_PUBLIC_KEY,
    DRIVER_SECRET_KEY,
    WORKER_PUBLIC_KEY,
    Group,
    Manifest,
    curve_volume,
    driver_name,
    driver_pdb_name,
    drivers_service_name,
    field_env,
    keys_annotations,
    metadata,
    model_env,
    model_volume,
    resources,
    restricted_container_security,
    restricted_pod_security,
    service,
    tmp_volume,
    with_spec_hash,
)

# Seconds from SIGTERM to SIGKILL for a driver pod beyond its lame-duck time: its drain, with room to exit.
DRIVER_GRACE_AFTER_LAME_DUCK_S = int(wiring.DRIVER_DRAIN_S) + 5


def driver_grace_seconds(group: Group) -> int:
    """SIGTERM to SIGKILL: the driver's lame-duck time, its drain of admitted requests, and room to exit."""
    return group.spec.driver.lame_duck_seconds + DRIVER_GRACE_AFTER_LAME_DUCK_S


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
        {"name": wiring.ROUTING_POLICY, "value": spec.driver.routing.policy},
        {"name": wiring.ROUTING_LOAD_BOUND, "value": str(spec.driver.routing.load_bound)},
        {"name": wiring.DRIVER_LAME_DUCK, "value": str(spec.driver.lame_duck_seconds)},
        # A group that may be at zero replicas: the driver holds requests until one serves (scale from zero).
        # Set from minReplicas, not replicas, so that scaling never changes the driver's pod template.
        {
            "name": wiring.ACTIVATION_TIMEOUT,
            "value": str(
                spec.autoscaling.activation_timeout_seconds if spec.autoscaling.min_replicas == 0 else 0
            ),
        },
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
        # Ready only while a replica serves through it (/readyz): a surge pod takes no client before then.
        "readinessProbe": {
            "httpGet": {**http_get, "path": "/readyz"},
            "periodSeconds": 1,
            "failureThreshold": 2,
        },
        "securityContext": restricted_container_security(),
        "volumeMounts": [
            {"name": "tmp", "mountPath": "/tmp"},
            {"name": "curve", "mountPath": CURVE_MOUNT, "readOnly": True},
            *model_mounts,
        ],
    }
    replicas = spec.driver.replicas
    manifest: Manifest = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": metadata(group, name, labels.COMPONENT_DRIVER),
        "spec": {
            "replicas": replicas,
            # One new pod at a time, none taken away before its replacement is Ready: a single driver is doubled
            # for the moment of a rollout rather than gone (nothing in the pod, ports or volumes, needs it alone).
            "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": 0, "maxSurge": 1}},
            "selector": {"matchLabels": labels.driver_selector(group.name)},
            "template": {
                "metadata": {"labels": pod_labels, "annotations": keys_annotations(group)},
                "spec": {
                    "enableServiceLinks": False,
                    "automountServiceAccountToken": False,
                    "securityContext": restricted_pod_security(),
                    # SIGTERM to SIGKILL: the driver's lame-duck moment and its drain of admitted requests.
                    "terminationGracePeriodSeconds": driver_grace_seconds(group),
                    "containers": [container],
                    "volumes": [
                        tmp_volume(spec.driver.tmp_size),
                        curve_volume(
                            group,
                            [
                                (DRIVER_SECRET_KEY, wiring.CURVE_SECRET_FILE),
                                (DRIVER_PUBLIC_KEY, wiring.CURVE_PUBLIC_FILE),
                                (WORKER_PUBLIC_KEY, wiring.CURVE_PEER_FILE),
                                (ADMIN_TOKEN_KEY, ADMIN_TOKEN_KEY),
                            ],
                        ),
                        *model_volumes,
                    ],
                },
            },
        },
    }
    return with_spec_hash(manifest)


def driver_service(group: Group) -> Manifest:
    return service(
        group,
        driver_name(group.name),
        labels.COMPONENT_DRIVER,
        {
            "type": "ClusterIP",
            "selector": labels.driver_selector(group.name),
            "ports": [
                {"name": "http", "port": group.spec.driver.port, "targetPort": "http", "protocol": "TCP"},
            ],
        },
    )


def drivers_service(group: Group) -> Manifest:
    """Headless, and listing drivers before they are Ready: a driver is Ready only once workers joined it."""
    return service(
        group,
        drivers_service_name(group.name),
        labels.COMPONENT_DRIVER,
        {
            "clusterIP": "None",
            "publishNotReadyAddresses": True,
            "selector": labels.driver_selector(group.name),
            "ports": _zmq_ports(),
        },
    )


def driver_disruption_budget(group: Group) -> Manifest:
    """With several drivers a voluntary disruption (a node drain) keeps one; a single driver is not held
    (minAvailable 0), so that draining its node is never blocked."""
    minimum = 1 if group.spec.driver.replicas > 1 else 0
    manifest: Manifest = {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": metadata(group, driver_pdb_name(group.name), labels.COMPONENT_DRIVER),
        "spec": {"minAvailable": minimum, "selector": {"matchLabels": labels.driver_selector(group.name)}},
    }
    return with_spec_hash(manifest)


def _zmq_ports() -> list[Manifest]:
    return [
        {"name": "rpc", "port": wiring.DEFAULT_RPC_PORT, "targetPort": "rpc", "protocol": "TCP"},
        {
            "name": "response",
            "port": wiring.DEFAULT_RESPONSE_PORT,
            "targetPort": "response",
            "protocol": "TCP",
        },
    ]
