"""Operator scale: N groups x 4 pods on simulated nodes, against a real kube-apiserver, scheduler and kwok.

    python -m bench.operator_scale [--groups 250] [--quiet-seconds 60] [--gang] [--write-docs]

Prints: time until all pods exist and until every group reports them (and until all are Running), API
requests the operator made, its peak RSS and CPU, and API writes per minute over a quiet period afterwards.
Ratios against (a) Grove's published ScaleTest_1000 (1000 pods in 36.1 s) and (b) a baseline measured in
this run: the same number of pods created directly by a plain client with as many requests in flight as the
operator allows itself (iwg_operator.kube.MAX_IN_FLIGHT), which is the floor the
API server and scheduler on this machine allow.

With `--gang`, a second run follows on a control plane that serves gang placement (GenericWorkload): the same
groups with gang placement on (a Workload per group, a PodGroup per replica), and its ratios against the first
run, whose groups have it off (`spec.scheduling.gang: false`).
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil
from kubernetes import client
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


def group_patches_by_kopf(cp: ControlPlane) -> float:
    """PATCHes of the groups' main resource: only Kopf makes them (annotations); the operator patches status."""
    text = cp.kubectl("get", "--raw", "/metrics").stdout
    total = 0.0
    for line in text.splitlines():
        ours = line.startswith("apiserver_request_total{") and 'resource="inferenceworkergroups"' in line
        if ours and 'verb="PATCH"' in line and 'subresource=""' in line:
            total += float(line.rsplit(" ", 1)[1])
    return total


def count_pods(core: client.CoreV1Api, namespace: str) -> int:
    """Worker pods in the namespace (raw JSON: remainingItemCount is not given with label selectors)."""
    return len(worker_pods(core, namespace))


def worker_pods(core: client.CoreV1Api, namespace: str) -> list[dict[str, Any]]:
    response = core.list_namespaced_pod(namespace, label_selector=WORKER_SELECTOR, _preload_content=False)
    items: list[dict[str, Any]] = json.loads(response.data)["items"]
    return items


def count_bound(core: client.CoreV1Api, namespace: str) -> int:
    return sum(1 for pod in worker_pods(core, namespace) if (pod.get("spec") or {}).get("nodeName"))


def reporting(custom: client.CustomObjectsApi, namespace: str) -> tuple[int, int]:
    """(groups whose status counts all their pods, groups Running with every replica ready)."""
    items = custom.list_namespaced_custom_object(api.GROUP, api.VERSION, namespace, api.PLURAL)["items"]
    counted = running = 0
    for item in items:
        status = item.get("status") or {}
        pods = sum(r.get("pods", 0) for r in status.get("replicaStatuses") or [])
        counted += pods == PODS_PER_GROUP and status.get("replicas") == REPLICAS
        running += status.get("phase") == "Running" and status.get("readyReplicas") == REPLICAS
    return counted, running


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


