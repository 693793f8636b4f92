"""Operator scale: N groups x 4 pods on simulated nodes, against a real kube-apiserver, scheduler and kwok.

    python -m bench.operator_scale [--groups 250] [--quiet-seconds 60] [--gang [--repeats 3]] [--write-docs]

Prints: time until all pods exist, are bound to nodes, every group reports them and every group is Running, API
requests the operator made, its peak RSS and CPU, and API writes per minute over a quiet period afterwards: a
60 s window and, with a longer --quiet-seconds, that one too, opened once every group also reports its driver's
pod (kube-controller-manager creates those after the workers). A window with any write, Event or group change
is listed: the operator's requests by verb, resource and code, the status fields each group watch event
changed (`status.conditions[Ready].lastTransitionTime`), Events posted by reason, and pod events.
Ratios against (a) Grove's published ScaleTest_1000 (1000 pods in 36.1 s) and (b) a baseline measured in
this run: the same number of pods created directly by a plain client with as many requests in flight as the
operator allows itself (iwg_operator.kube.MAX_IN_FLIGHT), which is the floor the
API server and scheduler on this machine allow.

With `--gang`, every run is on a control plane that serves gang placement (GenericWorkload), and runs with gang
placement off (`spec.scheduling.gang: false`) and on (a Workload per group, a PodGroup per replica) alternate,
`--repeats` of each (off, on, on, off, off, on, ...; a fresh control plane for each), compared by their medians.
Each run also measures the scheduler alone: the same pods created directly (with their Workloads and PodGroups
when gang placement is on), until all exist and until all are bound, without the operator. The quiet window is
measured in the first run of each kind only.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import psutil
from kubernetes import client, watch
from kubernetes.client import ApiClient

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "operator"), str(ROOT)]

from iwg_operator.api import v1alpha1 as api  # noqa: E402
from iwg_operator.crdgen import render_crd  # noqa: E402
from iwg_operator.kube import MAX_IN_FLIGHT  # noqa: E402

from tests.cluster.control_plane import ControlPlane, free_port  # noqa: E402

GROUP_ANCHOR_SECONDS = 36.1  # Grove ScaleTest_1000: 1000 pods created
PODS_PER_GROUP = 4
REPLICAS, WORLD_SIZE = 2, 2
WORKER_SELECTOR = "app.kubernetes.io/managed-by=iwg-operator,app.kubernetes.io/component=worker"
WRITE_VERBS = ("create", "apply", "patch", "delete")
DOCS = ROOT / "docs" / "benchmarks.md"
SECTION = "## Operator scale"


@dataclass
class ProcessSampler:
    """Peak RSS and CPU seconds of one process, sampled in a thread."""

    pid: int
    interval: float = 0.2
    peak_rss: int = 0
    _stop: threading.Event = field(default_factory=threading.Event)

    def __post_init__(self) -> None:
        self.process = psutil.Process(self.pid)
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.peak_rss = max(self.peak_rss, self.process.memory_info().rss)
            except psutil.Error:
                return
            time.sleep(self.interval)

    def cpu_seconds(self) -> float:
        times = self.process.cpu_times()
        return float(times.user + times.system)

    def stop(self) -> None:
        self._stop.set()
        self.thread.join(timeout=2)


def operator_requests(port: int) -> dict[tuple[str, str, str], float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    counts: dict[tuple[str, str, str], float] = {}
    pattern = re.compile(r"^iwg_operator_api_requests_total\{(.*)\} (\S+)$")
    for line in text.splitlines():
        match = pattern.match(line)
        if match:
            labels = dict(re.findall(r'(\w+)="([^"]*)"', match.group(1)))
            counts[(labels["verb"], labels["resource"], labels["code"])] = float(match.group(2))
    return counts


def server_requests(cp: ControlPlane, verb: str, resource: str, subresource: str = "") -> float:
    """Requests the API server has answered (apiserver_request_total), by verb, resource and subresource."""
    text = cp.kubectl("get", "--raw", "/metrics").stdout
    total = 0.0
    for line in text.splitlines():
        if not line.startswith("apiserver_request_total{") or f'resource="{resource}"' not in line:
            continue
        if f'verb="{verb}"' in line and f'subresource="{subresource}"' in line:
            total += float(line.rsplit(" ", 1)[1])
    return total


def group_patches_by_kopf(cp: ControlPlane) -> float:
    """PATCHes of the groups' main resource: only Kopf makes them (annotations); the operator patches status."""
    return server_requests(cp, "PATCH", api.PLURAL)


