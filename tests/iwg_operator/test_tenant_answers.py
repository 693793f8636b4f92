"""What a tenant's pods answer cannot take the shared operator down, and an operator restart keeps each group's
restart budget.

The operator runs as its own process (its memory measured from /proc); kwok gives the pods loopback addresses,
so a test's HTTP server on a pod's own address is what the operator's prober and autoscaler reach there.
Other sessions' operators on this machine may probe the same addresses (kwok numbers every control plane's
pods from 127.244.0.1): a test knows that its own operator got a healthy answer from `status.engine`, which
only that operator writes, and each server answers with an engine of its own.
"""

from __future__ import annotations

import http.server
import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from iwg_operator import labels
from iwg_operator.api import wiring
from iwg_operator.pod_http import HEALTH_BODY_LIMIT, METRICS_BODY_LIMIT
from kubernetes import client

from tests.cluster.waiting import eventually
from tests.iwg_operator.conftest import Groups
from tests.iwg_operator.test_operator_restart import OperatorProcess

pytestmark = pytest.mark.cluster

ROOT = Path(__file__).resolve().parents[2]
HUGE_BYTES = 1536 << 20  # 1.5 GiB, generated as it is sent
CHUNK = b"x" * (1 << 20)


@pytest.fixture
def operator_process(
    controller_manager: Any, iwg_crd: Any, control_plane: Any, namespace: str, tmp_path: Path
) -> Iterator[OperatorProcess]:
    process = OperatorProcess(control_plane, namespace, tmp_path / "operator.log")
    try:
        yield process
    finally:
        process.stop()


def chart_memory_limit() -> int:
    """The operator's memory limit in the Helm chart's values, in bytes."""
    values = yaml.safe_load((ROOT / "helm/iwg-operator/values.yaml").read_text())
    limit = str(values["resources"]["limits"]["memory"])
    assert limit.endswith("Mi"), limit
    return int(limit[:-2]) << 20


