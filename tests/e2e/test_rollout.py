"""A new worker image rolled out under steady embedding load (issue 29, item 1), with the default single driver,
seen as a client in the cluster sees it: through the group's Service (a ServiceProxy that does not retry a
refused connect, as kube-proxy does not) by clients without retries, so every refused connection, cut
request and 503 counts. The image changes the workers' revision and, the driver's image being the workers'
by default, the driver's pod template: both roll. The node agent runs the same local `iwg-worker` and
`iwg-driver` whatever the image says, so the new image is a new tag, and what is tested is the rollout.

One group, two rollouts under one load (one group and one model load instead of two: about 60 s less):
- 1 replica with rollout.maxSurge 1: a replica of the new revision serves before the old one is drained; the
  surge replica is drained and removed at the end: 0 requests lost.
- then 2 replicas (maxSurge 0): the driver surges (its new pod Ready before the old one stops), and each worker
  replica is drained in the drivers before its pods are deleted, one at a time: 0 requests lost, and no
  driver retries a batch (a replica deleted undrained cuts its batch in flight, which the driver sends again
  to the other replica: the client would not see it, the drivers' iwg_batch_retries_total does).
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
from tests.e2e.harness import (
    MODEL,
    Load,
    create,
    driver_pods,
    events,
    group_manifest,
    pod_ready,
    wait_serving,
    worker_pods,
)
from tests.e2e.service_proxy import ServiceProxy
from tests.e2e.test_scale_down import retried_batches
from tests.iwg_operator.conftest import Groups
from tests.nodeagent.fixture import NodeAgentProcess

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

IMAGES = ("ghcr.io/iwg-dev/iwg-worker:0.1.1", "ghcr.io/iwg-dev/iwg-worker:0.1.2")
SETTLE_S = 2.0  # load kept on the group before each patch and after each rollout completed


def rolled(core: client.CoreV1Api, namespace: str, name: str, replicas: int, image: str) -> bool:
    """`replicas` worker pods, of replicas 0 to `replicas` - 1, and one driver, all of `image`, Ready, none
    terminating, nothing else left. (The indices too: with maxSurge, while replica 0 is replaced the surge
    replica alone is one pod of the new image.)"""
    workers, drivers = worker_pods(core, namespace, name), driver_pods(core, namespace, name)
    return (
        len(workers) == replicas
        and replicas_seen(core, namespace, name) == set(range(replicas))
        and len(drivers) == 1
        and all(
            p.metadata.deletion_timestamp is None and pod_ready(p) and p.spec.containers[0].image == image
            for p in [*workers, *drivers]
        )
    )


def replicas_seen(core: client.CoreV1Api, namespace: str, name: str) -> set[int]:
    return {int(p.metadata.labels["inference.iwg.dev/replica"]) for p in worker_pods(core, namespace, name)}


def test_new_images_under_load_lose_no_request(
    node_agent: NodeAgentProcess, control_plane: Any, k8s: ApiClient, workspace: str, e2e_operator: Any
) -> None:
    groups, core = Groups(k8s, workspace), client.CoreV1Api(k8s)
    name = "roll"
    manifest = group_manifest(name, replicas=1)
    manifest["spec"]["rollout"] = {"maxSurge": 1}
    create(control_plane, workspace, manifest)
    wait_serving(groups, core, node_agent, name, replicas=1)
    proxy = ServiceProxy(
        node_agent.gateway, f"{name}-driver.{workspace}.svc.cluster.local", 8000, retry_refused=False
    ).start()
    load = Load("127.0.0.1", MODEL, clients=2, inputs=4, port=proxy.listen_port).start()  # no retries
    phases: list[dict[str, Any]] = []
    try:
        for replicas, max_surge, image in ((1, 1, IMAGES[0]), (2, 0, IMAGES[1])):
            if replicas > 1:
                groups.patch(name, {"replicas": replicas, "rollout": {"maxSurge": max_surge}})
                wait_serving(groups, core, node_agent, name, replicas=replicas)
            time.sleep(SETTLE_S)
            phase: dict[str, Any] = {
                "replicas": replicas,
                "maxSurge": max_surge,
                "indices": set(),
                "retries": {},  # driver pod -> iwg_batch_retries_total, last read
                "events": len(events(core, workspace, name, "DrainedReplicas")),
                "failed": len(load.failures),
                "answered": load.ok,
                "patched": time.monotonic(),
            }
            groups.patch(name, {"worker": {"image": image}})

            def done(phase: dict[str, Any] = phase, replicas: int = replicas, image: str = image) -> bool:
                phase["indices"].update(replicas_seen(core, workspace, name))
                for driver in driver_pods(core, workspace, name):
                    if driver.status.pod_ip:
                        with contextlib.suppress(OSError):  # a driver that stopped keeps its last reading
                            phase["retries"][driver.metadata.name] = retried_batches(driver.status.pod_ip)
                return rolled(core, workspace, name, replicas, image)

            eventually(done, 180, f"every pod rolled onto {image}", interval=0.2)
            phase["took"] = time.monotonic() - phase["patched"]
            time.sleep(SETTLE_S)
            phase["failed"] = len(load.failures) - phase["failed"]
            phase["answered"] = load.ok - phase["answered"]
            phases.append(phase)
    finally:
        load.stop()
        proxy.stop()

    for phase in phases:
        print(
            f"rollout of {phase['replicas']} replica(s), maxSurge {phase['maxSurge']}: {phase['took']:.1f} s, "
            f"{phase['answered']} answered, {phase['failed']} failed; replica indices seen: "
            f"{sorted(phase['indices'])}; batches retried: {phase['retries']}",
            file=sys.__stderr__,  # the operator's KopfRunner holds sys.stdout and sys.stderr while it runs
        )
    print(f"{proxy.connections} connections, {proxy.refused} refused", file=sys.__stderr__)
    assert load.failures == [], (len(load.failures), load.failures[:5])
    assert proxy.refused == 0
    drained = [e.message for e in events(core, workspace, name, "DrainedReplicas")]
    # Every Event of the group in order, for the message of a failure below.
    found = core.list_namespaced_event(workspace, field_selector=f"involvedObject.name={name}").items
    said = [f"{e.reason}: {e.message}" for e in sorted(found, key=lambda e: e.metadata.creation_timestamp)]
    print("\n".join(["the group's Events:", *said]), file=sys.__stderr__)  # whole, where pytest cuts lists
    for phase in phases:
        assert phase["answered"] >= 20, phases
        # Both drivers (old and surge) read, and no batch cut by a replica going away.
        assert len(phase["retries"]) >= 2 and sum(phase["retries"].values()) == 0, phase
        # 1 replica + surge: replica 1 (the surge) existed. Both phases: replicas 0 and 1 drained on their way
        # out (the surge's, the old replica 0; then the old replicas 1 and 0), each in its own Event.
        assert phase["indices"] == {0, 1}, phase
    assert sum("drained replicas 0 " in m for m in drained) >= 2, said
    assert sum("drained replicas 1 " in m for m in drained) >= 2, said
