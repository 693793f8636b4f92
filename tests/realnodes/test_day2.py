"""Day-2 operations on real kubelets, seen as a client on a node sees the group: through its driver Service
(the first node's kube-proxy: a refused connect is the client's failure), by clients without retries, so
every refused connection, cut request and 503 counts.

`kubectl drain` of each node in turn under load: the real control plane's eviction API and disruption
controller (the workers' and drivers' PodDisruptionBudgets) and the kubelets' graceful termination. Each drain
finishes within kubectl's timeout, the group's pods end on the other node, no request fails, and at no moment
during a drain is no worker replica Ready. The same test of a SmolLM2 group sharded over 3 ranks is
tests/realnodes/test_drain_sharded.py (a cluster of its own in the e2e lane).

`kubectl scale` lowering replicas under load: the operator drains the leaving replica in every driver before it
deletes its pods, so no batch in flight is cut (no driver retries one) and no request fails; a driver that
does not answer (SIGSTOPped) holds a scale-down for at most the drain timeout; a scale-down undone while its
replica drains leaves that replica serving, its pods kept. These clients reach each driver's pod directly.

Two drivers (spec.driver.replicas 2) behind the Service under one continuous load from the official `openai`
client with its default retries (max_retries=2): one driver's process SIGKILLed (the kubelet restarts its
container), a driver pod deleted gracefully (SIGTERM, and the Deployment makes another), a rollout of the
driver image (one surge pod at a time). No request fails, every answer is right (a fixed input's embedding as
the group gave it before the faults), and the workers are the same processes, one model load each. A second
client without retries loses nothing to the delete and the rollout either (a driver told to stop answers with
`Connection: close` for its lame duck, which outlasts kube-proxy's rule sync); only the SIGKILL may cut its
request in flight.

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
import itertools
import os
import signal
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import pytest
from kubernetes import client
from kubernetes.client.exceptions import ApiException
from openai import OpenAI

from tests.cluster.waiting import eventually
from tests.e2e.drains import drain_each_node, load_seconds
from tests.e2e.harness import (
    LOADED,
    MODEL,
    Load,
    driver_metric,
    driver_pods,
    events,
    group_manifest,
    live_ready_workers,
    openai_client,
    pod_ready,
    retried_batches,
    worker_pods,
)
from tests.realnodes.fixture import RealCluster, cluster, real_cluster
from tests.realnodes.nodes import WORKER_IMAGE

__all__ = ["cluster", "real_cluster"]

pytestmark = [pytest.mark.cluster, pytest.mark.slow]


def test_draining_each_real_node_in_turn_under_load_loses_no_request(cluster: RealCluster) -> None:
    core = cluster.core
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


def test_new_images_under_load_lose_no_request(cluster: RealCluster) -> None:
    core, groups = cluster.core, cluster.groups
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


# The undo test's batches: long enough that a drain outlasts the steps of a scale-down and its undo on a loaded
# machine (kubectl twice, the operator's watch and pass), short enough that the driver's limits hold: two
# batches in flight on one replica (run one after the other) within its 30 s batch timeout, and a request that
# waits behind four batches (replica 1 drained, all on replica 0) within its 60 s request timeout.
UNDO_BATCH_S = 10
LIGHT_500M = {"image": WORKER_IMAGE, "imagePullPolicy": "Never", "cpu": "500m"}


def serve_slow_group(
    cluster: RealCluster,
    name: str,
    batch_seconds: float | None = None,
    max_batch_size: int | None = None,
    drivers: int = 1,
) -> dict[str, int]:
    """Two serving replicas of SlowWorker and `drivers` ready drivers; returns each driver pod's loopback port
    (relayed to its :8000)."""
    manifest = group_manifest(
        name, replicas=2, worker=LIGHT_500M, driver={"cpu": "500m", "replicas": drivers}
    )
    if max_batch_size is not None:
        manifest["spec"]["driver"]["batching"] = {"maxBatchSize": max_batch_size}
    manifest["spec"]["worker"]["workerCls"] = "tests.realnodes.slow_worker.SlowWorker"
    if batch_seconds is not None:
        manifest["spec"]["worker"]["env"] = [{"name": "E2E_SLOW_BATCH_S", "value": f"{batch_seconds:g}"}]
    cluster.apply(manifest)
    cluster.wait_serving(name, replicas=2)
    ready = eventually(
        lambda: (
            pods
            if len(pods := [p for p in driver_pods(cluster.core, cluster.namespace, name) if pod_ready(p)])
            == drivers
            else None
        ),
        120,
        f"{drivers} drivers ready",
    )
    return {p.metadata.name: cluster.nodes.forward(p.status.pod_ip, 8000) for p in ready}


def test_kubectl_scale_down_drains_the_leaving_replica_in_every_driver_before_deleting_its_pods(
    cluster: RealCluster,
) -> None:
    groups, core = cluster.groups, cluster.core
    namespace = cluster.namespace
    name = "shrink"
    drivers = serve_slow_group(cluster, name, drivers=2)
    # Each driver routes its own clients' batches to both replicas (each batch takes 0.4 s more than the model
    # needs), so each has batches in flight on replica 1 when the scale-down comes.
    loads = {
        pod: Load("127.0.0.1", MODEL, clients=3, inputs=2, port=port).start() for pod, port in drivers.items()
    }
    try:
        time.sleep(3)
        before = {pod: retried_batches("127.0.0.1", port) for pod, port in drivers.items()}
        cluster.control_plane.kubectl(
            "scale", "-n", namespace, f"inferenceworkergroup/{name}", "--replicas=1"
        )
        eventually(
            lambda: {p.metadata.labels["inference.iwg.dev/replica"] for p in groups.pods(name)} == {"0"},
            90,
            "replica 1's pods gone",
        )
        time.sleep(2)
    finally:
        for load in loads.values():
            load.stop()

    for pod, load in loads.items():
        assert load.failures == [], (pod, load.failures[:3])
        assert load.ok > 5, pod
        assert retried_batches("127.0.0.1", drivers[pod]) == before[pod], (
            f"{pod} cut a batch: replica 1 went with it in flight"
        )
        # Both drivers were asked, not only the first one ready.
        log = cluster.log_of(pod)
        assert "replica 1: draining" in log and "replica 1: drained" in log, log[-3000:]
    drained = [e.message for e in events(core, namespace, name, "DrainedReplicas")]
    assert len(drained) == 1 and "replicas 1 in 2 drivers" in drained[0], drained


def test_a_driver_that_does_not_answer_holds_a_scale_down_only_for_the_drain_timeout(
    cluster: RealCluster,
) -> None:
    groups, core = cluster.groups, cluster.core
    namespace = cluster.namespace
    name = "stuck"
    manifest = group_manifest(
        name, replicas=2, rollout={"drainTimeoutSeconds": 2}, worker=LIGHT_500M, driver={"cpu": "500m"}
    )
    cluster.apply(manifest)
    cluster.wait_serving(name, replicas=2)
    driver = cluster.ready_driver(name, 30)
    stopped = cluster.signal_container(driver, signal.SIGSTOP)  # still Ready for a while: the drain hangs
    try:
        started = time.monotonic()
        cluster.control_plane.kubectl(
            "scale", "-n", namespace, f"inferenceworkergroup/{name}", "--replicas=1"
        )
        eventually(
            lambda: all(
                p.metadata.deletion_timestamp
                for p in groups.pods(name)
                if p.metadata.labels["inference.iwg.dev/replica"] == "1"
            ),
            60,
            "replica 1's pods deleted",
        )
        held = time.monotonic() - started
    finally:
        with contextlib.suppress(ProcessLookupError):  # the kubelet's liveness probe may have restarted it
            os.kill(stopped, signal.SIGCONT)
    failed = [e.message for e in events(core, namespace, name, "DrainFailed")]
    assert len(failed) == 1 and "replicas 1 not drained" in failed[0], failed
    assert f"driver pod {driver.metadata.name}:" in failed[0], failed  # which driver did not answer
    # The drain request waits drainTimeoutSeconds plus 10 s for the driver's answer, then the pods go.
    assert 2 <= held < 2 + 10 + 15, held


def replica_state(port: int, replica: int) -> str:
    """The driver's state of one replica (the driver's :8000 relayed to `port`)."""
    for state in ("joining", "serving", "draining", "dead"):
        if driver_metric("127.0.0.1", f'iwg_replica_state{{replica="{replica}",state="{state}"}}', port) == 1:
            return state
    return "unknown"


def test_a_scale_down_undone_while_draining_leaves_the_replica_serving(cluster: RealCluster) -> None:
    groups = cluster.groups
    namespace = cluster.namespace
    name = "undo"
    # One input per batch: four clients' requests arriving together would otherwise share one batch, sent to
    # replica 0 every time, and replica 1 might never get one.
    (port,) = serve_slow_group(cluster, name, batch_seconds=UNDO_BATCH_S, max_batch_size=1).values()
    eventually(lambda: replica_state(port, 1) == "serving", 30, "replica 1 serving")
    replica_1 = {
        p.metadata.uid for p in groups.pods(name) if p.metadata.labels["inference.iwg.dev/replica"] == "1"
    }
    load = Load("127.0.0.1", MODEL, clients=4, inputs=1, port=port).start()  # 10 s batches on both replicas
    try:
        eventually(
            lambda: driver_metric("127.0.0.1", 'iwg_inflight_batches{replica="1"}', port) >= 1,
            30,
            "a batch on replica 1",
        )
        # The drain lasts until replica 1's batches in flight are done (up to two of 10 s, run one after the
        # other); the undo must land within it, or the operator deletes replica 1's pods.
        scale = ["scale", "-n", namespace, f"inferenceworkergroup/{name}"]
        cluster.control_plane.kubectl(*scale, "--replicas=1")
        eventually(lambda: replica_state(port, 1) == "draining", 30, "replica 1 draining")
        cluster.control_plane.kubectl(*scale, "--replicas=2")
        # Undrained by the pass after the drain's (which waits for the batches in flight).
        eventually(lambda: replica_state(port, 1) == "serving", 60, "replica 1 serving again")
    finally:
        load.stop()

    assert {
        p.metadata.uid
        for p in groups.live_pods(name)
        if p.metadata.labels["inference.iwg.dev/replica"] == "1"
    } == replica_1
    assert load.failures == [], load.failures[:3]


DRIVERS = 2
FIXED_INPUT = "the same sentence, embedded before and during every fault"
SETTLE_S = 3.0  # load kept on the group after each phase's change completed
OPENAI_DEFAULT_RETRIES = 2


@dataclass
class CheckedLoad(Load):
    """Each request carries the fixed input first; its embedding must equal the reference within 1e-4."""

    reference: list[float] = field(default_factory=list)

    def request(self, api: OpenAI, index: int, n: int) -> None:
        inputs = [FIXED_INPUT, *(f"client {index} request {n} item {i}" for i in range(self.inputs - 1))]
        result = api.embeddings.create(model=self.model, input=inputs)
        assert len(result.data) == len(inputs) and all(len(d.embedding) == 384 for d in result.data)
        drift = max(abs(a - b) for a, b in zip(result.data[0].embedding, self.reference, strict=True))
        assert drift <= 1e-4, f"the fixed input's embedding moved by {drift}"


def live_drivers(core: client.CoreV1Api, namespace: str, name: str) -> list[Any]:
    return [p for p in driver_pods(core, namespace, name) if p.metadata.deletion_timestamp is None]


def drivers_settled(core: client.CoreV1Api, namespace: str, name: str, image: str | None = None) -> bool:
    """Exactly DRIVERS driver pods, all Ready, none terminating (and all of `image`, when given)."""
    pods = driver_pods(core, namespace, name)
    return (
        len(pods) == DRIVERS
        and all(p.metadata.deletion_timestamp is None and pod_ready(p) for p in pods)
        and (image is None or all(p.spec.containers[0].image == image for p in pods))
    )


def test_two_drivers_lose_no_request_to_a_kill_a_delete_and_a_rollout(cluster: RealCluster) -> None:
    groups, core, workspace = cluster.groups, cluster.core, cluster.namespace
    name = "twin"
    manifest = group_manifest(
        name, replicas=1, worker=LIGHT_500M, driver={"cpu": "500m", "replicas": DRIVERS}
    )
    cluster.apply(manifest)
    port = cluster.wait_serving(name, replicas=1)
    eventually(lambda: drivers_settled(core, workspace, name), 120, f"{DRIVERS} drivers ready")
    process_of = cluster.pid_of
    workers = {p.metadata.name: process_of(p) for p in live_ready_workers(core, workspace, name)}
    api = openai_client("127.0.0.1", port, max_retries=OPENAI_DEFAULT_RETRIES)
    reference = api.embeddings.create(model=MODEL, input=[FIXED_INPUT]).data[0].embedding
    load = CheckedLoad(
        "127.0.0.1",
        MODEL,
        clients=3,
        inputs=3,
        port=port,
        max_retries=OPENAI_DEFAULT_RETRIES,
        reference=list(reference),
    ).start()
    strict = CheckedLoad(
        "127.0.0.1", MODEL, clients=1, inputs=3, port=port, reference=list(reference)
    ).start()  # no retries: every connection the drivers close under a request shows
    marks = [("before", time.monotonic())]
    try:
        time.sleep(SETTLE_S)

        # 1. SIGKILL one driver's process: its connections break, its container is restarted in place.
        marks.append(("sigkill", time.monotonic()))
        victim = live_drivers(core, workspace, name)[0]
        killed = process_of(victim)
        os.kill(killed, signal.SIGKILL)
        eventually(
            lambda: (
                any(
                    p.metadata.name == victim.metadata.name and process_of(p) != killed
                    for p in driver_pods(core, workspace, name)
                )
                and drivers_settled(core, workspace, name)
            ),
            120,
            "the killed driver restarted and Ready",
            interval=0.2,
            tolerate=(LookupError,),  # the status names the dead container until the kubelet reports anew
        )
        time.sleep(SETTLE_S)

        # 2. Delete a driver pod gracefully: SIGTERM, it stops accepting and finishes what it admitted.
        marks.append(("delete pod", time.monotonic()))
        deleted = live_drivers(core, workspace, name)[-1].metadata.name
        core.delete_namespaced_pod(deleted, workspace)

        def gone() -> bool:
            try:
                core.read_namespaced_pod(deleted, workspace)
                return False
            except ApiException as error:
                return bool(error.status == 404)

        eventually(
            lambda: gone() and drivers_settled(core, workspace, name), 120, "a new driver pod", interval=0.2
        )
        time.sleep(SETTLE_S)

        # 3. A rollout of the driver image: one surge pod at a time, an old one goes once its successor is Ready.
        marks.append(("rollout", time.monotonic()))
        image = "iwg.local/iwg-worker-light:driver-roll"
        cluster.nodes.tag_image(WORKER_IMAGE, image)
        groups.patch(name, {"driver": {"image": image}})
        eventually(
            lambda: drivers_settled(core, workspace, name, image), 180, "both drivers rolled", interval=0.2
        )
        time.sleep(SETTLE_S)
        marks.append(("end", time.monotonic()))
    finally:
        load.stop()
        strict.stop()

    phases = []
    for (phase, start), (_, end) in itertools.pairwise(marks):
        answered = sum(1 for sent, took in load.latencies if start <= sent + took < end)
        failed = sum(1 for sent in load.failed_at if start <= sent < end)
        strict_failed = [
            f for f, done in zip(strict.failures, strict.failed_done, strict=True) if start <= done < end
        ]
        phases.append((phase, answered, failed, end - start, strict_failed))
    print(
        "two drivers under load: "
        + "; ".join(
            f"{p}: {a} answered, {f} failed in {s:.1f} s ({len(sf)} failed without retries)"
            for p, a, f, s, sf in phases
        )
        + f"; {strict.ok} answered without retries",
        file=sys.__stderr__,
    )
    assert load.failures == [], load.failures[:5]
    assert strict.ok >= 20
    for phase, answered, _, _, strict_failed in phases:
        assert answered >= 5, (phase, phases)
        # Only the SIGKILL may cut a request (one in flight on the killed process, or sent as it died); a
        # failure counts in the phase it happened in.
        assert phase == "sigkill" or strict_failed == [], (phase, strict_failed)

    # The same worker processes, never restarted, with one model load each.
    after = live_ready_workers(core, workspace, name)
    assert {p.metadata.name: process_of(p) for p in after} == workers
    for pod in after:
        assert all(s.restart_count == 0 for s in pod.status.container_statuses)
        log = cluster.log_of(pod.metadata.name)
        assert log.count(LOADED) == 1, log[-3000:]