class PodServer:
    """An HTTP server on one simulated pod's address: healthy /healthz, an unhealthy one, or a 1.5 GiB body
    (no Content-Length, sent until the client hangs up) on every path."""

    def __init__(self, ip: str, port: int, mode: str = "healthy", engine: str = "transformers") -> None:
        self.mode = mode
        self.huge_sent = 0  # bytes of huge bodies sent, all requests together
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                if outer.mode == "huge":
                    self.send_response(200)
                    self.send_header("Content-Type", "text/plain")
                    self.end_headers()
                    try:
                        for _ in range(HUGE_BYTES // len(CHUNK)):
                            self.wfile.write(CHUNK)
                            outer.huge_sent += len(CHUNK)
                    except OSError:
                        pass  # the operator hung up
                    return
                healthy = outer.mode == "healthy"
                body = json.dumps({"alive": healthy, "worker": {"engine": engine}}).encode()
                self.send_response(200 if healthy else 500)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer((ip, port), Handler)
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def supervised(groups: Groups, name: str, engine: str) -> None:
    """The test's operator has had a healthy answer from the server answering `engine`."""
    eventually(
        lambda: (groups.get(name).get("status") or {}).get("engine") == engine,
        timeout=60,
        what=f"the prober supervising the {engine} worker",
    )


def peak_rss(pid: int) -> int:
    """The process's peak resident set size (VmHWM), in bytes."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) << 10
    raise AssertionError("no VmHWM")


def running_pod(groups: Groups, name: str, component: str = labels.COMPONENT_WORKER) -> Any:
    def found() -> Any:
        selector = f"{labels.GROUP}={name},{labels.COMPONENT}={component}"
        for pod in groups.core.list_namespaced_pod(groups.namespace, label_selector=selector).items:
            ready = any(c.type == "Ready" and c.status == "True" for c in pod.status.conditions or [])
            if pod.metadata.deletion_timestamp is None and pod.status.pod_ip and ready:
                return pod
        return None

    return eventually(found, timeout=60, what=f"a ready {component} pod of {name}")


def bind_driver(groups: Groups, name: str, node: str) -> None:
    """The driver pod, bound by hand: the simulated nodes are GPU nodes whose taint the driver does not
    tolerate, and a binding does not look at taints."""

    def pending() -> Any:
        selector = f"{labels.GROUP}={name},{labels.COMPONENT}={labels.COMPONENT_DRIVER}"
        pods = groups.core.list_namespaced_pod(groups.namespace, label_selector=selector).items
        return pods[0] if pods else None

    pod = eventually(pending, timeout=60, what="the driver pod")
    if not pod.spec.node_name:
        groups.core.create_namespaced_pod_binding(
            pod.metadata.name,
            groups.namespace,
            client.V1Binding(
                metadata=client.V1ObjectMeta(name=pod.metadata.name),
                target=client.V1ObjectReference(api_version="v1", kind="Node", name=node),
            ),
            _preload_content=False,
        )


def test_huge_health_and_metrics_answers_leave_the_operator_under_its_memory_limit(
    scheduler: Any,
    gpu_nodes: list[str],
    operator_process: OperatorProcess,
    groups: Groups,
) -> None:
    health = {"periodSeconds": 10, "timeoutSeconds": 10, "failureThreshold": 1, "backoffSeconds": 0}
    autoscaling = {"enabled": True, "minReplicas": 1, "maxReplicas": 2, "metric": "queueDepth", "target": 4}
    operator_process.start()
    groups.create("huge", replicas=1, worker={"gpus": 1}, health=health, autoscaling=autoscaling)
    worker = running_pod(groups, "huge")
    bind_driver(groups, "huge", gpu_nodes[0])
    driver = running_pod(groups, "huge", labels.COMPONENT_DRIVER)
    servers = [
        health_server := PodServer(worker.status.pod_ip, wiring.DEFAULT_HEALTH_PORT),
        metrics_server := PodServer(driver.status.pod_ip, wiring.DEFAULT_HTTP_PORT, mode="huge"),
    ]
    try:
        supervised(groups, "huge", "transformers")
        health_server.mode = "huge"
        try:
            replaced = eventually(
                lambda: next((e for e in groups.events("huge") if e.reason == "WorkerUnhealthy"), None),
                timeout=60,
                what="the worker replaced",
            )
        except AssertionError as error:
            raise AssertionError(
                f"{error}; operator log: {operator_process.log.read_text()[-3000:]}"
            ) from None
        assert f"answer longer than {HEALTH_BODY_LIMIT} bytes" in replaced.message, replaced.message
        held = eventually(
            lambda: (c := groups.condition("huge", "ScalingActive")) and c["status"] == "False" and c,
            timeout=30,
            what="the autoscaler holding",
        )
        assert held["reason"] == "MetricsUnavailable", held
        assert f"answer longer than {METRICS_BODY_LIMIT} bytes" in held["message"], held
        time.sleep(12)  # another round of each
    finally:
        assert operator_process.proc is not None
        peak = peak_rss(operator_process.proc.pid)
        for server in servers:
            server.close()
        sent = health_server.huge_sent + metrics_server.huge_sent
        print(f"operator peak RSS {peak / 2**20:.0f} MiB; {sent / 2**20:.0f} MiB of huge bodies sent")
    assert peak < chart_memory_limit(), f"peak RSS {peak / 2**20:.0f} MiB"


def test_the_restart_budget_survives_an_operator_restart(
    scheduler: Any,
    gpu_nodes: list[str],
    operator_process: OperatorProcess,
    groups: Groups,
) -> None:
    health = {
        "periodSeconds": 1,
        "timeoutSeconds": 1,
        "failureThreshold": 1,
        "backoffSeconds": 0,
        "maxRestarts": 1,
        "restartWindowSeconds": 3600,
        "restartPolicy": "Pod",
    }
    operator_process.start()
    groups.create("budget", replicas=1, worker={"gpus": 1}, health=health)
    first = running_pod(groups, "budget")
    server = PodServer(first.status.pod_ip, wiring.DEFAULT_HEALTH_PORT)
    try:
        supervised(groups, "budget", "transformers")
        server.mode = "unhealthy"
        status = eventually(
            lambda: (s := groups.get("budget").get("status") or {}).get("recentRestarts") and s,
            timeout=60,
            what="the replacement in status.recentRestarts",
        )
    finally:
        server.close()
    assert status["restartCount"] == 1
    assert [r["replica"] for r in status["recentRestarts"]] == [0]

    operator_process.kill()
    operator_process.start()
    second = eventually(
        lambda: (p := running_pod(groups, "budget")).metadata.uid != first.metadata.uid and p,
        timeout=60,
        what="the replacement pod",
    )
    server = PodServer(second.status.pod_ip, wiring.DEFAULT_HEALTH_PORT, engine="vllm")
    try:
        supervised(groups, "budget", "vllm")
        server.mode = "unhealthy"
        exhausted = eventually(
            lambda: (
                (c := groups.condition("budget", "RestartBudgetExhausted")) and c["status"] == "True" and c
            ),
            timeout=30,
            what="the budget spent",
        )
        time.sleep(3)  # three more failed rounds
        assert [p.metadata.uid for p in groups.live_pods("budget")] == [second.metadata.uid], exhausted
        assert groups.get("budget")["status"]["restartCount"] == 1
    finally:
        server.close()
