"""Label and annotation keys on everything the operator creates, and the selectors built from them.

The health prober, the autoscaler and the Helm chart select pods with these; keep them stable.
"""

from __future__ import annotations

from typing import Final

PREFIX: Final = "inference.iwg.dev"

NAME: Final = "app.kubernetes.io/name"
INSTANCE: Final = "app.kubernetes.io/instance"
COMPONENT: Final = "app.kubernetes.io/component"
MANAGED_BY: Final = "app.kubernetes.io/managed-by"
PART_OF: Final = "app.kubernetes.io/part-of"

GROUP: Final = f"{PREFIX}/group"
REPLICA: Final = f"{PREFIX}/replica"
RANK: Final = f"{PREFIX}/rank"
REVISION: Final = f"{PREFIX}/revision"

# Annotation holding the hash of a child's desired manifest: equal hash, no write.
SPEC_HASH: Final = f"{PREFIX}/spec-hash"
WORLD_SIZE_ANNOTATION: Final = f"{PREFIX}/world-size"
# Which creation of its rank a worker pod is: higher than every earlier pod of that rank (drivers refuse older
# ones: wiring.INCARNATION).
INCARNATION: Final = f"{PREFIX}/incarnation"
# Which creation of its replica a worker pod belongs to (wiring.REPLICA_EPOCH): shared by the ranks made together.
REPLICA_EPOCH: Final = f"{PREFIX}/replica-epoch"
# On a group: set or change it (any value, e.g. the time) and the operator makes new CURVE keys and a new admin
# token and rolls every pod. On the group's Secret: the value its keys were made for.
ROTATE_KEYS: Final = f"{PREFIX}/rotate-keys"
# On worker pods and the driver's pod template: a hash of the public keys they mount, so new keys roll them.
KEYS: Final = f"{PREFIX}/keys"

APP_NAME: Final = "iwg"
MANAGER: Final = "iwg-operator"
COMPONENT_WORKER: Final = "worker"
COMPONENT_DRIVER: Final = "driver"
COMPONENT_GANG: Final = "gang"  # the PodGroups (one per replica) of gang placement

# Labels of the operator's own pods (the Helm chart sets them); the NetworkPolicy admits these.
OPERATOR_POD_LABELS: Final = {NAME: "iwg-operator"}


def group_labels(group: str, component: str) -> dict[str, str]:
    return {
        NAME: APP_NAME,
        INSTANCE: group,
        COMPONENT: component,
        MANAGED_BY: MANAGER,
        PART_OF: APP_NAME,
        GROUP: group,
    }


def worker_selector(group: str) -> dict[str, str]:
    return {GROUP: group, COMPONENT: COMPONENT_WORKER}


def gang_selector(group: str) -> dict[str, str]:
    return {GROUP: group, COMPONENT: COMPONENT_GANG}


def driver_selector(group: str) -> dict[str, str]:
    return {GROUP: group, COMPONENT: COMPONENT_DRIVER}


def selector_string(labels: dict[str, str]) -> str:
    return ",".join(f"{key}={value}" for key, value in sorted(labels.items()))
