"""What the end-to-end tests share: reaching the group the way a client in the cluster would, load that
counts every failure, and faults injected into real worker processes.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any

from kubernetes import client
from openai import OpenAI


def openai_client(address: str, port: int = 8000, timeout: float = 60, max_retries: int = 0) -> OpenAI:
    """The official client; no retries unless asked, so a test sees every failure (the client's own default
    is 2: connection errors, 408, 409, 429 and 5xx answers are sent again after a short backoff)."""
    return OpenAI(
        base_url=f"http://{address}:{port}/v1", api_key="not-needed", max_retries=max_retries, timeout=timeout
    )


def pod_ready(pod: Any) -> bool:
    return any(c.type == "Ready" and c.status == "True" for c in (pod.status.conditions or []))


def worker_pods(core: client.CoreV1Api, namespace: str, group: str, component: str = "worker") -> list[Any]:
    selector = f"inference.iwg.dev/group={group},app.kubernetes.io/component={component}"
    pods = core.list_namespaced_pod(namespace, label_selector=selector).items
    return sorted(pods, key=lambda p: p.metadata.name)


def driver_pods(core: client.CoreV1Api, namespace: str, group: str) -> list[Any]:
    return worker_pods(core, namespace, group, component="driver")


def live_ready_workers(core: client.CoreV1Api, namespace: str, group: str) -> list[Any]:
    return [
        p
        for p in worker_pods(core, namespace, group)
        if p.metadata.deletion_timestamp is None and pod_ready(p)
    ]


@dataclass
class Load:
    """Clients sending embedding requests in a loop until stopped; every failure is kept with its message."""

    address: str
    model: str
    clients: int = 2
    inputs: int = 4
    max_seconds: float = 300.0
    timeout: float = 60.0  # seconds the client waits for an answer (a stream: for each of its chunks)
    port: int = 8000
    max_retries: int = 0  # the openai client's retries (its default is 2); a failure counts after the last
    pause_s: float = 0.0  # each client's wait between an answer and its next request
    ok: int = 0
    failures: list[str] = field(default_factory=list)
    failed_at: list[float] = field(default_factory=list)  # when each failed request was sent (monotonic)
    failed_done: list[float] = field(default_factory=list)  # when each failed (monotonic)
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
        api = openai_client(self.address, self.port, self.timeout, self.max_retries)
        deadline = time.monotonic() + self.max_seconds
        n = 0
        while not self._stop.is_set() and time.monotonic() < deadline:
            n += 1
            started = time.monotonic()
            try:
                self.request(api, index, n)
                with self._lock:
                    self.ok += 1
                    self.latencies.append((started, time.monotonic() - started))
            except Exception as error:
                with self._lock:
                    self.failures.append(f"{type(error).__name__}: {error}")
                    self.failed_at.append(started)
                    self.failed_done.append(time.monotonic())
            if self.pause_s:
                self._stop.wait(self.pause_s)

    def request(self, api: OpenAI, index: int, n: int) -> None:
        """One request of client `index`; raises on anything but the right answer."""
        result = api.embeddings.create(
            model=self.model, input=[f"client {index} request {n} item {i}" for i in range(self.inputs)]
        )
        assert len(result.data) == self.inputs and len(result.data[0].embedding) == 384

    def running(self) -> bool:
        """Whether its clients still send: not stopped, and not past `max_seconds` (they end by themselves)."""
        return not self._stop.is_set() and any(thread.is_alive() for thread in self._threads)

    def stop(self) -> Load:
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=max(90.0, self.timeout))
        return self


@dataclass
class ChatLoad(Load):
    """Clients streaming chat completions (`stream=True`, `max_tokens` each) in a loop; `inputs` is unused.
    A request counts as ok only when its stream ends with a finish reason and carried text."""

    max_tokens: int = 16
    context: str = ""  # prepended to every question: longer prompts hold more KV cache blocks

    def request(self, api: OpenAI, index: int, n: int) -> None:
        question = f"{self.context}Client {index}, question {n}: name a colour of the rainbow."
        stream = api.chat.completions.create(
            model=self.model,
            messages=[{"role": "user", "content": question}],
            max_tokens=self.max_tokens,
            stream=True,
        )
        text, finish = joined(stream)
        assert finish in ("stop", "length") and text.strip(), (finish, text)


def joined(stream: Any) -> tuple[str, str | None]:
    """A streamed chat answer's text and finish reason (the last one given)."""
    text, finish = "", None
    for chunk in stream:
        for choice in chunk.choices:
            text += choice.delta.content or ""
            finish = choice.finish_reason or finish
    return text, finish


def group_manifest(name: str, example: dict[str, Any] | None = None, **spec: Any) -> dict[str, Any]:
    """`example` (default examples/minilm.yaml) under another name, with spec fields replaced (top level, then
    one level down)."""
    import copy
    from pathlib import Path

    import yaml

    if example is None:
        example = yaml.safe_load(
            (Path(__file__).resolve().parents[2] / "examples" / "minilm.yaml").read_text()
        )
    manifest = copy.deepcopy(example)
    manifest["metadata"] = {"name": name}
    for key, value in spec.items():
        if isinstance(value, dict) and isinstance(manifest["spec"].get(key), dict):
            manifest["spec"][key] = {**manifest["spec"][key], **value}
        else:
            manifest["spec"][key] = value
    return dict(manifest)


