"""The group's supporting objects: headless Service, CURVE Secret, ConfigMap, NetworkPolicies, PDB."""

from __future__ import annotations

import base64
import json
from collections.abc import Mapping
from typing import Any

from iwg_operator import labels
from iwg_operator.api import wiring
from iwg_operator.builders.common import (
    ADMIN_TOKEN_KEY,
    CONFIG_KEY,
    DRIVER_PUBLIC_KEY,
    DRIVER_SECRET_KEY,
    WORKER_PUBLIC_KEY,
    WORKER_SECRET_KEY,
    BuildSettings,
    Group,
    Manifest,
    config_map_name,
    driver_name,
    headless_service_name,
    metadata,
    network_policy_name,
    pdb_name,
    secret_name,
    service,
    with_spec_hash,
)
from iwg_operator.builders.workers import revision


def headless_service(group: Group) -> Manifest:
    """Per-pod DNS for the workers (rank 0 is the torch.distributed rendezvous)."""
    return service(
        group,
        headless_service_name(group.name),
        labels.COMPONENT_WORKER,
        {
            "clusterIP": "None",
            # Ranks need each other's names before any of them is ready.
            "publishNotReadyAddresses": True,
            "selector": labels.worker_selector(group.name),
            "ports": [
                {"name": "rendezvous", "port": wiring.DEFAULT_MASTER_PORT, "protocol": "TCP"},
                {"name": "health", "port": wiring.DEFAULT_HEALTH_PORT, "protocol": "TCP"},
            ],
        },
    )


def curve_secret(
    group: Group,
    driver: tuple[bytes, bytes],
    worker: tuple[bytes, bytes],
    admin_token: str,
    rotation: str = "",
) -> Manifest:
    """The driver's and the workers' CURVE keypairs ((public, secret), Z85) and the driver's admin token.
    Immutable: new keys (a rotation, `rotation` being the group's `rotate-keys` value they are made for) come
    in a new Secret."""

    def encode(value: bytes) -> str:
        return base64.b64encode(value).decode()

    manifest: Manifest = {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": metadata(group, secret_name(group.name), labels.COMPONENT_WORKER),
        "type": "Opaque",
        "immutable": True,
        "data": {
            DRIVER_PUBLIC_KEY: encode(driver[0]),
            DRIVER_SECRET_KEY: encode(driver[1]),
            WORKER_PUBLIC_KEY: encode(worker[0]),
            WORKER_SECRET_KEY: encode(worker[1]),
            ADMIN_TOKEN_KEY: encode(admin_token.encode()),
        },
    }
    if rotation:
        manifest["metadata"]["annotations"] = {labels.ROTATE_KEYS: rotation}
    return manifest


def secret_is_current(secret: Mapping[str, Any], rotation: str) -> bool:
    """Whether a stored Secret has both keypairs (not the one-keypair form of earlier versions) and was made for
    the group's `rotate-keys` value."""
    data = secret.get("data") or {}
    made_for = (secret.get("metadata", {}).get("annotations") or {}).get(labels.ROTATE_KEYS, "")
    has_keys = all(
        data.get(k) for k in (DRIVER_PUBLIC_KEY, DRIVER_SECRET_KEY, WORKER_PUBLIC_KEY, WORKER_SECRET_KEY)
    )
    return has_keys and made_for == rotation


def config_map(group: Group, settings: BuildSettings) -> Manifest:
    """The validated spec (defaults filled in) and revision: a record for people and tools.

    No pod mounts it (every process gets its wiring from env and the Secret), so no pod waits for it.
    """
    manifest: Manifest = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": metadata(group, config_map_name(group.name), labels.COMPONENT_WORKER),
        "data": {
            CONFIG_KEY: json.dumps(
                {"name": group.name, "namespace": group.namespace, "spec": group.spec.to_manifest()},
                sort_keys=True,
                indent=1,
            ),
            "revision": revision(group, settings),
        },
    }
    return with_spec_hash(manifest)


def _operator_peer(settings: BuildSettings) -> Manifest:
    return {
        "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": settings.operator_namespace}},
        "podSelector": {"matchLabels": dict(settings.operator_pod_labels)},
    }


def _tcp(*ports: int) -> list[Manifest]:
    return [{"port": port, "protocol": "TCP"} for port in ports]


def _policy(
    group: Group, name: str, component: str, ingress: list[Manifest], egress: list[Manifest] | None = None
) -> Manifest:
    """Ingress rules, and egress rules unless None (the policy does not govern egress)."""
    selector = labels.driver_selector if component == labels.COMPONENT_DRIVER else labels.worker_selector
    spec: Manifest = {
        "podSelector": {"matchLabels": selector(group.name)},
        "policyTypes": ["Ingress"] if egress is None else ["Ingress", "Egress"],
        "ingress": ingress,
    }
    if egress is not None:
        spec["egress"] = egress
    manifest: Manifest = {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": metadata(group, name, component),
        "spec": spec,
    }
    return with_spec_hash(manifest)


