"""A settled cluster costs the API server nothing (issue 24 item 1): 20 groups on the real control plane, every
one Running with its driver's pod reported, then 30 s in which the operator (reconciler, health prober each
second, autoscaler) makes no write at all."""

from __future__ import annotations

import time
from typing import Any

import pytest
from iwg_operator import metrics
from iwg_operator.kube import WRITE_VERBS

from tests.cluster.waiting import eventually, steady
from tests.iwg_operator.conftest import Groups

pytestmark = pytest.mark.cluster

GROUPS = 20
QUIET_SECONDS = 30


def operator_writes() -> dict[tuple[str, str, str], float]:
    """The operator's own write requests so far, by (verb, resource, code)."""
    counts = {}
    for family in metrics.API_REQUESTS.collect():
        for sample in family.samples:
            labels = sample.labels
            if sample.name.endswith("_total") and labels["verb"] in WRITE_VERBS:
                counts[(labels["verb"], labels["resource"], labels["code"])] = sample.value
    return counts


def settled(groups: Groups) -> bool:
    """Every group Running with both replicas ready, and its driver's pod reported: the Deployment's pod comes
    from the controller manager's ReplicaSet controller after the workers, and the DriverAvailable condition
    then changes (NoDriverPod -> DriverDown here: simulated GPU nodes are tainted, drivers stay Pending)."""
    items = groups.custom.list_namespaced_custom_object(
        "inference.iwg.dev", "v1alpha1", groups.namespace, "inferenceworkergroups"
    )["items"]
    if len(items) != GROUPS:
        return False
    for item in items:
        status = item.get("status") or {}
        driver = {c["type"]: c for c in status.get("conditions") or []}.get("DriverAvailable") or {}
        if status.get("phase") != "Running" or status.get("readyReplicas") != 2:
            return False
        if driver.get("reason") in (None, "NoDriverPod"):
            return False
    return True


def test_twenty_settled_groups_cause_no_writes_for_thirty_seconds(
    scheduler: Any, gpu_nodes: list[str], groups: Groups, operator: Any
) -> None:
    for index in range(GROUPS):
        groups.create(
            f"q{index:02d}",
            replicas=2,
            worldSize=2,
            worker={"gpus": 0},  # 80 pods: more than the 32 simulated GPUs
            scheduling={
                "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]
            },
            # Probed each second. Simulated pods' addresses are on loopback, where any process of the machine
            # listening on all interfaces at the health port answers (and, busy, may then time out): a threshold
            # no test run reaches keeps such a stranger from getting a pod replaced.
            health={"periodSeconds": 1, "timeoutSeconds": 1, "failureThreshold": 100},
            autoscaling={"enabled": True, "minReplicas": 2, "maxReplicas": 2},
        )
    eventually(lambda: settled(groups), timeout=180, what="every group Running with its driver pod reported")
    # The supervisor's first autoscaler round (ScalingActive) and the last status writes land: no write for 5 s.
    before = steady(operator_writes, for_s=5, timeout=60, what="the operator's writes after settling")
    time.sleep(QUIET_SECONDS)
    after = operator_writes()
    written = {key: n - before.get(key, 0) for key, n in after.items() if n != before.get(key, 0)}
    assert not written, f"writes in a {QUIET_SECONDS} s quiet window: {written}"
    for index in range(GROUPS):
        groups.delete(f"q{index:02d}")