def scheduler_writes(cp: ControlPlane) -> tuple[float, float]:
    """(bindings, PodGroup status patches) so far: only the scheduler makes either."""
    return server_requests(cp, "POST", "pods", "binding"), server_requests(cp, "PATCH", "podgroups", "status")


def changed_fields(old: Any, new: Any, path: str) -> list[str]:
    """The paths of the fields that differ between two versions of an object's part. Lists of objects keyed by
    `type` (conditions) or `index` (replicaStatuses) are compared item by item (`conditions[Ready].message`),
    so a reordering alone shows as `[order]`; other lists as a whole."""
    if isinstance(old, dict) and isinstance(new, dict):
        return [
            field
            for key in sorted(old.keys() | new.keys())
            for field in changed_fields(old.get(key), new.get(key), f"{path}.{key}")
        ]
    if isinstance(old, list) and isinstance(new, list) and old != new:
        key = next(
            (k for k in ("type", "index") if all(isinstance(i, dict) and k in i for i in old + new)), None
        )
        if key is not None:
            before = {item[key]: item for item in old}
            after = {item[key]: item for item in new}
            fields = [
                field
                for item in sorted(before.keys() | after.keys(), key=str)
                for field in changed_fields(before.get(item), after.get(item), f"{path}[{item}]")
            ]
            if not fields and len(old) == len(new):
                fields = [f"{path}[order]"]
            return fields
    return [] if old == new else [path]


class QuietWatch:
    """What changes in the bench's namespace during the quiet window, to name the writes if there are any:
    each group's changed fields (status, spec, labels, annotations) per watch event, Events posted (by
    reason) and pod events (by component and type). Runs in threads until stopped; `snapshot()` at any time."""

    def __init__(self, k8s: ApiClient, namespace: str) -> None:
        self.custom = client.CustomObjectsApi(k8s)
        self.core = client.CoreV1Api(k8s)
        self.namespace = namespace
        self.fields: dict[str, int] = {}
        self.group_events = 0
        self.events: dict[str, int] = {}
        self.pods: dict[str, int] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        listed = self.custom.list_namespaced_custom_object(api.GROUP, api.VERSION, namespace, api.PLURAL)
        self._groups = {item["metadata"]["name"]: item for item in listed["items"]}
        events_rv = self.core.list_namespaced_event(namespace, limit=1).metadata.resource_version
        pods_rv = self.core.list_namespaced_pod(namespace, limit=1).metadata.resource_version
        self._threads = [
            threading.Thread(target=self._follow, args=(self._list_groups, rv, self._group), daemon=True)
            for rv in [listed["metadata"]["resourceVersion"]]
        ] + [
            threading.Thread(
                target=self._follow, args=(self.core.list_namespaced_event, events_rv, self._event)
            ),
            threading.Thread(target=self._follow, args=(self.core.list_namespaced_pod, pods_rv, self._pod)),
        ]
        for thread in self._threads:
            thread.daemon = True
            thread.start()

    def _list_groups(self, namespace: str, **kwargs: Any) -> Any:
        return self.custom.list_namespaced_custom_object(
            api.GROUP, api.VERSION, namespace, api.PLURAL, **kwargs
        )

    def _follow(
        self, lister: Callable[..., Any], resource_version: str, record: Callable[[str, Any], None]
    ) -> None:
        while not self._stop.is_set():
            stream = watch.Watch()
            try:
                for event in stream.stream(
                    lister, self.namespace, resource_version=resource_version, timeout_seconds=2
                ):
                    obj = event["object"]
                    metadata = obj["metadata"] if isinstance(obj, dict) else obj.metadata
                    resource_version = (
                        metadata["resourceVersion"]
                        if isinstance(metadata, dict)
                        else metadata.resource_version
                    )
                    with self._lock:
                        record(event["type"], obj)
            except Exception:  # a dropped or expired watch: the window's figures say so by being low
                time.sleep(0.2)

    def _group(self, kind: str, obj: dict[str, Any]) -> None:
        name = obj["metadata"]["name"]
        old = self._groups.get(name, {})
        self._groups[name] = obj
        self.group_events += 1
        fields = changed_fields(old.get("status"), obj.get("status"), "status")
        fields += changed_fields(old.get("spec"), obj.get("spec"), "spec")
        for part in ("labels", "annotations"):
            fields += changed_fields(
                (old.get("metadata") or {}).get(part), obj["metadata"].get(part), f"metadata.{part}"
            )
        for field_path in fields or [f"({kind.lower()}, no field changed)"]:
            self.fields[field_path] = self.fields.get(field_path, 0) + 1

    def _event(self, kind: str, obj: Any) -> None:
        if kind == "ADDED":
            key = f"{obj.type} {obj.reason}"
            self.events[key] = self.events.get(key, 0) + 1

    def _pod(self, kind: str, obj: Any) -> None:
        component = (obj.metadata.labels or {}).get("app.kubernetes.io/component", "other")
        key = f"{component} {kind.lower()}"
        self.pods[key] = self.pods.get(key, 0) + 1

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            return {
                "group_fields": dict(self.fields),
                "group_watch_events": self.group_events,
                "events_posted": dict(self.events),
                "pod_watch_events": dict(self.pods),
            }

    def stop(self) -> None:
        self._stop.set()


