"""A new worker image rolled out under steady embedding load (issue 29, item 1), with the default single driver,
seen as a client in the cluster sees it: through the group's Service (a ServiceProxy that does not retry a
refused connect, as kube-proxy does not) by clients without retries, so every refused connection, cut
request and 503 counts. The image changes the workers' revision and, the driver's image being the workers'
by default, the driver's pod template: both roll. The node agent runs the same local `iwg-worker` and
`iwg-driver` whatever the image says, so the new image is a new tag, and what is tested is the rollout.

- 2 replicas (maxSurge 0): the driver surges (its new pod Ready before the old one stops), and each worker
  replica is drained in the drivers before its pods are deleted, one at a time: 0 requests lost, and no
  driver retries a batch (a replica deleted undrained cuts its batch in flight, which the driver sends again
  to the other replica: the client would not see it, the drivers' iwg_batch_retries_total does).
- 1 replica with rollout.maxSurge 1: a replica of the new revision serves before the old one is drained; the
  surge replica is drained and removed at the end: 0 requests lost.
"""

from __future__ import annotations

import contextlib
import sys
import time
from typing import Any

import pytest
from kubernetes import client
from kubernetes.client import ApiClient

from tests.cluster.waiting import eventually
from tests.e2e.harness import Load, driver_pods, group_manifest, pod_ready, wait_serving, worker_pods
from tests.e2e.service_proxy import ServiceProxy
from tests.e2e.test_scale_down import retried_batches
from tests.e2e.test_selfheal import MODEL, create, events
from tests.iwg_operator.conftest import Groups
from tests.nodeagent.fixture import NodeAgentProcess

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

NEW_IMAGE = "ghcr.io/iwg-dev/iwg-worker:0.1.1"
SETTLE_S = 2.0  # load kept on the group before the patch and after the rollout completed


def rolled(core: client.CoreV1Api, namespace: str, name: str, replicas: int) -> bool:
    """`replicas` worker pods and one driver, all of NEW_IMAGE, Ready, none terminating, nothing else left."""
    workers, drivers = worker_pods(core, namespace, name), driver_pods(core, namespace, name)
    return (
        len(workers) == replicas
        and len(drivers) == 1
        and all(
            p.metadata.deletion_timestamp is None and pod_ready(p) and p.spec.containers[0].image == NEW_IMAGE
            for p in [*workers, *drivers]
        )
    )


def replicas_seen(core: client.CoreV1Api, namespace: str, name: str) -> set[int]:
    return {int(p.metadata.labels["inference.iwg.dev/replica"]) for p in worker_pods(core, namespace, name)}


@pytest.mark.parametrize(("replicas", "max_surge"), [(2, 0), (1, 1)], ids=["2-replicas", "1-replica-surge"])
def test_a_new_image_under_load_loses_no_request(
    replicas: int,
    max_surge: int,
    node_agent: NodeAgentProcess,
    control_plane: Any,
    k8s: ApiClient,
    workspace: str,
    e2e_operator: Any,
) -> None:
    groups, core = Groups(k8s, workspace), client.CoreV1Api(k8s)
    name = "roll"
    manifest = group_manifest(name, replicas=replicas)
    if max_surge:
        manifest["spec"]["rollout"] = {"maxSurge": max_surge}
    create(control_plane, workspace, manifest)
    wait_serving(groups, core, node_agent, name, replicas=replicas)
    proxy = ServiceProxy(
        node_agent.gateway, f"{name}-driver.{workspace}.svc.cluster.local", 8000, retry_refused=False
    ).start()
    load = Load("127.0.0.1", MODEL, clients=2, inputs=4, port=proxy.listen_port).start()  # no retries
    indices: set[int] = set()
    retries: dict[str, float] = {}  # driver pod -> iwg_batch_retries_total, last read
    try:
        time.sleep(SETTLE_S)
        patched = time.monotonic()
        groups.patch(name, {"worker": {"image": NEW_IMAGE}})

        def done() -> bool:
            indices.update(replicas_seen(core, workspace, name))
            for driver in driver_pods(core, workspace, name):
                if driver.status.pod_ip:
                    with contextlib.suppress(OSError):  # a driver that stopped keeps its last reading
                        retries[driver.metadata.name] = retried_batches(driver.status.pod_ip)
            return rolled(core, workspace, name, replicas)

        eventually(done, 180, "every pod rolled onto the new image", interval=0.2)
        took = time.monotonic() - patched
        time.sleep(SETTLE_S)
    finally:
        load.stop()
        proxy.stop()

    during = sum(1 for sent, _ in load.latencies if sent >= patched)
    print(
        f"rollout of {replicas} replica(s), maxSurge {max_surge}: {took:.1f} s, {load.ok} answered "
        f"({during} from the patch on), {len(load.failures)} failed, {proxy.connections} connections, "
        f"{proxy.refused} refused; replica indices seen: {sorted(indices)}; batches retried: {retries}",
        file=sys.__stderr__,  # the operator's KopfRunner holds sys.stdout and sys.stderr while it runs
    )
    assert load.failures == [], (len(load.failures), load.failures[:5])
    assert during >= 20, during
    assert proxy.refused == 0
    assert len(retries) >= 2 and sum(retries.values()) == 0, retries  # both drivers read, no batch cut
    drained = " ".join(e.message for e in events(core, workspace, name, "DrainedReplicas"))
    if max_surge:
        # The surge replica existed, and was drained on its way out, as was the old replica 0.
        assert indices == {0, 1} and "drained replicas 0" in drained and "drained replicas 1" in drained
    else:
        assert indices == {0, 1} and "drained replicas 1" in drained and "drained replicas 0" in drained
