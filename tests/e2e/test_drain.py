"""`kubectl drain` of each node in turn under load (issue 29, item 2), on the real control plane (its disruption
controller computes the workers' PodDisruptionBudget) with the node agent's two nodes, seen as a client in the
cluster sees it: through the group's Service (a ServiceProxy that does not retry a refused connect, as
kube-proxy does not). SmolLM2 sharded over 3 ranks under streamed chat by clients with the openai client's
default 2 retries: each drain must finish within kubectl's timeout (before the integer minAvailable it never
did: the budget allowed nothing), the group's pods end on the other node, no request fails, and at no moment
during a drain are both worker replicas without all their ranks Ready. The MiniLM group's drains run on real
kubelets (tests/realnodes/test_day2.py); this group's six ranks do not fit one real 2-CPU node (see there).
"""

from __future__ import annotations

import sys
from typing import Any

import pytest
from kubernetes import client
from kubernetes.client import ApiClient

from tests.e2e.drains import drain_each_node, load_seconds
from tests.e2e.harness import (
    STEADY_HEALTH,
    ChatLoad,
    create,
    diagnose,
    sharded_smollm2,
    wait_serving,
)
from tests.e2e.service_proxy import ServiceProxy
from tests.iwg_operator.conftest import Groups
from tests.nodeagent.fixture import NodeAgentProcess

pytestmark = [pytest.mark.cluster, pytest.mark.slow]


def test_draining_each_node_in_turn_moves_a_world_size_3_group_a_replica_at_a_time_under_streams(
    node_agent: NodeAgentProcess, control_plane: Any, k8s: ApiClient, workspace: str, e2e_operator: Any
) -> None:
    """2 replicas of SmolLM2 sharded over 3 ranks each (6 worker pods, 2 drivers), streamed chat through the
    Service by a client with the openai client's default 2 retries. An eviction takes one rank; the operator
    tears that rank's replica down and builds it whole on the other node; the budget (minAvailable 5 of 6
    pods) refuses the next eviction until it serves. At every look (0.2 s) at least one replica has all three
    ranks Ready (maxUnavailable 1), both drains finish, and no stream fails."""
    groups, core = Groups(k8s, workspace), client.CoreV1Api(k8s)
    name = "drain-tp"
    manifest = sharded_smollm2(name, 3, {**STEADY_HEALTH, "restartPolicy": "Replica"})
    manifest["spec"]["replicas"] = 2
    manifest["spec"]["driver"] = {**manifest["spec"]["driver"], "replicas": 2}
    create(control_plane, workspace, manifest)
    wait_serving(groups, core, node_agent, name, replicas=2, timeout=400)
    proxy = ServiceProxy(
        node_agent.gateway, f"{name}-driver.{workspace}.svc.cluster.local", 8000, retry_refused=False
    ).start()
    # One client streaming without pause: a request always running or arriving (more clients only cost the
    # suite's other tests CPU: six ranks on two cores).
    load = ChatLoad(
        "127.0.0.1",
        "smollm2",
        clients=1,
        max_tokens=16,
        port=proxy.listen_port,
        timeout=120,
        max_retries=2,
        max_seconds=load_seconds(400),
    ).start()
    try:
        drains = drain_each_node(
            node_agent.nodes,
            control_plane,
            core,
            workspace,
            name,
            load,
            lambda: wait_serving(groups, core, node_agent, name, replicas=2, timeout=400),
            lambda: diagnose(node_agent, core, workspace),
            world_size=3,
        )
    finally:
        proxy.stop()
    print(f"{proxy.connections} connections, {proxy.refused} refused", file=sys.__stderr__)
    assert load.failures == [], (len(load.failures), load.failures[:5])
    for drain in drains:
        assert drain["answered"] >= 5, drains
        assert drain["fewest_ready"] is not None and drain["fewest_ready"] >= 1, drains