DNS_PORT = 53


def worker_egress(group: Group) -> list[Manifest]:
    """Where a worker may connect: the group's workers (collectives open ports chosen at run time, so any
    port), the group's drivers' ZMQ ports, and DNS.

    DNS goes to port 53 at any address, as the chart's policy for the operator does: a selector of
    kube-system's `k8s-app: kube-dns` pods would miss a NodeLocal DNSCache (a host-network address) and DNS
    pods labelled otherwise, and a worker that cannot resolve its rank 0 or its driver never starts.
    """
    return [
        {"to": [{"podSelector": {"matchLabels": labels.worker_selector(group.name)}}]},
        {
            "to": [{"podSelector": {"matchLabels": labels.driver_selector(group.name)}}],
            "ports": _tcp(wiring.DEFAULT_RPC_PORT, wiring.DEFAULT_RESPONSE_PORT),
        },
        {"ports": [{"port": DNS_PORT, "protocol": "UDP"}, {"port": DNS_PORT, "protocol": "TCP"}]},
    ]


def network_policy(group: Group, settings: BuildSettings) -> Manifest:
    """Worker ports admit only the group's own pods (workers, driver) and the operator (prober); with
    spec.worker.egress Restricted (the default) workers reach only `worker_egress`, with Unrestricted
    anything."""
    return _policy(
        group,
        network_policy_name(group.name),
        labels.COMPONENT_WORKER,
        [
            {"from": [{"podSelector": {"matchLabels": {labels.GROUP: group.name}}}]},
            {"from": [_operator_peer(settings)], "ports": _tcp(wiring.DEFAULT_HEALTH_PORT)},
        ],
        # Unrestricted is one empty rule (any destination, any port) rather than no Egress type: the policy
        # keeps the same fields, so server-side apply replaces the rules both ways (a policy created with
        # rules keeps them, inert, when an apply merely leaves them out: create owns them, not apply).
        worker_egress(group) if group.spec.worker.egress == "Restricted" else [{}],
    )


# A peer without namespaceSelector: the pods of the policy's own namespace.
SAME_NAMESPACE_PEER: Manifest = {"podSelector": {}}


def driver_network_policy(group: Group, settings: BuildSettings) -> Manifest:
    """The driver's HTTP port admits spec.driver.networkPolicy.httpFrom (when empty: the pods of the group's own
    namespace) and the operator (metrics, drains); its ZMQ ports admit only the group's worker pods."""
    http = _tcp(group.spec.driver.port)
    http_from = [peer.to_manifest() for peer in group.spec.driver.network_policy.http_from]
    return _policy(
        group,
        driver_name(group.name),
        labels.COMPONENT_DRIVER,
        [
            {"from": http_from or [SAME_NAMESPACE_PEER], "ports": http},
            {"from": [_operator_peer(settings)], "ports": http},
            {
                "from": [{"podSelector": {"matchLabels": labels.worker_selector(group.name)}}],
                "ports": _tcp(wiring.DEFAULT_RPC_PORT, wiring.DEFAULT_RESPONSE_PORT),
            },
        ],
    )


def pod_disruption_budget(group: Group) -> Manifest:
    """Voluntary evictions may take at most rollout.maxUnavailable replicas at once.

    An integer minAvailable, kept in step with spec.replicas by the operator (the spec hash covers replicas):
    with maxUnavailable the disruption controller takes the expected count from the owner's scale
    subresource, which counts replicas, not pods, and must resolve the group's kind first; with an integer
    minAvailable it counts the pods it selects and needs no owner at all.

    The disruption controller counts pods, and an evicted rank takes its whole replica down, so a budget of
    maxUnavailable replicas is maxUnavailable pods: replicas x worldSize - maxUnavailable must stay. A budget
    of maxUnavailable x worldSize pods would let a drain take one rank from each of worldSize replicas (kubectl
    drain evicts a node's pods at once). With maxUnavailable >= replicas every pod may go."""
    spec = group.spec
    pods = spec.replicas * spec.world_size
    minimum = 0 if spec.rollout.max_unavailable >= spec.replicas else pods - spec.rollout.max_unavailable
    manifest: Manifest = {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": metadata(group, pdb_name(group.name), labels.COMPONENT_WORKER),
        "spec": {
            "minAvailable": minimum,
            "selector": {"matchLabels": labels.worker_selector(group.name)},
        },
    }
    return with_spec_hash(manifest)
