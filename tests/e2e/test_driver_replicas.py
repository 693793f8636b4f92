"""Two drivers (spec.driver.replicas 2) behind the group's Service, under one continuous load from the
official `openai` client with its default retries (max_retries=2), reaching them the way a client in the
cluster would: through the Service name (a ServiceProxy stands in for its virtual IP). In sequence: one
driver's process SIGKILLed (the node agent, as a kubelet, restarts its container); a driver pod deleted
gracefully (`kubectl delete pod`: SIGTERM, and the Deployment makes another); a rollout of the driver image
(the Deployment replaces both pods, one at a time). No request fails, every answer is right (a fixed input's
embedding as the group gave it before the faults), and the workers are the same processes, one model load
each. A second client without retries loses nothing to the delete and the rollout either: a driver told to
stop answers with `Connection: close` for a while before it closes its connections; only the SIGKILL may cut
its request in flight."""

from __future__ import annotations

import itertools
import os
import signal
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import pytest
from kubernetes import client
from kubernetes.client import ApiClient
from kubernetes.client.exceptions import ApiException
from openai import OpenAI

from tests.cluster.waiting import eventually
from tests.e2e.harness import (
    LOADED,
    MODEL,
    Load,
    create,
    driver_pods,
    group_manifest,
    live_ready_workers,
    openai_client,
    pod_ready,
    process_of,
    wait_serving,
)
from tests.e2e.service_proxy import ServiceProxy
from tests.iwg_operator.conftest import Groups
from tests.nodeagent.fixture import NodeAgentProcess

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

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


def test_two_drivers_lose_no_request_to_a_kill_a_delete_and_a_rollout(
    node_agent: NodeAgentProcess, control_plane: Any, k8s: ApiClient, workspace: str, e2e_operator: Any
) -> None:
    groups, core = Groups(k8s, workspace), client.CoreV1Api(k8s)
    name = "twin"
    manifest = group_manifest(name, replicas=1)
    manifest["spec"]["driver"]["replicas"] = DRIVERS
    create(control_plane, workspace, manifest)
    wait_serving(groups, core, node_agent, name, replicas=1)
    eventually(lambda: drivers_settled(core, workspace, name), 120, f"{DRIVERS} drivers ready")
    workers = {p.metadata.name: process_of(p) for p in live_ready_workers(core, workspace, name)}

    proxy = ServiceProxy(node_agent.gateway, f"{name}-driver.{workspace}.svc.cluster.local", 8000).start()
    api = openai_client("127.0.0.1", proxy.listen_port, max_retries=OPENAI_DEFAULT_RETRIES)
    reference = api.embeddings.create(model=MODEL, input=[FIXED_INPUT]).data[0].embedding
    load = CheckedLoad(
        "127.0.0.1",
        MODEL,
        clients=3,
        inputs=3,
        port=proxy.listen_port,
        max_retries=OPENAI_DEFAULT_RETRIES,
        reference=list(reference),
    ).start()
    strict = CheckedLoad(
        "127.0.0.1", MODEL, clients=1, inputs=3, port=proxy.listen_port, reference=list(reference)
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
        image = "ghcr.io/iwg-dev/iwg-worker:0.1.0-rollout"
        groups.patch(name, {"driver": {"image": image}})
        eventually(
            lambda: drivers_settled(core, workspace, name, image), 180, "both drivers rolled", interval=0.2
        )
        time.sleep(SETTLE_S)
        marks.append(("end", time.monotonic()))
    finally:
        load.stop()
        strict.stop()
        proxy.stop()

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
        + f"; {strict.ok} answered without retries; {proxy.connections} connections, {proxy.refused} refused "
        "connects tried elsewhere",
        file=sys.__stderr__,  # the operator's KopfRunner holds sys.stdout and sys.stderr while it runs
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
        log = node_agent.container_log(workspace, pod.metadata.name, "worker", lines=100_000)
        assert log.count(LOADED) == 1, log[-3000:]
