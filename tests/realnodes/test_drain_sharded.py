"""`kubectl drain` of each real node in turn under streamed chat, for a SmolLM2 group sharded over 3 ranks
(issue 29, item 2), on its own cluster of two real kubelets (the e2e lane's, tests/lanes.py). The MiniLM
group's drains are tests/realnodes/test_day2.py.

2 replicas x 3 ranks and 2 drivers, a quarter CPU each (requests equal to limits), so that all eight fit one
2-CPU node once the other is drained. A client streams 4-token answers through the group's Service (the first
node's kube-proxy) with the openai client's default 2 retries. An eviction takes one rank; the operator tears that
rank's replica down and builds it whole on the other node; the workers' budget (minAvailable 5 of 6 pods)
refuses the next eviction until it serves. Each drain finishes within kubectl's timeout, the group ends on the
other node, no stream fails, and at every look (0.2 s) at least one replica has all three ranks Ready.
"""

from __future__ import annotations

import sys

import pytest

from tests.e2e.drains import drain_each_node, load_seconds
from tests.e2e.harness import STEADY_HEALTH, ChatLoad
from tests.realnodes.fixture import RealCluster, cluster, real_cluster, smollm2_on_a_volume

__all__ = ["cluster", "real_cluster"]

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

SERVING_TIMEOUT_S = 400  # a replica of three throttled ranks loads on a machine the other lanes share
QUARTER_CPU = "250m"  # 6 ranks and 2 drivers: the 2 CPUs of one node


@pytest.mark.timeout(2 * SERVING_TIMEOUT_S + load_seconds(SERVING_TIMEOUT_S))
def test_draining_each_real_node_moves_a_world_size_3_group_a_replica_at_a_time_under_streams(
    cluster: RealCluster,
) -> None:
    name = "drain-tp"
    manifest = smollm2_on_a_volume(cluster, name, 3, {**STEADY_HEALTH, "restartPolicy": "Replica"})
    spec = manifest["spec"]
    spec["replicas"] = 2
    spec["worker"] = {**spec["worker"], "cpu": QUARTER_CPU}
    spec["driver"] = {**spec.get("driver", {}), "replicas": 2, "cpu": QUARTER_CPU}
    cluster.apply(manifest)
    port = cluster.wait_serving(name, replicas=2, timeout=SERVING_TIMEOUT_S)
    # One client streaming short answers with a 2-s pause between them. In the whole suite, 16-token streams
    # without pause kept the six quarter-CPU ranks busy through both drains: they slowed every other lane (Ray
    # could not start in its 30 s), and one stream outlasted its rank's 30-s drain under that load (CI of
    # fbf275a). Four tokens take a few seconds; the drains still meet several streams in flight.
    load = ChatLoad(
        "127.0.0.1",
        "smollm2",
        clients=1,
        max_tokens=4,
        pause_s=2.0,
        port=port,
        timeout=120,
        max_retries=2,
        max_seconds=load_seconds(SERVING_TIMEOUT_S),
    ).start()
    drains = drain_each_node(
        cluster.nodes.names,
        cluster.control_plane,
        cluster.core,
        cluster.namespace,
        name,
        load,
        lambda: cluster.wait_serving(name, replicas=2, timeout=SERVING_TIMEOUT_S),
        cluster.diagnose,
        world_size=3,
    )
    print(f"through the Service: {load.ok} answered, {len(load.failures)} failed", file=sys.__stderr__)
    assert load.failures == [], (len(load.failures), load.failures[:5])
    for drain in drains:
        assert drain["answered"] >= 5, drains
        assert drain["fewest_ready"] is not None and drain["fewest_ready"] >= 1, drains