def request_delta(
    end: dict[tuple[str, str, str], float], start: dict[tuple[str, str, str], float]
) -> dict[str, float]:
    """The operator's requests between two scrapes, as 'verb resource code' -> count (nonzero only)."""
    delta = {
        f"{verb} {resource} {code}": n - start.get((verb, resource, code), 0)
        for (verb, resource, code), n in end.items()
    }
    return {key: n for key, n in sorted(delta.items()) if n}


Result = TypeVar("Result")


def patiently(call: Callable[[], Result], attempts: int = 5) -> Result:
    """A request asked again when an overloaded API server times it out (504, 503)."""
    for attempt in range(attempts):
        try:
            return call()
        except client.ApiException as error:
            if error.status not in (503, 504) or attempt == attempts - 1:
                raise
            time.sleep(1)
    raise AssertionError("unreachable")


def worker_pods(core: client.CoreV1Api, namespace: str) -> list[dict[str, Any]]:
    """Worker pods in the namespace (raw JSON: remainingItemCount is not given with label selectors)."""
    response = patiently(
        lambda: core.list_namespaced_pod(namespace, label_selector=WORKER_SELECTOR, _preload_content=False)
    )
    items: list[dict[str, Any]] = json.loads(response.data)["items"]
    return items


def count_pods(core: client.CoreV1Api, namespace: str) -> tuple[int, int]:
    """(worker pods that exist, those bound to a node), from one list."""
    pods = worker_pods(core, namespace)
    return len(pods), sum(1 for pod in pods if (pod.get("spec") or {}).get("nodeName"))


def reporting(custom: client.CustomObjectsApi, namespace: str) -> tuple[int, int, int]:
    """(groups whose status counts all their pods, groups Running with every replica ready, groups whose status
    reports their driver's pod: DriverAvailable past NoDriverPod)."""
    items = patiently(
        lambda: custom.list_namespaced_custom_object(api.GROUP, api.VERSION, namespace, api.PLURAL)
    )["items"]
    counted = running = drivers = 0
    for item in items:
        status = item.get("status") or {}
        pods = sum(r.get("pods", 0) for r in status.get("replicaStatuses") or [])
        counted += pods == PODS_PER_GROUP and status.get("replicas") == REPLICAS
        running += status.get("phase") == "Running" and status.get("readyReplicas") == REPLICAS
        driver = {c.get("type"): c for c in status.get("conditions") or []}.get("DriverAvailable") or {}
        drivers += driver.get("reason") not in (None, "NoDriverPod")
    return counted, running, drivers