def direct_baseline(core: client.CoreV1Api, namespace: str, pods: int) -> float:
    """Seconds to create `pods` pods straight through the API, MAX_IN_FLIGHT at once: the floor here."""
    from iwg_operator import builders

    spec = api.parse_spec(manifest(namespace, 0)["spec"])
    group = builders.Group(name="direct", namespace=namespace, uid="none", spec=spec)
    bodies = []
    for index in range(pods):
        body = builders.worker_pod(group, index // WORLD_SIZE, index % WORLD_SIZE, builders.BuildSettings())
        del body["metadata"]["ownerReferences"]
        bodies.append(body)
    started = time.monotonic()
    with ThreadPoolExecutor(MAX_IN_FLIGHT) as pool:
        list(pool.map(lambda b: core.create_namespaced_pod(namespace, b), bodies))
    while count_pods(core, namespace) < pods:
        time.sleep(0.05)
    return time.monotonic() - started


def run(groups: int, quiet_seconds: float, gang: bool = False) -> dict[str, Any]:
    """One run; with `gang`, on a control plane serving Workload and PodGroup, the groups placed as gangs."""
    pods_total = groups * PODS_PER_GROUP
    nodes = max(4, -(-pods_total // 100) + 1)
    cp = (ControlPlane.with_gang_scheduling if gang else ControlPlane)(name="iwg-bench").start()
    operator: subprocess.Popen[bytes] | None = None
    try:
        cp.start_scheduler()
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
        configuration = client.Configuration()
        k8s: ApiClient = cp.api_client()
        k8s.configuration.connection_pool_maxsize = max(32, MAX_IN_FLIGHT)
        core, custom = client.CoreV1Api(k8s), client.CustomObjectsApi(k8s)
        create_namespace(core, "bench")
        create_namespace(core, "direct")
        del configuration

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
            now = time.monotonic() - started
            if t_pods is None and count_pods(core, "bench") >= pods_total:
                t_pods = now
            if t_pods is not None and t_bound is None and count_bound(core, "bench") >= pods_total:
                t_bound = time.monotonic() - started
            if t_pods is not None:
                counted, running = reporting(custom, "bench")
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

        time.sleep(5)  # let the last status writes land before the quiet window opens
        quiet_start = operator_requests(port)
        kopf_quiet_start = group_patches_by_kopf(cp)
        cpu_quiet_start = sampler.cpu_seconds()
        time.sleep(quiet_seconds)
        quiet_end = operator_requests(port)
        quiet_writes = sum(v - quiet_start.get(k, 0) for k, v in quiet_end.items() if k[0] in WRITE_VERBS)
        quiet_writes += group_patches_by_kopf(cp) - kopf_quiet_start
        cpu_quiet = sampler.cpu_seconds() - cpu_quiet_start
        sampler.stop()

        baseline = direct_baseline(core, "direct", pods_total)
        by_verb: dict[str, float] = {}
        for (verb, _, _), value in requests_busy.items():
            by_verb[verb] = by_verb.get(verb, 0) + value
        return {
            "gang": gang,
            "groups": groups,
            "pods": pods_total,
            "nodes": nodes,
            "submit_seconds": submitted,
            "pods_exist_seconds": t_pods,
            "pods_bound_seconds": t_bound,
            "groups_report_seconds": t_reported,
            "groups_running_seconds": t_running,
            "direct_create_seconds": baseline,
            "direct_in_flight": MAX_IN_FLIGHT,
            "operator_requests": by_verb,
            "operator_requests_total": sum(by_verb.values()),
            "kopf_group_patches": kopf_patches_busy,
            "peak_rss_mb": sampler.peak_rss / 2**20,
            "cpu_seconds": cpu_busy,
            "quiet_seconds": quiet_seconds,
            "quiet_writes_per_minute": quiet_writes * 60 / quiet_seconds,
            "quiet_cpu_seconds": cpu_quiet,
        }
    finally:
        if operator is not None and operator.poll() is None:
            operator.terminate()
            try:
                operator.wait(timeout=15)
            except subprocess.TimeoutExpired:
                operator.kill()
        cp.stop()


def report(result: dict[str, Any]) -> str:
    pods = result["pods"]
    anchor = GROUP_ANCHOR_SECONDS * pods / 1000
    t_pods = result["pods_exist_seconds"]

    def secs(value: float | None) -> str:
        return "not reached" if value is None else f"{value:.1f} s"

    def ratio(value: float | None, base: float) -> str:
        return "-" if value is None else f"{value / base:.2f}x"

    requests = ", ".join(f"{verb} {int(n)}" for verb, n in sorted(result["operator_requests"].items()))
    lines = [
        f"{'Gang placement on' if result.get('gang') else 'Gang placement off'}: "
        f"{result['groups']} groups x {PODS_PER_GROUP} pods ({REPLICAS} replicas x world size {WORLD_SIZE}) = "
        f"{pods} pods on {result['nodes']} kwok nodes; real kube-apiserver, etcd, kube-scheduler, "
        "kube-controller-manager; operator `iwg-operator -A` in its own process.",
        "",
        f"| measure | value | vs Grove ScaleTest_1000 | vs direct creates (same run, {result['direct_in_flight']} "
        "in flight) |",
        "|---|---|---|---|",
        f"| groups submitted (16 in flight) | {secs(result['submit_seconds'])} | | |",
        f"| all {pods} pods exist | {secs(t_pods)} | {ratio(t_pods, anchor)} of {anchor:.1f} s | "
        f"{ratio(t_pods, result['direct_create_seconds'])} of {result['direct_create_seconds']:.1f} s |",
        f"| all {pods} pods bound to nodes (the scheduler) | {secs(result.get('pods_bound_seconds'))} | | |",
        f"| every group's status counts its pods | {secs(result['groups_report_seconds'])} | | |",
        f"| every group Running (all replicas ready) | {secs(result['groups_running_seconds'])} | | |",
        f"| operator API requests (own layer) | {int(result['operator_requests_total'])} ({requests}) | | |",
        f"| Kopf's annotation patches on groups | {int(result['kopf_group_patches'])} | | |",
        f"| operator peak RSS | {result['peak_rss_mb']:.0f} MB (target <= 200) | | |",
        f"| operator CPU until Running | {result['cpu_seconds']:.1f} s | | |",
        f"| API writes per quiet minute ({result['quiet_seconds']:.0f} s window) | "
        f"{result['quiet_writes_per_minute']:.1f} (target 0) | | |",
        f"| operator CPU in the quiet window | {result['quiet_cpu_seconds']:.2f} s | | |",
    ]
    return "\n".join(lines)


def compare(plain: dict[str, Any], gang: dict[str, Any]) -> str:
    """The gang run against the run without it (the same invocation, one after the other)."""
    rows = [
        ("all pods exist", "pods_exist_seconds"),
        ("all pods bound to nodes", "pods_bound_seconds"),
        ("every group's status counts its pods", "groups_report_seconds"),
        ("every group Running", "groups_running_seconds"),
    ]
    lines = ["| measure | gang off | gang on | gang on / off |", "|---|---|---|---|"]
    for label, key in rows:
        off, on = plain[key], gang[key]
        share = "-" if off is None or on is None else f"{on / off:.2f}x"
        lines.append(f"| {label} | {off or 0:.1f} s | {on or 0:.1f} s | {share} |")
    base = gang["direct_create_seconds"] / plain["direct_create_seconds"]
    lines.append(f"| direct creates (each run's own floor) | {plain['direct_create_seconds']:.1f} s | "
                 f"{gang['direct_create_seconds']:.1f} s | {base:.2f}x |")  # fmt: skip
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
        "--gang", action="store_true", help="a second run with gang placement on, compared with the first"
    )
    args = parser.parse_args(argv)
    result = run(args.groups, args.quiet_seconds)
    text = report(result)
    if args.gang:
        gang = run(args.groups, args.quiet_seconds, gang=True)
        text += "\n\n" + report(gang) + "\n\n" + compare(result, gang)
        if args.json:
            print(json.dumps(gang, indent=1))
    print(text)
    if args.json:
        print(json.dumps(result, indent=1))
    if args.write_docs:
        command = (
            f"python -m bench.operator_scale --groups {args.groups} --quiet-seconds {args.quiet_seconds:.0f}"
            + (" --gang" if args.gang else "")
        )
        write_docs(text, command)
    return 0


if __name__ == "__main__":
    sys.exit(main())
