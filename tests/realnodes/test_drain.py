"""`kubectl drain` of each real node in turn under load: the real control plane's eviction API and disruption
controller (the workers' and drivers' PodDisruptionBudgets), the kubelets' graceful termination, and clients
reaching the group through its Service as a client on a node does (the first node's kube-proxy: a refused
connect is the client's failure; no retries). Each drain finishes within kubectl's timeout, the group's pods
end on the other node, no request fails, and at no moment during a drain is no worker replica Ready.

The same test of a SmolLM2 group sharded over 3 ranks stays on the node agent (tests/e2e/test_drain.py): its
six ranks of 500m and two drivers (requests equal to limits) do not fit one real 2-CPU node once the other is
drained; a third node, or smaller ranks, would bring it here (not tried).
"""

from __future__ import annotations

import sys

import pytest

from tests.e2e.drains import drain_each_node, load_seconds
from tests.e2e.harness import MODEL, Load, group_manifest
from tests.realnodes.fixture import RealCluster, real_cluster
from tests.realnodes.nodes import WORKER_IMAGE

__all__ = ["real_cluster"]

pytestmark = [pytest.mark.cluster, pytest.mark.slow]


def test_draining_each_real_node_in_turn_under_load_loses_no_request(real_cluster: RealCluster) -> None:
    cluster, core = real_cluster, real_cluster.core
    name = "drain"
    # Two workers and two drivers fit one node (2 CPUs) when the other is drained.
    manifest = group_manifest(
        name,
        replicas=2,
        worker={"image": WORKER_IMAGE, "imagePullPolicy": "Never", "cpu": "500m"},
        driver={"replicas": 2, "cpu": "500m"},
    )
    cluster.apply(manifest)
    port = cluster.wait_serving(name, replicas=2)
    load = Load(  # no retries
        "127.0.0.1", MODEL, clients=2, inputs=4, port=port, max_seconds=load_seconds(180)
    ).start()
    drains = drain_each_node(
        cluster.nodes.names,
        cluster.control_plane,
        core,
        cluster.namespace,
        name,
        load,
        lambda: cluster.wait_serving(name, replicas=2, timeout=180),
        cluster.diagnose,
    )
    print(f"through the Service: {load.ok} answered, {len(load.failures)} failed", file=sys.__stderr__)
    assert load.failures == [], (len(load.failures), load.failures[:5])
    # The second drain moved every pod: 2 workers and 2 drivers.
    assert drains[-1]["evicted"] == 4, drains
    for drain in drains:
        assert drain["answered"] >= 20, drains
        assert drain["fewest_ready"] is not None and drain["fewest_ready"] >= 1, drains