def manifest(namespace: str, index: int, gang: bool = False) -> dict[str, Any]:
    return {
        "apiVersion": api.API_VERSION,
        "kind": api.KIND,
        "metadata": {"name": f"g{index:04d}", "namespace": namespace},
        "spec": {
            "model": {"task": "embed", "path": "/models/m"},
            "replicas": REPLICAS,
            "worldSize": WORLD_SIZE,
            "worker": {"gpus": 0, "image": "ghcr.io/iwg-dev/iwg-worker:bench"},
            "scheduling": {
                "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
                "gang": gang,
            },
        },
    }


def create_namespace(core: client.CoreV1Api, name: str) -> None:
    core.create_namespace(client.V1Namespace(metadata=client.V1ObjectMeta(name=name)))
    deadline = time.monotonic() + 30
    while True:
        try:
            core.read_namespaced_service_account("default", name)
            return
        except client.ApiException:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


def direct_floor(
    core: client.CoreV1Api, custom: client.CustomObjectsApi, namespace: str, groups: int, gang: bool
) -> tuple[float, float]:
    """The floor here, without the operator: the groups' worker pods created straight through the API,
    MAX_IN_FLIGHT at once (with gang placement, each group's Workload and its replicas' PodGroups first).
    Returns seconds until all exist and until all are bound to nodes."""
    from iwg_operator import builders
    from iwg_operator.builders.gang import SCHEDULING_GROUP, SCHEDULING_VERSION

    spec = api.parse_spec(manifest(namespace, 0, gang)["spec"])
    settings = builders.BuildSettings()
    gang_objects: list[tuple[str, builders.Manifest]] = []
    pods: list[builders.Manifest] = []
    for index in range(groups):
        group = builders.Group(name=f"d{index:04d}", namespace=namespace, uid="none", spec=spec)
        if gang:
            gang_objects.append(("workloads", builders.workload(group)))
            gang_objects += [("podgroups", builders.pod_group(group, r)) for r in range(REPLICAS)]
        for replica in range(REPLICAS):
            pod_group = builders.pod_group_name(group.name, replica) if gang else None
            pods += [
                builders.worker_pod(group, replica, rank, settings, pod_group) for rank in range(WORLD_SIZE)
            ]
    for body in [*pods, *(body for _, body in gang_objects)]:
        del body["metadata"]["ownerReferences"]  # no group object exists
    scheduling = SCHEDULING_GROUP, SCHEDULING_VERSION

    def create(call: Callable[[], object]) -> None:
        try:
            patiently(call)
        except client.ApiException as error:
            if error.status != 409:  # a create that timed out may have been made: asked again, it exists
                raise

    started = time.monotonic()
    with ThreadPoolExecutor(MAX_IN_FLIGHT) as pool:
        list(
            pool.map(
                lambda o: create(
                    lambda: custom.create_namespaced_custom_object(*scheduling, namespace, o[0], o[1])
                ),
                gang_objects,
            )
        )
        list(pool.map(lambda b: create(lambda: core.create_namespaced_pod(namespace, b)), pods))
    exist = bound = None
    while bound is None:
        existing, bound_now = count_pods(core, namespace)
        if exist is None and existing >= len(pods):
            exist = time.monotonic() - started
        if bound_now >= len(pods):
            bound = time.monotonic() - started
        time.sleep(0.25)
    assert exist is not None
    return exist, bound


