"""Recovery from worker faults: detection and recovery times and failed requests, per fault.

    python -m bench.recovery [--clients 2]      (root: real nodes; a checkout outside /tmp)

A local cluster of real nodes (tests/realnodes: real control plane, two kubelets with containerd,
kube-proxy and CoreDNS, the operator as its own process in the cluster network; real MiniLM workers and
driver on the light image, 500m each). Clients send embedding requests through the group's driver Service
(its ClusterIP, through the first node's kube-proxy) for the whole run. Faults, one at a time, each on a group
serving in full:

- SIGKILL of a worker (restartPolicy Pod): the process dies; the kubelet and the prober see it.
- SIGSTOP of a worker: a hang the process check cannot see; only the deep health check times out.
- SIGKILL of the group's only driver: the kubelet restarts its container; the workers keep their model and
  join it. The clients do not retry (max_retries=0), so every request the outage cut counts.
- SIGKILL of one of two drivers (the same group, spec.driver.replicas raised to 2): the clients use the
  `openai` client's default retries (max_retries=2).

(A replica of several ranks holds its model sharded, which MiniLM's architecture does not allow: the rebuild of
a SmolLM2 replica of worldSize 3 after SIGKILL of rank 1 is timed by tests/realnodes/test_selfheal.py.)

Per fault: detected = fault until the operator deleted the pod(s); serving again = fault until the
replacement is ready and the group reports every replica ready; failed requests during the episode. For the
driver rows: detected = fault until the group's DriverAvailable condition is False or a worker logs
`driver lost` (one driver), or until the killed driver's pod is not Ready (two drivers); serving again = fault
until the first request answered after the restarted driver pod is Ready (one driver), or until that pod is
Ready again (two drivers: the other serves throughout). The
baseline measured in the same run is a worker's cold start (group created until its first replica is ready):
recovery can hardly be faster than that, and `ratio` compares the two. The bound for a hang is
periodSeconds x failureThreshold + timeoutSeconds.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from dataclasses import dataclass

from tests.cluster.waiting import eventually
from tests.e2e.harness import (
    Load,
    await_replacement,
    driver_pods,
    group_manifest,
    live_ready_workers,
    pod_ready,
)
from tests.realnodes.fixture import RealCluster, real_cluster_running
from tests.realnodes.nodes import WORKER_IMAGE

PERIOD, THRESHOLD, TIMEOUT = 2, 2, 1
HEALTH = {
    "periodSeconds": PERIOD,
    "timeoutSeconds": TIMEOUT,
    "failureThreshold": THRESHOLD,
    "backoffSeconds": 0,
}
MODEL = "all-MiniLM-L6-v2"
DRIVER_LOST = "driver lost: no ping"  # a worker's line when its driver's pings stop
OPENAI_DEFAULT_RETRIES = 2


@dataclass
class Row:
    fault: str
    detected_s: float
    ready_s: float
    ok: int
    failed: int


def start_group(cluster: RealCluster, name: str, **spec: object) -> tuple[int, float]:
    """The group applied and serving; the port of its Service (`RealCluster.service_port`) and its cold start."""
    started = time.monotonic()
    manifest = group_manifest(
        name,
        worker={"image": WORKER_IMAGE, "imagePullPolicy": "Never", "cpu": "500m"},
        driver={"cpu": "500m"},
        **spec,
    )
    cluster.apply(manifest)
    port = cluster.wait_serving(name, int(manifest["spec"]["replicas"]), 300)
    cold = time.monotonic() - started
    time.sleep(PERIOD * 2)  # every worker answered the prober once: supervised
    return port, cold


def episode(
    cluster: RealCluster,
    name: str,
    port: int,
    replicas: int,
    fault: signal.Signals,
    label: str,
    clients: int,
    rank: int,
) -> Row:
    core, groups = cluster.core, cluster.groups
    load = Load("127.0.0.1", MODEL, clients=clients, port=port).start()
    time.sleep(2)
    workers = live_ready_workers(core, cluster.namespace, name)
    replica0 = [p for p in workers if p.metadata.labels["inference.iwg.dev/replica"] == "0"]
    victim = next(p for p in replica0 if p.metadata.labels["inference.iwg.dev/rank"] == str(rank))
    victims = replica0 if len(replica0) > 1 else [victim]
    started = time.monotonic()
    cluster.signal_container(victim, fault)
    recovery = await_replacement(core, groups, name, victims, started, replicas)
    time.sleep(2)
    load.stop()
    return Row(label, recovery.detected_s, recovery.ready_s, load.ok, len(load.failures))


def driver_lost_logged(cluster: RealCluster, lost_before: dict[str, int]) -> bool:
    """A worker logged that it lost its driver since `lost_before` was counted."""
    return any(cluster.log_of(pod).count(DRIVER_LOST) > count for pod, count in lost_before.items())


def single_driver_episode(cluster: RealCluster, name: str, port: int, clients: int) -> Row:
    core, namespace = cluster.core, cluster.namespace
    lost_before = {
        p.metadata.name: cluster.log_of(p.metadata.name).count(DRIVER_LOST)
        for p in live_ready_workers(core, namespace, name)
    }
    load = Load("127.0.0.1", MODEL, clients=clients, port=port).start()
    time.sleep(2)
    (driver,) = driver_pods(core, namespace, name)
    started = time.monotonic()
    killed = cluster.signal_container(driver, signal.SIGKILL)
    detected: float | None = None
    ready_at: float | None = None
    next_log_look = started
    while ready_at is None:
        now = time.monotonic()
        if now - started > 180:
            raise AssertionError("the driver did not come back within 180 s")
        if detected is None:
            down = (cluster.groups.condition(name, "DriverAvailable") or {}).get("status") == "False"
            if not down and now >= next_log_look:  # the logs are read twice a second, the status every loop
                next_log_look = now + 0.5
                down = driver_lost_logged(cluster, lost_before)
            if down:
                detected = time.monotonic() - started
        elif any(pod_ready(p) and cluster.pid_of(p) != killed for p in driver_pods(core, namespace, name)):
            ready_at = time.monotonic()
        time.sleep(0.05)
    time.sleep(10)
    load.stop()
    answered = sorted(sent + took for sent, took in load.latencies if sent + took > ready_at)
    serving = (answered[0] if answered else float("inf")) - started
    print(f"one driver: its pod Ready again {ready_at - started:.2f} s after the SIGKILL", file=sys.stderr)
    return Row("SIGKILL the only driver", detected or 0.0, serving, load.ok, len(load.failures))


def two_driver_episode(cluster: RealCluster, name: str, port: int, clients: int) -> Row:
    core, namespace = cluster.core, cluster.namespace
    cluster.groups.patch(name, {"driver": {"replicas": 2}})

    def two_ready() -> bool:
        pods = driver_pods(core, namespace, name)
        return len(pods) == 2 and all(pod_ready(p) and not p.metadata.deletion_timestamp for p in pods)

    eventually(two_ready, 180, "two drivers ready")
    load = Load("127.0.0.1", MODEL, clients=clients, port=port, max_retries=OPENAI_DEFAULT_RETRIES).start()
    time.sleep(2)
    victim = driver_pods(core, namespace, name)[0]
    started = time.monotonic()
    killed = cluster.signal_container(victim, signal.SIGKILL)
    detected: float | None = None
    ready: float | None = None
    while ready is None:
        if time.monotonic() - started > 180:
            raise AssertionError("the killed driver did not come back within 180 s")
        (pod,) = [p for p in driver_pods(core, namespace, name) if p.metadata.name == victim.metadata.name]
        if detected is None and not pod_ready(pod):
            detected = time.monotonic() - started
        if detected is not None and pod_ready(pod) and cluster.pid_of(pod) != killed:
            ready = time.monotonic() - started
        time.sleep(0.05)
    time.sleep(5)
    load.stop()
    return Row("SIGKILL one of two drivers", detected or 0.0, ready, load.ok, len(load.failures))


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--clients", type=int, default=2)
    args = parser.parse_args()
    rows: list[Row] = []
    colds: list[float] = []
    if os.geteuid() != 0:
        print("bench.recovery needs root (real nodes: namespaces, cgroups, containerd)", file=sys.stderr)
        return 2
    with real_cluster_running(namespace="bench", log=lambda line: print(line, file=sys.stderr)) as cluster:
        port, cold = start_group(cluster, "single", replicas=2, health={**HEALTH, "restartPolicy": "Pod"})
        colds.append(cold)
        for fault, label in ((signal.SIGKILL, "SIGKILL worker"), (signal.SIGSTOP, "SIGSTOP worker (hang)")):
            rows.append(episode(cluster, "single", port, 2, fault, label, args.clients, rank=0))
            print(f"{label}: done", file=sys.stderr)
        rows.append(single_driver_episode(cluster, "single", port, args.clients))
        print("SIGKILL driver: done", file=sys.stderr)
        rows.append(two_driver_episode(cluster, "single", port, args.clients))
        print("SIGKILL one of two drivers: done", file=sys.stderr)

    baseline = min(colds)
    print(
        f"\nhealth: periodSeconds={PERIOD} failureThreshold={THRESHOLD} timeoutSeconds={TIMEOUT}; "
        f"hang bound {PERIOD * THRESHOLD + TIMEOUT} s; {args.clients} clients throughout (no retries, but "
        f"{OPENAI_DEFAULT_RETRIES} for the two-driver row)"
    )
    print(
        f"baseline: cold start of a group until its replicas serve: {baseline:.1f} s (min of {len(colds)})\n"
    )
    print(f"| {'fault':<30} | detected s | serving again s | vs cold start | requests ok | failed |")
    print(f"|{'-' * 32}|-----------:|----------------:|--------------:|------------:|-------:|")
    for row in rows:
        print(
            f"| {row.fault:<30} | {row.detected_s:10.2f} | {row.ready_s:15.2f} | {row.ready_s / baseline:12.2f}x "
            f"| {row.ok:11d} | {row.failed:6d} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
