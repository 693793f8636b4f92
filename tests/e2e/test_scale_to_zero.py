"""Scale to zero and back on the cluster harness (issue 25): a SmolLM2 group created at 0 replicas with
autoscaling from minReplicas 0. Chat requests sent at once through the group's Service (no retries, by the
proxy or the client) are held by the driver while the autoscaler brings a replica up, and all answered; after
the idle window the group drains back to 0 (phase Idle). A request sent while the last replica leaves is
held and served by the next one, not failed."""

from __future__ import annotations

import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
from kubernetes import client
from kubernetes.client import ApiClient

from tests.e2e.harness import diagnose, driver_pods, eventually, openai_client, pod_ready, worker_pods
from tests.e2e.service_proxy import ServiceProxy
from tests.e2e.test_scale_down import driver_metric
from tests.e2e.test_selfheal import create, events
from tests.iwg_operator.conftest import Groups
from tests.models import smollm2_manifest
from tests.nodeagent.fixture import NodeAgentProcess

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

IDLE_S = 6
REQUESTS = 32
QUESTION: Any = [{"role": "user", "content": "What is the capital of France?"}]


def ask(api: Any, stream: bool) -> str:
    """One greedy chat answer, streamed or not."""
    if stream:
        chunks = api.chat.completions.create(
            model="smollm2", messages=QUESTION, max_tokens=16, temperature=0, stream=True
        )
        return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    reply = api.chat.completions.create(model="smollm2", messages=QUESTION, max_tokens=16, temperature=0)
    return str(reply.choices[0].message.content)


def phase(groups: Groups, name: str) -> tuple[int, str | None]:
    group = groups.get(name)
    return int(group["spec"]["replicas"]), (group.get("status") or {}).get("phase")


def last_activation(groups: Groups, name: str) -> dict[str, Any]:
    return dict((groups.get(name).get("status") or {}).get("lastActivation") or {})


def test_a_group_at_zero_holds_requests_scales_up_serves_them_and_goes_back_to_zero_when_idle(
    node_agent: NodeAgentProcess, control_plane: Any, k8s: ApiClient, workspace: str, e2e_operator: Any
) -> None:
    groups, core = Groups(k8s, workspace), client.CoreV1Api(k8s)
    name = "zero"
    manifest = smollm2_manifest(kv_blocks=64)
    manifest["metadata"] = {"name": name}
    manifest["spec"]["replicas"] = 0
    manifest["spec"]["autoscaling"] = {
        "enabled": True,
        "minReplicas": 0,
        "maxReplicas": 1,
        "scaleToZeroAfterSeconds": IDLE_S,
        "activationTimeoutSeconds": 240,
    }
    create(control_plane, workspace, manifest)
    try:
        # At zero the driver is Ready (it holds requests), and the group is Idle, not Degraded.
        eventually(
            lambda: [p for p in driver_pods(core, workspace, name) if pod_ready(p)], 180, "driver ready"
        )
        eventually(lambda: phase(groups, name) == (0, "Idle"), 60, "phase Idle at 0 replicas")
        assert worker_pods(core, workspace, name) == []
        proxy = ServiceProxy(
            node_agent.gateway, f"{name}-driver.{workspace}.svc.cluster.local", 8000, retry_refused=False
        ).start()
        api = openai_client("127.0.0.1", port=proxy.listen_port, timeout=240)  # max_retries=0
        driver_ip = driver_pods(core, workspace, name)[0].status.pod_ip

        started = time.monotonic()
        with ThreadPoolExecutor(REQUESTS) as pool:
            answers = list(pool.map(lambda i: ask(api, stream=i % 2 == 0), range(REQUESTS)))
        first_burst_s = time.monotonic() - started
        # Every request answered, streamed or not, with the same greedy text.
        assert len(set(answers)) == 1 and "Paris" in answers[0], answers
        scaled_up = events(core, workspace, name, "ScaledFromZero")
        assert scaled_up and "held by the drivers" in scaled_up[0].message, [e.message for e in scaled_up]
        assert driver_metric(driver_ip, "iwg_activation_seconds_count") == REQUESTS
        assert driver_metric(driver_ip, "iwg_activation_waiting") == 0
        # The cold start in the group's status, in its parts (from the worker's hello): a pod started for it,
        # SmolLM2 loaded; the parts add up to the whole.
        eventually(lambda: "phases" in last_activation(groups, name), 30, "status.lastActivation.phases")
        activation = last_activation(groups, name)
        parts = activation["phases"]
        assert parts["podStart"] > 0 and parts["modelLoad"] > 0, activation
        assert sum(parts.values()) == pytest.approx(activation["seconds"], abs=0.01), activation

        # Idle: drained back to zero replicas, no worker pod left, the driver still up.
        eventually(lambda: phase(groups, name) == (0, "Idle"), 120, "back to 0 replicas, phase Idle")
        assert events(core, workspace, name, "ScaledToZero") and worker_pods(core, workspace, name) == []
        assert [p for p in driver_pods(core, workspace, name) if pod_ready(p)]

        # A request while the last replica leaves: bring one up, and ask the moment replicas go to 0.
        warm = threading.Thread(target=ask, args=(api, False))
        warm.start()
        eventually(lambda: phase(groups, name)[1] == "Running", 180, "a replica serving again")
        warm.join(timeout=240)
        eventually(lambda: phase(groups, name)[0] == 0, 120, "replicas set to 0 again", interval=0.05)
        leaving = bool(worker_pods(core, workspace, name))
        late = ask(api, stream=True)
        assert late == answers[0]
        proxy.stop()
    except Exception as error:  # an API error or timeout too: what the operator and the driver said
        raise AssertionError(f"{error}\n{diagnose(node_agent, core, workspace)}") from None
    seconds = driver_metric(driver_ip, "iwg_activation_seconds_sum") / driver_metric(
        driver_ip, "iwg_activation_seconds_count"
    )
    print(
        f"scale from zero: {REQUESTS} requests answered in {first_burst_s:.1f} s; mean activation "
        f"{seconds:.1f} s (the first: {activation['seconds']:.1f} s, {parts}); the late request arrived with the leaving replica's pod still there: {leaving}",
        file=sys.__stderr__,
    )
    reasons = [
        e.reason for e in core.list_namespaced_event(workspace).items if e.involved_object.name == name
    ]
    assert reasons.count("ScaledFromZero") >= 2 and reasons.count("ScaledToZero") >= 2, reasons
