"""Pure builders: (group spec, observed state) -> the Kubernetes objects the group should own."""

from iwg_operator.builders.common import BuildSettings, Group, Manifest, keys_digest, pod_name
from iwg_operator.builders.driver import (
    driver_deployment,
    driver_disruption_budget,
    driver_service,
    drivers_service,
)
from iwg_operator.builders.gang import pod_group, pod_group_name, workload, workload_name
from iwg_operator.builders.support import (
    config_map,
    curve_secret,
    driver_network_policy,
    headless_service,
    network_policy,
    pod_disruption_budget,
    secret_is_current,
)
from iwg_operator.builders.workers import revision, worker_pod

__all__ = [
    "BuildSettings",
    "Group",
    "Manifest",
    "config_map",
    "curve_secret",
    "driver_deployment",
    "driver_disruption_budget",
    "driver_network_policy",
    "driver_service",
    "drivers_service",
    "headless_service",
    "keys_digest",
    "network_policy",
    "pod_disruption_budget",
    "pod_group",
    "pod_group_name",
    "pod_name",
    "revision",
    "secret_is_current",
    "worker_pod",
    "workload",
    "workload_name",
]