def answers(api: OpenAI, model: dict[str, Any]) -> bool:
    """Whether the driver answers a one-token request of the model's task (any failure: no)."""
    try:
        if model["task"] == "generate":
            messages: Any = [{"role": "user", "content": "ping"}]
            reply = api.chat.completions.create(model=model["servedName"], messages=messages, max_tokens=1)
            return len(reply.choices) == 1
        return len(api.embeddings.create(model=model["servedName"], input=["ping"]).data) == 1
    except Exception:
        return False


@dataclass
class Recovery:
    """Times from a fault to the operator's reaction and to the group serving in full again."""

    fault: str
    detected_s: float
    ready_s: float
    replaced: list[str]


def await_replacement(
    core: client.CoreV1Api,
    groups: Any,
    name: str,
    victims: list[Any],
    started: float,
    replicas: int,
    timeout: float = 180,
) -> Recovery:
    """Polls until every victim pod is gone or terminating (detected) and new pods stand ready (recovered)."""
    namespace = groups.namespace
    uids = {p.metadata.uid for p in victims}
    wanted = {p.metadata.name for p in victims}
    detected: float | None = None
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        current = {p.metadata.uid: p for p in worker_pods(core, namespace, name)}
        if detected is None and all(u not in current or current[u].metadata.deletion_timestamp for u in uids):
            detected = time.monotonic() - started
        if detected is not None:
            fresh = [
                p
                for p in current.values()
                if p.metadata.uid not in uids and p.metadata.deletion_timestamp is None
            ]
            serving = (groups.get(name).get("status") or {}).get("readyReplicas") == replicas
            replaced = wanted <= {p.metadata.name for p in fresh if pod_ready(p)}
            if serving and replaced:
                return Recovery("", detected, time.monotonic() - started, sorted(wanted))
        time.sleep(0.05)
    raise AssertionError(f"no replacement of {sorted(wanted)} within {timeout:.0f}s")


# The operator's health checks of a test whose timing of a hung worker's detection is asserted.
PERIOD, THRESHOLD, TIMEOUT = 2, 2, 1
FAST_HEALTH = {
    "periodSeconds": PERIOD,
    "timeoutSeconds": TIMEOUT,
    "failureThreshold": THRESHOLD,
    "restartPolicy": "Pod",
    "backoffSeconds": 0,
}
# For groups whose test does not time the detection of a hung worker: a probe may take 4 s and three must
# fail, so a worker that answers late on a loaded machine (ranks computing, streams running, a stalled
# process) is not replaced by mistake. A killed worker's container ends, which the prober counts at once.
STEADY_PERIOD = 5
STEADY_HEALTH = {**FAST_HEALTH, "periodSeconds": STEADY_PERIOD, "timeoutSeconds": 4, "failureThreshold": 3}
MODEL = "all-MiniLM-L6-v2"
LOADED = "ready on"  # WorkerProc's line once its model is loaded


def create(control_plane: Any, namespace: str, manifest: dict[str, Any]) -> None:
    import yaml

    control_plane.kubectl("apply", "-n", namespace, "-f", "-", input=yaml.safe_dump(manifest))


def events(core: client.CoreV1Api, namespace: str, name: str, reason: str) -> list[Any]:
    found = core.list_namespaced_event(namespace, field_selector=f"involvedObject.name={name}").items
    return [e for e in found if e.reason == reason]


def true_condition(groups: Any, name: str, kind: str, reason: str | None = None) -> dict[str, Any] | None:
    """The group's condition of type ``kind`` when it is True (and has ``reason``, when given)."""
    for condition in (groups.get(name).get("status") or {}).get("conditions") or []:
        wanted = reason is None or condition["reason"] == reason
        if condition["type"] == kind and condition["status"] == "True" and wanted:
            return dict(condition)
    return None


def sharded_smollm2(name: str, world_size: int, health: dict[str, Any]) -> dict[str, Any]:
    """The SmolLM2 example group (converted weights, a small KV cache) with ``world_size`` ranks."""
    from tests.models import smollm2_manifest

    manifest = smollm2_manifest(kv_blocks=64)
    manifest["metadata"] = {"name": name}
    spec = manifest["spec"]
    spec["worldSize"] = world_size
    spec["worker"] = {**spec["worker"], "cpu": "500m", "memory": "2Gi"}
    spec["health"] = health
    return dict(manifest)


def ask_france(address: str, port: int = 8000) -> str:
    answer = openai_client(address, port).chat.completions.create(
        model="smollm2",
        messages=[{"role": "user", "content": "What is the capital of France?"}],
        max_tokens=8,
        temperature=0,
    )
    return str(answer.choices[0].message.content)


def driver_metric(address: str, series: str, port: int = 8000) -> float:
    """The sum of the driver's samples whose line starts with `series` (a name, or a name and labels)."""
    import urllib.request

    with urllib.request.urlopen(f"http://{address}:{port}/metrics", timeout=5) as response:
        text = response.read().decode()
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(series))


def retried_batches(address: str, port: int = 8000) -> float:
    """Batches the driver retried on another replica because theirs went away."""
    return driver_metric(address, "iwg_batch_retries_total", port)