def run(
    groups: int,
    quiet_seconds: float,
    gang: bool = False,
    gang_control_plane: bool = False,
    scheduler_qps: int | None = None,
) -> dict[str, Any]:
    """One run on a fresh control plane (serving Workload and PodGroup with `gang_control_plane`); with `gang`,
    the groups are placed as gangs. `quiet_seconds` 0: no quiet window. `scheduler_qps`: the scheduler's client
    rate limit (kube-scheduler --kube-api-qps, burst twice that) instead of its default (50, burst 100)."""
    pods_total = groups * PODS_PER_GROUP
    # Room for the operator's worker pods, its groups' driver pods and the direct floor's pods (110 a node).
    nodes = max(4, -(-(2 * pods_total + groups) // 100) + 1)
    cp = (ControlPlane.with_gang_scheduling if gang or gang_control_plane else ControlPlane)(name="iwg-bench")
    cp.start()
    operator: subprocess.Popen[bytes] | None = None
    try:
        qps = scheduler_qps
        cp.start_scheduler([f"--kube-api-qps={qps}", f"--kube-api-burst={2 * qps}"] if qps else ())
        cp.start_controller_manager()
        cp.start_gpu_nodes(count=nodes)
        cp.kubectl("apply", "--server-side", "-f", "-", input=render_crd())
        for attempt in range(10):  # `kubectl wait` fails at once while the new CRD has no status yet
            waited = cp.kubectl(
                "wait",
                "--for=condition=Established",
                f"crd/{api.PLURAL}.{api.GROUP}",
                "--timeout=60s",
                check=False,
            )
            if waited.returncode == 0:
                break
            assert attempt < 9, waited.stderr
            time.sleep(0.5)
        k8s: ApiClient = cp.api_client()
        k8s.configuration.connection_pool_maxsize = max(32, MAX_IN_FLIGHT)
        core, custom = client.CoreV1Api(k8s), client.CustomObjectsApi(k8s)
        create_namespace(core, "bench")
        create_namespace(core, "direct")

        port = free_port()
        log = open(cp.workdir / "operator.log", "wb")  # noqa: SIM115
        operator = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "iwg_operator.main",
                "-A",
                "--metrics-port",
                str(port),
                "--log-level",
                "warning",
            ],
            env={**cp.env(), "PYTHONPATH": f"{ROOT / 'operator'}:{ROOT}"},
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        deadline = time.monotonic() + 60
        while True:
            try:
                operator_requests(port)
                break
            except OSError:
                assert time.monotonic() < deadline and operator.poll() is None, "operator did not start"
                time.sleep(0.2)
        time.sleep(2)  # Kopf's initial listing
        sampler = ProcessSampler(operator.pid)
        cpu_before = sampler.cpu_seconds()
        kopf_patches_before = group_patches_by_kopf(cp)

        started = time.monotonic()
        with ThreadPoolExecutor(16) as pool:
            list(
                pool.map(
                    lambda i: custom.create_namespaced_custom_object(
                        api.GROUP, api.VERSION, "bench", api.PLURAL, manifest("bench", i, gang)
                    ),
                    range(groups),
                )
            )
        submitted = time.monotonic() - started
        t_pods = t_bound = t_reported = t_running = None
        deadline = started + 900
        while time.monotonic() < deadline and t_running is None:
            if t_bound is None:
                existing, bound = count_pods(core, "bench")
                now = time.monotonic() - started
                if t_pods is None and existing >= pods_total:
                    t_pods = now
                if bound >= pods_total:
                    t_bound = now
            if t_pods is not None:
                counted, running, _ = reporting(custom, "bench")
                if t_reported is None and counted == groups:
                    t_reported = time.monotonic() - started
                if running == groups:
                    t_running = time.monotonic() - started
                    # Every replica ready means every pod bound: the last binding landed between the two lists.
                    t_bound = t_bound or t_running
            time.sleep(0.5)
        cpu_busy = sampler.cpu_seconds() - cpu_before
        requests_busy = operator_requests(port)
        kopf_patches_busy = group_patches_by_kopf(cp) - kopf_patches_before
        # Running is not settled: the driver Deployments' pods come from kube-controller-manager (the Deployment
        # and ReplicaSet controllers, whose client is limited to 20 requests/s by default), a minute after the
        # workers at 250 groups, and the operator reports each (DriverAvailable: NoDriverPod -> DriverDown here,
        # where the tainted simulated nodes keep drivers Pending). The quiet window opens once all are reported.
        t_drivers = None
        while time.monotonic() < deadline and t_drivers is None and quiet_seconds > 0:
            if reporting(custom, "bench")[2] == groups:
                t_drivers = time.monotonic() - started
            time.sleep(0.5)

        quiet_writes_per_minute = cpu_quiet = None
        windows: list[dict[str, Any]] = []
        if quiet_seconds > 0:
            time.sleep(5)  # let the last status writes land before the quiet window opens
            quiet_start = operator_requests(port)
            kopf_quiet_start = group_patches_by_kopf(cp)
            cpu_quiet_start = sampler.cpu_seconds()
            observer = QuietWatch(k8s, "bench")
            opened = time.monotonic()
            # A minute first (the figure compared across runs), then the rest of a longer window.
            for length in sorted({min(60.0, quiet_seconds), quiet_seconds}):
                time.sleep(max(0.0, opened + length - time.monotonic()))
                quiet_end = operator_requests(port)
                writes = sum(v - quiet_start.get(k, 0) for k, v in quiet_end.items() if k[0] in WRITE_VERBS)
                writes += group_patches_by_kopf(cp) - kopf_quiet_start
                windows.append(
                    {
                        "seconds": length,
                        "writes": writes,
                        "writes_per_minute": writes * 60 / length,
                        "cpu_seconds": sampler.cpu_seconds() - cpu_quiet_start,
                        "requests": request_delta(quiet_end, quiet_start),
                        **observer.snapshot(),
                    }
                )
            observer.stop()
            quiet_writes_per_minute = windows[-1]["writes_per_minute"]
            cpu_quiet = windows[-1]["cpu_seconds"]
        sampler.stop()

        writes_before = scheduler_writes(cp)
        direct_exist, direct_bound = direct_floor(core, custom, "direct", groups, gang)
        bindings, pod_group_patches = (
            a - b for a, b in zip(scheduler_writes(cp), writes_before, strict=True)
        )
        by_verb: dict[str, float] = {}
        for (verb, _, _), value in requests_busy.items():
            by_verb[verb] = by_verb.get(verb, 0) + value
        return {
            "gang": gang,
            "gang_control_plane": gang or gang_control_plane,
            "groups": groups,
            "pods": pods_total,
            "nodes": nodes,
            "submit_seconds": submitted,
            "pods_exist_seconds": t_pods,
            "pods_bound_seconds": t_bound,
            "groups_report_seconds": t_reported,
            "groups_running_seconds": t_running,
            "drivers_reported_seconds": t_drivers,
            "direct_create_seconds": direct_exist,
            "direct_bound_seconds": direct_bound,
            "direct_in_flight": MAX_IN_FLIGHT,
            "direct_bindings": bindings,
            "direct_pod_group_status_patches": pod_group_patches,
            "operator_requests": by_verb,
            "operator_requests_total": sum(by_verb.values()),
            "kopf_group_patches": kopf_patches_busy,
            "peak_rss_mb": sampler.peak_rss / 2**20,
            "cpu_seconds": cpu_busy,
            "quiet_seconds": quiet_seconds,
            "quiet_writes_per_minute": quiet_writes_per_minute,
            "quiet_cpu_seconds": cpu_quiet,
            "quiet_windows": windows,
            "load_average": os.getloadavg()[0],
            "scheduler_qps": scheduler_qps,
        }
    finally:
        if operator is not None and operator.poll() is None:
            operator.terminate()
            try:
                operator.wait(timeout=15)
            except subprocess.TimeoutExpired:
                operator.kill()
        cp.stop()


def secs(value: float | None) -> str:
    return "not reached" if value is None else f"{value:.1f} s"


def report(result: dict[str, Any]) -> str:
    pods = result["pods"]
    anchor = GROUP_ANCHOR_SECONDS * pods / 1000
    t_pods = result["pods_exist_seconds"]

    def ratio(value: float | None, base: float) -> str:
        return "-" if value is None else f"{value / base:.2f}x"

    requests = ", ".join(f"{verb} {int(n)}" for verb, n in sorted(result["operator_requests"].items()))
    plane = " (serving gang placement)" if result.get("gang_control_plane") else ""
    qps = f" (--kube-api-qps {result['scheduler_qps']})" if result.get("scheduler_qps") else ""
    lines = [
        f"{'Gang placement on' if result.get('gang') else 'Gang placement off'}: "
        f"{result['groups']} groups x {PODS_PER_GROUP} pods ({REPLICAS} replicas x world size {WORLD_SIZE}) = "
        f"{pods} pods on {result['nodes']} kwok nodes; real kube-apiserver{plane}, etcd, kube-scheduler{qps}, "
        "kube-controller-manager; operator `iwg-operator -A` in its own process.",
        "",
        f"| measure | value | vs Grove ScaleTest_1000 | vs direct creates (same run, {result['direct_in_flight']} "
        "in flight) |",
        "|---|---|---|---|",
        f"| groups submitted (16 in flight) | {secs(result['submit_seconds'])} | | |",
        f"| all {pods} pods exist | {secs(t_pods)} | {ratio(t_pods, anchor)} of {anchor:.1f} s | "
        f"{ratio(t_pods, result['direct_create_seconds'])} of {result['direct_create_seconds']:.1f} s |",
        f"| all {pods} pods bound to nodes (the scheduler) | {secs(result.get('pods_bound_seconds'))} | | "
        f"{ratio(result.get('pods_bound_seconds'), result['direct_bound_seconds'])} of "
        f"{result['direct_bound_seconds']:.1f} s |",
        f"| scheduler alone: the same pods created directly, bound | {secs(result['direct_bound_seconds'])} "
        f"({int(result['direct_bindings'])} bindings, {int(result['direct_pod_group_status_patches'])} PodGroup "
        "status patches by the scheduler) | | |",
        f"| every group's status counts its pods | {secs(result['groups_report_seconds'])} | | |",
        f"| every group Running (all replicas ready) | {secs(result['groups_running_seconds'])} | | |",
        f"| operator API requests (own layer) | {int(result['operator_requests_total'])} ({requests}) | | |",
        f"| Kopf's annotation patches on groups | {int(result['kopf_group_patches'])} | | |",
        f"| operator peak RSS | {result['peak_rss_mb']:.0f} MB (target <= 200) | | |",
        f"| operator CPU until Running | {result['cpu_seconds']:.1f} s | | |",
    ]
    if result.get("quiet_windows"):
        lines.append(
            f"| every group reports its driver's pod (the quiet window opens 5 s later) | "
            f"{secs(result.get('drivers_reported_seconds'))} | | |"
        )
    for window in result.get("quiet_windows") or []:
        lines += [
            f"| API writes per quiet minute ({window['seconds']:.0f} s window) | "
            f"{window['writes_per_minute']:.1f} (target 0) | | |",
            f"| operator CPU in the {window['seconds']:.0f} s quiet window | {window['cpu_seconds']:.2f} s | | |",
        ]
    for window in result.get("quiet_windows") or []:
        if window["writes"] or window["group_fields"] or window["events_posted"]:
            lines += [
                "",
                f"What happened in the {window['seconds']:.0f} s quiet window:",
                *quiet_detail(window),
            ]
    return "\n".join(lines)


def quiet_detail(window: dict[str, Any]) -> list[str]:
    """The writes of a quiet window by kind, and what they changed."""

    def listed(counts: dict[str, float]) -> str:
        return (
            ", ".join(f"{key} {int(n)}" for key, n in sorted(counts.items(), key=lambda kv: -kv[1])) or "none"
        )

    return [
        f"- operator requests (verb resource code): {listed(window['requests'])}",
        f"- group watch events: {window['group_watch_events']}; fields changed: {listed(window['group_fields'])}",
        f"- Events posted: {listed(window['events_posted'])}",
        f"- pod watch events: {listed(window['pod_watch_events'])}",
    ]


# (label, key) of the times compared between runs with gang placement off and on.
PHASES = [
    ("all pods exist", "pods_exist_seconds"),
    ("all pods bound to nodes", "pods_bound_seconds"),
    ("every group's status counts its pods", "groups_report_seconds"),
    ("every group Running", "groups_running_seconds"),
    ("scheduler alone: direct pods exist", "direct_create_seconds"),
    ("scheduler alone: direct pods bound", "direct_bound_seconds"),
]


def gang_order(repeats: int) -> list[bool]:
    """Gang placement off and on, `repeats` of each, in an order that balances drift: off, on, on, off, ..."""
    return [(index % 4) in (1, 2) for index in range(2 * repeats)]


def median(results: list[dict[str, Any]], key: str) -> float | None:
    values = [r[key] for r in results]
    return None if not values or any(v is None for v in values) else statistics.median(values)


def compare(results: list[dict[str, Any]]) -> str:
    """Every run's phases, then the medians of the runs with gang placement off and on and their ratio."""
    header = " | ".join(label for label, _ in PHASES)
    lines = [f"| run | gang | {header} | load |", "|---" * (len(PHASES) + 3) + "|"]
    for index, result in enumerate(results, 1):
        times = " | ".join(secs(result[key]) for _, key in PHASES)
        lines.append(
            f"| {index} | {'on' if result['gang'] else 'off'} | {times} | {result['load_average']:.1f} |"
        )
    off = [r for r in results if not r["gang"]]
    on = [r for r in results if r["gang"]]
    lines += [
        "",
        f"| measure | gang off (median of {len(off)}) | gang on (median of {len(on)}) | gang on / off |",
        "|---|---|---|---|",
    ]
    for label, key in PHASES:
        low, high = median(off, key), median(on, key)
        share = "-" if low is None or high is None else f"{high / low:.2f}x"
        lines.append(f"| {label} | {secs(low)} | {secs(high)} | {share} |")
    return "\n".join(lines)


def write_docs(text: str, command: str) -> None:
    body = (
        f"{SECTION}\n\n`{command}` (bench/operator_scale.py), on this project's 2-core CI machine shared with "
        f"other jobs. Anchor: Grove's published ScaleTest_1000 created 1000 pods in {GROUP_ANCHOR_SECONDS} s "
        "(scaled linearly for other sizes).\n\n" + text + "\n"
    )
    current = DOCS.read_text() if DOCS.exists() else "# Benchmarks\n\n"
    if SECTION in current:
        start = current.index(SECTION)
        following = current.find("\n## ", start + len(SECTION))
        current = current[:start] + body + ("\n" + current[following + 1 :] if following != -1 else "")
    else:
        current = current.rstrip("\n") + "\n\n" + body
    DOCS.write_text(current)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--groups", type=int, default=250)
    parser.add_argument("--quiet-seconds", type=float, default=60.0)
    parser.add_argument(
        "--write-docs", action="store_true", help=f"record the table in {DOCS.relative_to(ROOT)}"
    )
    parser.add_argument("--json", action="store_true", help="also print the raw figures as JSON")
    parser.add_argument(
        "--gang",
        action="store_true",
        help="runs with gang placement off and on, alternating on control planes that serve it; medians compared",
    )
    parser.add_argument("--repeats", type=int, default=3, help="with --gang: runs of each kind (default 3)")
    parser.add_argument(
        "--scheduler-qps",
        type=int,
        help="the scheduler's client rate limit (--kube-api-qps; burst twice that) instead of its default 50",
    )
    args = parser.parse_args(argv)
    if not args.gang:
        results = [run(args.groups, args.quiet_seconds, scheduler_qps=args.scheduler_qps)]
        text = report(results[0])
    else:
        results = []
        for gang in gang_order(args.repeats):
            first = all(r["gang"] != gang for r in results)
            results.append(
                run(args.groups, args.quiet_seconds if first else 0, gang=gang, gang_control_plane=True)
            )
            print(compare(results).split("\n\n")[0].splitlines()[-1], file=sys.stderr, flush=True)
        firsts = [next(r for r in results if r["gang"] == gang) for gang in (False, True)]
        text = "\n\n".join([*(report(r) for r in firsts), compare(results)])
    print(text)
    if args.json:
        print(json.dumps(results, indent=1))
    if args.write_docs:
        command = (
            f"python -m bench.operator_scale --groups {args.groups} --quiet-seconds {args.quiet_seconds:.0f}"
            + (f" --gang --repeats {args.repeats}" if args.gang else "")
            + (f" --scheduler-qps {args.scheduler_qps}" if args.scheduler_qps else "")
        )
        write_docs(text, command)
    return 0


if __name__ == "__main__":
    sys.exit(main())
