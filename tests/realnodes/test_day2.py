"""Day-2 operations on real kubelets, seen as a client on a node sees the group: through its driver Service
(the first node's kube-proxy: a refused connect is the client's failure), by clients without retries, so
every refused connection, cut request and 503 counts.

`kubectl drain` of each node in turn under load: the real control plane's eviction API and disruption
controller (the workers' and drivers' PodDisruptionBudgets) and the kubelets' graceful termination. Each drain
finishes within kubectl's timeout, the group's pods end on the other node, no request fails, and at no moment
during a drain is no worker replica Ready. The same test of a SmolLM2 group sharded over 3 ranks stays on the
node agent (tests/e2e/test_drain.py): its six ranks of 500m and two drivers (requests equal to limits) do not
fit one real 2-CPU node once the other is drained; a third node, or smaller ranks, would bring it here (not
tried).

A new worker image rolled out under steady load, with the default single driver: the image changes the
workers' revision and, the driver's image being the workers' by default, the driver's pod template, so both
roll. The new images are new names of the light image on every node (`ctr images tag`), which the kubelets run
as any image: what is tested is the rollout. One group, two rollouts under one load:
- 1 replica with rollout.maxSurge 1: a replica of the new revision serves before the old one is drained; the
  surge replica is drained and removed at the end: 0 requests lost.
- then 2 replicas (maxSurge 0): the driver surges (its new pod Ready before the old one stops, and kube-proxy
  sends new connections to it), and each worker replica is drained in the drivers before its pods are
  deleted, one at a time: 0 requests lost, and no driver retries a batch (a replica deleted undrained cuts its
  batch in flight, which the driver sends again to the other replica: the client would not see it, the
  drivers' iwg_batch_retries_total does).
"""

from __future__ import annotations

import contextlib
import sys
import time
from typing import Any

import pytest
from kubernetes import client

from tests.cluster.waiting import eventually
from tests.e2e.drains import drain_each_node, load_seconds
from tests.e2e.harness import MODEL, Load, driver_pods, events, group_manifest, pod_ready, worker_pods
from tests.e2e.test_scale_down import retried_batches
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


ROLLOUT_IMAGES = ("iwg.local/iwg-worker-light:roll-1", "iwg.local/iwg-worker-light:roll-2")
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


def test_new_images_under_load_lose_no_request(real_cluster: RealCluster) -> None:
    cluster, core, groups = real_cluster, real_cluster.core, real_cluster.groups
    namespace = cluster.namespace
    cluster.nodes.tag_image(WORKER_IMAGE, *ROLLOUT_IMAGES)
    name = "roll"
    manifest = group_manifest(
        name,
        replicas=1,
        worker={"image": WORKER_IMAGE, "imagePullPolicy": "Never", "cpu": "500m"},
        driver={"cpu": "500m"},
    )
    manifest["spec"]["rollout"] = {"maxSurge": 1}
    cluster.apply(manifest)
    port = cluster.wait_serving(name, replicas=1)
    load = Load("127.0.0.1", MODEL, clients=2, inputs=4, port=port).start()  # no retries
    forwarded: dict[str, int] = {}  # a driver pod's address -> the loopback port relayed to its :8000
    phases: list[dict[str, Any]] = []
    try:
        for replicas, max_surge, image in ((1, 1, ROLLOUT_IMAGES[0]), (2, 0, ROLLOUT_IMAGES[1])):
            if replicas > 1:
                groups.patch(name, {"replicas": replicas, "rollout": {"maxSurge": max_surge}})
                cluster.wait_serving(name, replicas=replicas)
            time.sleep(SETTLE_S)
            phase: dict[str, Any] = {
                "replicas": replicas,
                "maxSurge": max_surge,
                "indices": set(),
                "retries": {},  # driver pod -> iwg_batch_retries_total, last read
                "events": len(events(core, namespace, name, "DrainedReplicas")),
                "failed": len(load.failures),
                "answered": load.ok,
                "patched": time.monotonic(),
            }
            groups.patch(name, {"worker": {"image": image}})

            def done(phase: dict[str, Any] = phase, replicas: int = replicas, image: str = image) -> bool:
                phase["indices"].update(replicas_seen(core, namespace, name))
                for driver in driver_pods(core, namespace, name):
                    ip = driver.status.pod_ip
                    if ip:
                        with contextlib.suppress(OSError):  # a driver that stopped keeps its last reading
                            if ip not in forwarded:
                                forwarded[ip] = cluster.nodes.forward(ip, 8000)
                            phase["retries"][driver.metadata.name] = retried_batches(
                                "127.0.0.1", forwarded[ip]
                            )
                return rolled(core, namespace, name, replicas, image)

            try:
                eventually(done, 240, f"every pod rolled onto {image}", interval=0.2)
            except AssertionError as error:
                raise AssertionError(f"{error}\n{cluster.diagnose()}") from None
            phase["took"] = time.monotonic() - phase["patched"]
            time.sleep(SETTLE_S)
            phase["failed"] = len(load.failures) - phase["failed"]
            phase["answered"] = load.ok - phase["answered"]
            phases.append(phase)
    finally:
        load.stop()

    for phase in phases:
        print(
            f"rollout of {phase['replicas']} replica(s), maxSurge {phase['maxSurge']}: {phase['took']:.1f} s, "
            f"{phase['answered']} answered, {phase['failed']} failed; replica indices seen: "
            f"{sorted(phase['indices'])}; batches retried: {phase['retries']}",
            file=sys.__stderr__,
        )
    assert load.failures == [], (len(load.failures), load.failures[:5])
    drained = [e.message for e in events(core, namespace, name, "DrainedReplicas")]
    # Every Event of the group in order, for the message of a failure below.
    found = core.list_namespaced_event(namespace, field_selector=f"involvedObject.name={name}").items
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
