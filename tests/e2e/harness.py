"""What the end-to-end tests share: reaching the group the way a client in the cluster would, load that
counts every failure, and faults injected into real worker processes.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from dnslib import QTYPE, DNSRecord
from iwg_operator.builders.common import driver_name
from kubernetes import client
from openai import OpenAI

T = TypeVar("T")


def eventually(check: Callable[[], T | None], timeout: float, what: str, interval: float = 0.2) -> T:
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {timeout:.0f}s")
        time.sleep(interval)


def resolve(dns_server: str, name: str) -> list[str]:
    """Asks the cluster DNS (the node agent's server) as a pod's resolver would."""
    reply = DNSRecord.parse(DNSRecord.question(name, "A").send(dns_server, 53, timeout=2))
    return [str(rr.rdata) for rr in reply.rr if rr.rtype == QTYPE.A]


def driver_address(dns_server: str, namespace: str, group: str) -> str | None:
    found = resolve(dns_server, f"{driver_name(group)}.{namespace}.svc.cluster.local")
    return found[0] if found else None


def openai_client(address: str, port: int = 8000) -> OpenAI:
    return OpenAI(base_url=f"http://{address}:{port}/v1", api_key="not-needed", max_retries=0, timeout=60)


def pod_ready(pod: Any) -> bool:
    return any(c.type == "Ready" and c.status == "True" for c in (pod.status.conditions or []))


def worker_pods(core: client.CoreV1Api, namespace: str, group: str) -> list[Any]:
    selector = f"inference.iwg.dev/group={group},app.kubernetes.io/component=worker"
    pods = core.list_namespaced_pod(namespace, label_selector=selector).items
    return sorted(pods, key=lambda p: p.metadata.name)


def live_ready_workers(core: client.CoreV1Api, namespace: str, group: str) -> list[Any]:
    return [
        p
        for p in worker_pods(core, namespace, group)
        if p.metadata.deletion_timestamp is None and pod_ready(p)
    ]


def process_of(pod: Any) -> int:
    """The pid of the pod's container (the node agent reports it as the container id)."""
    return int(pod.status.container_statuses[0].container_id.split("//", 1)[1])


def signal_worker(pod: Any, sig: signal.Signals) -> int:
    pid = process_of(pod)
    os.kill(pid, sig)
    return pid


@dataclass
class Load:
    """Clients sending embedding requests in a loop until stopped; every failure is kept with its message."""

    address: str
    model: str
    clients: int = 2
    inputs: int = 4
    max_seconds: float = 300.0
    ok: int = 0
    failures: list[str] = field(default_factory=list)
    latencies: list[tuple[float, float]] = field(default_factory=list)  # (start, seconds)
    _stop: threading.Event = field(default_factory=threading.Event)
    _threads: list[threading.Thread] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def start(self) -> Load:
        for index in range(self.clients):
            thread = threading.Thread(target=self._run, args=(index,), daemon=True)
            thread.start()
            self._threads.append(thread)
        return self

    def _run(self, index: int) -> None:
        api = openai_client(self.address)
        deadline = time.monotonic() + self.max_seconds
        n = 0
        while not self._stop.is_set() and time.monotonic() < deadline:
            n += 1
            started = time.monotonic()
            try:
                result = api.embeddings.create(
                    model=self.model,
                    input=[f"client {index} request {n} item {i}" for i in range(self.inputs)],
                )
                assert len(result.data) == self.inputs and len(result.data[0].embedding) == 384
                with self._lock:
                    self.ok += 1
                    self.latencies.append((started, time.monotonic() - started))
            except Exception as error:
                with self._lock:
                    self.failures.append(f"{type(error).__name__}: {error}")

    def stop(self) -> Load:
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=90)
        return self


def diagnose(agent: Any, core: client.CoreV1Api, namespace: str) -> str:
    """Everything worth reading when an end-to-end test fails."""
    lines = ["==== pods"]
    for pod in core.list_namespaced_pod(namespace).items:
        statuses = [
            (s.name, s.ready, s.restart_count, s.state.to_dict()) for s in pod.status.container_statuses or []
        ]
        lines.append(f"{pod.metadata.name} node={pod.spec.node_name} phase={pod.status.phase} {statuses}")
        lines.extend(
            f"  {c.type}={c.status} {c.reason or ''} {c.message or ''}" for c in pod.status.conditions or []
        )
    lines.append("==== node agent")
    lines.append(agent.log_tail(30))
    lines.append(agent.pod_logs(namespace, lines=25))
    return "\n".join(lines)
