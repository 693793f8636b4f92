"""A group's pods run by real kubelets and containerd (tests/realnodes/nodes.py): what
the operator writes into a pod is what a real node enforces. The pods run the light image (Debian
libraries; the test environment and its Python bind-mounted read-only), see nodes.py."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml
from iwg_operator.api.v1alpha1 import load_manifest
from iwg_operator.builders.common import CURVE_MOUNT

from tests.cluster.waiting import eventually
from tests.e2e.harness import driver_pods, group_manifest, live_ready_workers, openai_client, pod_ready
from tests.realnodes.fixture import RealCluster, real_cluster, spread_workers
from tests.realnodes.nodes import GPU_RESOURCE, WORKER_IMAGE

__all__ = ["real_cluster"]

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

GROUP = "minilm"
SHM_SIZE = "192Mi"
SHM_KIB = 192 * 1024
RUN_AS = 65532
READY_TIMEOUT = 240


def mounts(pid: int) -> dict[str, tuple[str, str, str]]:
    """Mount point -> (filesystem type, mount options, super options) as the process sees them."""
    found = {}
    for line in Path(f"/proc/{pid}/mountinfo").read_text().splitlines():
        left, right = line.split(" - ")
        fields, (fstype, _source, super_options) = left.split(), right.split()
        found[fields[4]] = (fstype, fields[5], super_options)
    return found


def ids(pid: int) -> tuple[list[int], list[int]]:
    status = Path(f"/proc/{pid}/status").read_text()
    uid = re.search(r"^Uid:\s+(.*)$", status, re.MULTILINE)
    gid = re.search(r"^Gid:\s+(.*)$", status, re.MULTILINE)
    assert uid and gid
    return [int(u) for u in uid.group(1).split()], [int(g) for g in gid.group(1).split()]


@pytest.fixture(scope="module")
def serving(real_cluster: RealCluster) -> dict[str, Any]:
    """examples/minilm.yaml (two replicas) on the light image, serving; returns the group."""
    manifest = group_manifest(
        GROUP,
        worker={"image": WORKER_IMAGE, "imagePullPolicy": "Never", "shmSize": SHM_SIZE},
        driver={"cpu": "500m"},
    )
    cluster = real_cluster
    cluster.control_plane.kubectl("apply", "-n", cluster.namespace, "-f", "-", input=yaml.safe_dump(manifest))
    try:
        eventually(
            lambda: (cluster.groups.get(GROUP).get("status") or {}).get("readyReplicas") == 2,
            READY_TIMEOUT,
            "both replicas ready",
            interval=1.0,
        )
    except AssertionError as error:
        raise AssertionError(f"{error}\n{cluster.diagnose()}") from None
    return manifest


def test_a_group_on_real_kubelets_serves_embeddings_in_the_pods_the_operator_specified(
    real_cluster: RealCluster, serving: dict[str, Any]
) -> None:
    cluster, core = real_cluster, real_cluster.core
    driver = cluster.ready_driver(GROUP, READY_TIMEOUT)
    port = cluster.nodes.forward(driver.status.pod_ip, 8000)
    api = openai_client("127.0.0.1", port)
    sentences = ["The operator replaced the failed worker.", "A cat sat on the mat."]
    result = api.embeddings.create(model=serving["spec"]["model"]["servedName"], input=sentences)
    got = np.array([d.embedding for d in result.data])
    # The library's own answer, on the host: the worker image's model is the test environment's.
    from sentence_transformers import SentenceTransformer

    oracle = SentenceTransformer(str(load_manifest(serving).spec.model.resolved_path()), device="cpu")
    expected = oracle.encode(sentences, normalize_embeddings=True)
    cosine = (got * expected).sum(axis=1) / (np.linalg.norm(got, axis=1) * np.linalg.norm(expected, axis=1))
    assert got.shape == (2, 384)
    assert cosine.min() >= 0.9999, cosine
    table = cluster.control_plane.kubectl("get", "iwg", "-n", cluster.namespace).stdout
    assert GROUP in table and "Running" in table, table

    workers = live_ready_workers(core, cluster.namespace, GROUP)
    assert len(workers) == 2
    wrong: dict[str, Any] = {}
    for pod in workers:
        assert pod.spec.node_name in cluster.nodes.names
        pid = cluster.nodes.container_pid(pod.spec.node_name, pod.status.container_statuses[0].container_id)
        name = pod.metadata.name
        uids, gids = ids(pid)
        if set(uids) != {RUN_AS} or set(gids) != {RUN_AS}:
            wrong[f"{name} uid/gid"] = (uids, gids)  # the image has no user: root unless the pod says so
        seen = mounts(pid)
        shm = seen.get("/dev/shm", ("", "", ""))
        if shm[0] != "tmpfs" or f"size={SHM_KIB}k" not in shm[2].split(","):
            wrong[f"{name} /dev/shm"] = shm
        curve = seen.get(CURVE_MOUNT, ("", "", ""))
        # A Secret volume: the kubelet's tmpfs, mounted read-only.
        if curve[0] != "tmpfs" or "ro" not in curve[1].split(","):
            wrong[f"{name} {CURVE_MOUNT}"] = curve
        if "ro" not in seen["/"][1].split(","):
            wrong[f"{name} root filesystem"] = seen["/"]
    assert not wrong, wrong

    # Debugging a pod as on any cluster: the apiserver reaches the kubelet (egress through the relay).
    kubectl, first = cluster.control_plane.kubectl, workers[0].metadata.name
    assert kubectl("exec", "-n", cluster.namespace, first, "--", "id", "-u").stdout.strip() == str(RUN_AS)
    assert "iwg" in kubectl("logs", "-n", cluster.namespace, first).stdout.lower()
    assert (
        f"Node:             {workers[0].spec.node_name}/"
        in kubectl("describe", "pod", "-n", cluster.namespace, first).stdout
    )


def test_the_kubelet_runs_the_liveness_probe_the_operator_wrote(
    real_cluster: RealCluster, serving: dict[str, Any]
) -> None:
    """A worker that stops answering is restarted by the kubelet, through the probe of its pod spec: the
    operator (whose prober would replace the pod first) is paused meanwhile, so the kubelet alone acts."""
    cluster, core = real_cluster, real_cluster.core
    pod = live_ready_workers(core, cluster.namespace, GROUP)[0]
    name, restarts = pod.metadata.name, pod.status.container_statuses[0].restart_count
    pid = cluster.nodes.container_pid(pod.spec.node_name, pod.status.container_statuses[0].container_id)

    def restarted() -> bool:
        status = core.read_namespaced_pod(name, cluster.namespace).status.container_statuses[0]
        return bool(status.restart_count > restarts)

    probe = pod.spec.containers[0].liveness_probe
    os.killpg(cluster.operator.pid, signal.SIGSTOP)
    try:
        os.kill(pid, signal.SIGSTOP)
        stopped = time.monotonic()
        # failureThreshold periods, then the probe's own short grace (a stopped process does not drain).
        eventually(restarted, 150, f"the kubelet restarting {name}", interval=1.0)
        took = time.monotonic() - stopped
    except AssertionError as error:
        raise AssertionError(f"{error}\n{cluster.diagnose()}") from None
    finally:
        os.killpg(cluster.operator.pid, signal.SIGCONT)
    # With the pod's drain grace the kill would come at least this late after the stop.
    with_pod_grace = (
        probe.failure_threshold - 1
    ) * probe.period_seconds + pod.spec.termination_grace_period_seconds
    print(
        f"liveness: restarted {took:.1f} s after the stop (the pod's grace would take >= {with_pod_grace} s)"
    )
    assert took < with_pod_grace, (took, with_pod_grace)
    events = core.list_namespaced_event(cluster.namespace, field_selector=f"involvedObject.name={name}").items
    unhealthy = [e.message for e in events if e.reason == "Unhealthy" and "Liveness" in e.message]
    assert unhealthy and all("/healthz" in message for message in unhealthy), [e.message for e in events]


def test_simulated_gpus_of_a_device_plugin_are_scheduled_admitted_and_made_visible_by_the_kubelet(
    real_cluster: RealCluster,
) -> None:
    """The node's device plugin registers four GPUs with its kubelet: two pods of two GPUs each run there,
    each container given its own two devices in its environment by the kubelet's allocation; a fifth GPU is
    asked for in vain (Pending, unscheduled)."""
    cluster, core = real_cluster, real_cluster.core
    node = cluster.nodes.names[-1]
    cluster.nodes.advertise_gpus(node, 4)
    assert core.read_node(node).status.capacity.get(GPU_RESOURCE) == "4"

    def pod(name: str, gpus: int) -> dict[str, Any]:
        limits = {GPU_RESOURCE: str(gpus)}
        container = {
            "name": "c",
            "image": WORKER_IMAGE,
            "imagePullPolicy": "Never",
            "command": ["sleep", "600"],
            "resources": {"requests": limits, "limits": limits},
        }
        return {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": name},
            "spec": {"terminationGracePeriodSeconds": 0, "containers": [container]},
        }

    def visible(name: str) -> tuple[set[str], set[str]]:
        env = cluster.control_plane.kubectl("exec", "-n", cluster.namespace, name, "--", "env").stdout
        values = dict(line.split("=", 1) for line in env.splitlines() if "=" in line)
        ids = set(values.get("NVIDIA_VISIBLE_DEVICES", "").split(",")) - {""}
        indices = set(values.get("CUDA_VISIBLE_DEVICES", "").split(",")) - {""}
        return ids, indices

    names = ("two-gpus-a", "two-gpus-b", "one-more-gpu")
    for name, gpus in zip(names, (2, 2, 1), strict=True):
        core.create_namespaced_pod(cluster.namespace, pod(name, gpus))
    try:
        for name in names[:2]:
            running = eventually(
                lambda name=name: (
                    (p := core.read_namespaced_pod(name, cluster.namespace)).status.phase == "Running" and p
                ),
                60,
                f"{name} running",
            )
            assert running.spec.node_name == node
        (ids_a, indices_a), (ids_b, indices_b) = visible(names[0]), visible(names[1])
        assert len(ids_a) == len(ids_b) == 2 and not ids_a & ids_b, (ids_a, ids_b)
        assert ids_a | ids_b == {f"gpu-{i}" for i in range(4)}
        assert {f"gpu-{i}" for i in indices_a} == ids_a and {f"gpu-{i}" for i in indices_b} == ids_b
        waiting = core.read_namespaced_pod(names[2], cluster.namespace)
        assert waiting.status.phase == "Pending" and waiting.spec.node_name is None
    finally:
        for name in names:
            core.delete_namespaced_pod(name, cluster.namespace, grace_period_seconds=0)


def test_a_clusterip_service_reaches_the_driver_through_kube_proxy(
    real_cluster: RealCluster, serving: dict[str, Any]
) -> None:
    """From inside a worker pod (kubectl exec), the driver's ClusterIP Service answers: kube-proxy's rules on
    the node forward the virtual IP to the driver pod."""
    cluster, core = real_cluster, real_cluster.core
    service = next(
        s
        for s in core.list_namespaced_service(cluster.namespace).items
        if s.spec.cluster_ip not in (None, "None")
        and s.metadata.labels.get("app.kubernetes.io/component") == "driver"
    )
    port = service.spec.ports[0].port
    worker = live_ready_workers(core, cluster.namespace, GROUP)[0].metadata.name
    script = (
        "import urllib.request, sys; "
        f"print(urllib.request.urlopen('http://{service.spec.cluster_ip}:{port}/v1/models', timeout=5).status)"
    )
    answer = eventually(
        lambda: cluster.control_plane.kubectl(
            "exec", "-n", cluster.namespace, worker, "--", "python", "-c", script, check=False
        ).stdout.strip(),
        60,
        "the driver's ClusterIP to answer",
    )
    assert answer == "200"


# Clients in a worker pod (kubectl exec), where kube-proxy's rules on its node turn the ClusterIP into a driver
# pod's address: each sends one embedding request after another on a new connection, retrying a failed one up
# to `retries` times (0: a client without retries), until the stop file appears (in the pod's /tmp), then
# prints what it saw as one JSON line: requests answered, requests failed (after their retries, each with when
# it was sent, as the host's clock reads: a pod shares its kernel), attempts that failed.
CLIENTS = """
import json, os, sys, threading, time, urllib.request
url, stop, clients, model, retries = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4], int(sys.argv[5])
body = json.dumps({"model": model, "input": "owls at night"}).encode()
seen = {"ok": 0, "failed": [], "attempts_failed": 0}
lock = threading.Lock()
def attempt():
    request = urllib.request.Request(url, body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=30) as answer:
        if answer.status != 200 or len(json.loads(answer.read())["data"][0]["embedding"]) != 384:
            raise RuntimeError(f"status {answer.status}")
def client():
    while not os.path.exists(stop):
        for left in range(retries, -1, -1):
            sent = time.time()
            try:
                attempt()
                with lock:
                    seen["ok"] += 1
                break
            except Exception as error:
                with lock:
                    seen["attempts_failed"] += 1
                    if not left:
                        seen["failed"].append(
                            f"{type(error).__name__}: {error} (sent at {sent:.2f}, after {time.time() - sent:.1f} s)"
                        )
threads = [threading.Thread(target=client) for _ in range(clients)]
for t in threads: t.start()
for t in threads: t.join()
print(json.dumps(seen))
"""


class FollowedLogs:
    """`kubectl logs -f --timestamps` of a pod into a file, kept after the pod is gone (its logs go with it)."""

    def __init__(self, cluster: RealCluster, pod: str) -> None:
        cp = cluster.control_plane
        self.file = tempfile.TemporaryFile()  # noqa: SIM115 (read after the pod is gone, closed with the test)
        argv = ["logs", "-f", "--timestamps", "-n", cluster.namespace, pod]
        self.process = subprocess.Popen(
            [str(cp.bin("kubectl")), "--kubeconfig", str(cp.kubeconfig), *argv],
            stdout=self.file,
            stderr=subprocess.STDOUT,
            env=cp.env(),
        )

    def stop(self) -> None:
        self.process.terminate()
        self.process.wait(timeout=10)

    def tail(self, chars: int = 4000) -> str:
        self.file.seek(0)
        return self.file.read().decode(errors="replace")[-chars:]


class ClusterIpClients:
    """`CLIENTS` run in a worker pod against the group's driver Service (its ClusterIP)."""

    STOP = "/tmp/clusterip-clients-stop"

    def __init__(
        self, cluster: RealCluster, model: str, pod: str, clients: int = 2, retries: int = 0
    ) -> None:
        core = cluster.core
        service = next(
            s
            for s in core.list_namespaced_service(cluster.namespace).items
            if s.spec.cluster_ip not in (None, "None")
            and s.metadata.labels.get("app.kubernetes.io/component") == "driver"
        )
        url = f"http://{service.spec.cluster_ip}:{service.spec.ports[0].port}/v1/embeddings"
        self.cp = cluster.control_plane
        self.exec_in = ["exec", "-n", cluster.namespace, pod, "--"]
        self.cp.kubectl(*self.exec_in, "rm", "-f", self.STOP)
        argv = [*self.exec_in, "python", "-c", CLIENTS, url, self.STOP, str(clients), model, str(retries)]
        self.process = subprocess.Popen(
            [str(self.cp.bin("kubectl")), "--kubeconfig", str(self.cp.kubeconfig), *argv],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=self.cp.env(),
        )

    def stop(self) -> dict[str, Any]:
        """Stops the clients; what they saw."""
        self.cp.kubectl(*self.exec_in, "touch", self.STOP, check=False)
        out, err = self.process.communicate(timeout=60)
        assert self.process.returncode == 0, err.decode()[-2000:]
        seen: dict[str, Any] = json.loads(out.decode().strip().splitlines()[-1])
        return seen


def test_a_driver_rollout_through_a_clusterip_and_real_kube_proxy_fails_no_request(
    real_cluster: RealCluster, serving: dict[str, Any]
) -> None:
    """A new driver pod template (here its CPU) rolls the driver Deployment while clients in a worker pod
    send requests to the ClusterIP without retries: the surge pod is Ready before the old one stops, and the
    old one's lame duck (spec.driver.lameDuckSeconds, default 5) outlasts the EndpointSlice update reaching
    the node's real kube-proxy (which applies changes at most every 3 s here), so no connection is refused or
    cut."""
    cluster, core = real_cluster, real_cluster.core
    before = {p.metadata.name for p in driver_pods(core, cluster.namespace, GROUP)}
    worker = live_ready_workers(core, cluster.namespace, GROUP)[0].metadata.name
    # The old drivers' logs, kept as they are written: a pod's logs go with it.
    logs = {name: FollowedLogs(cluster, name) for name in before}
    clients = ClusterIpClients(cluster, serving["spec"]["model"]["servedName"], worker)
    try:
        time.sleep(3.0)  # load before the change
        patched = time.time()
        cluster.groups.patch(GROUP, {"driver": {"cpu": "400m"}})

        def rolled() -> bool:
            pods = driver_pods(core, cluster.namespace, GROUP)
            return bool(pods) and all(p.metadata.name not in before and pod_ready(p) for p in pods)

        try:
            eventually(
                rolled, READY_TIMEOUT, "the driver rolled onto a new pod, the old one gone", interval=0.5
            )
        except AssertionError as error:
            raise AssertionError(f"{error}\n{cluster.diagnose()}") from None
        time.sleep(3.0)  # load after it
    finally:
        seen = clients.stop()
        for followed in logs.values():
            followed.stop()
    print(f"driver rollout through kube-proxy: {seen['ok']} answered, {len(seen['failed'])} failed")
    if seen["failed"]:
        said = [f"==== patched at {patched:.2f}"]
        for name, followed in logs.items():
            said += [f"==== old driver {name}", followed.tail()]
        for pod in driver_pods(core, cluster.namespace, GROUP):
            done = cluster.control_plane.kubectl(
                "logs", "--timestamps", "-n", cluster.namespace, pod.metadata.name, check=False
            )
            said += [f"==== new driver {pod.metadata.name}", done.stdout[-4000:]]
        for pod in live_ready_workers(core, cluster.namespace, GROUP):
            done = cluster.control_plane.kubectl(
                "logs", "--timestamps", "-n", cluster.namespace, pod.metadata.name, check=False
            )
            said += [f"==== worker {pod.metadata.name}", done.stdout[-3000:]]
        raise AssertionError(f"{seen['failed'][:5]}\n" + "\n".join(said) + f"\n{cluster.diagnose()}")
    assert seen["ok"] >= 20, seen


# Node loss is the module's last test: the node it powers off stays off.
NODE_LOSS_TOLERATION_S = 5
NODE_LOSS_TIMEOUT = 300


def test_a_powered_off_node_loses_its_replica_which_serves_again_on_the_other_node(
    real_cluster: RealCluster, serving: dict[str, Any]
) -> None:
    """The node of one replica (not the driver's) loses power: its kubelet, containerd and containers die,
    its link goes down. Clients with 2 retries (the openai client's default) through the ClusterIP lose no
    request; the replica serves again on the other node. The path, as on any cluster: the operator's prober
    replaces the silent worker; the replacement may land on the dead node (still Ready for the node
    controller's grace period) and stays Pending there; the node goes NotReady and is tainted; the pods there
    are evicted after their toleration (spec.scheduling.tolerations: 5 s here, Kubernetes' default is 300 s),
    stay Terminating (no kubelet) and are force-deleted by the operator 30 s past their deletion deadline;
    the next replacement goes to the live node."""
    cluster, core = real_cluster, real_cluster.core
    tolerations = [
        {"key": key, "operator": "Exists", "effect": "NoExecute", "tolerationSeconds": NODE_LOSS_TOLERATION_S}
        for key in ("node.kubernetes.io/unreachable", "node.kubernetes.io/not-ready")
    ]
    spread = spread_workers(GROUP)
    # Two workers and the driver fit on one node (2 CPUs) once one node is gone.
    cluster.groups.patch(
        GROUP, {"worker": {"cpu": "600m"}, "scheduling": {"tolerations": tolerations, "affinity": spread}}
    )

    def placed() -> dict[str, str] | None:
        workers = live_ready_workers(core, cluster.namespace, GROUP)
        if len(workers) != 2 or any(
            p.spec.containers[0].resources.requests["cpu"] != "600m" for p in workers
        ):
            return None
        return {p.metadata.name: p.spec.node_name for p in workers}

    try:
        nodes_of = eventually(placed, READY_TIMEOUT, "both replicas rolled onto the new spec", interval=1.0)
    except AssertionError as error:
        raise AssertionError(f"{error}\n{cluster.diagnose()}") from None
    driver_node = next(p.spec.node_name for p in driver_pods(core, cluster.namespace, GROUP) if pod_ready(p))
    lost = [node for node in set(nodes_of.values()) if node != driver_node]
    assert lost, f"both workers on the driver's node {driver_node}: {nodes_of}"
    survivor = next(name for name, node in nodes_of.items() if node == driver_node)
    clients = ClusterIpClients(cluster, serving["spec"]["model"]["servedName"], survivor, retries=2)
    try:
        time.sleep(3.0)
        started = time.monotonic()
        cluster.nodes.power_off(lost[0])

        def serving_again() -> bool:
            workers = live_ready_workers(core, cluster.namespace, GROUP)
            return len(workers) == 2 and all(p.spec.node_name == driver_node for p in workers)

        try:
            eventually(
                serving_again, NODE_LOSS_TIMEOUT, "two replicas serving on the live node", interval=1.0
            )
        except AssertionError as error:
            raise AssertionError(f"{error}\n{cluster.diagnose()}") from None
        took = time.monotonic() - started
        time.sleep(3.0)
    finally:
        seen = clients.stop()
    events = core.list_namespaced_event(
        cluster.namespace, field_selector=f"involvedObject.name={GROUP}"
    ).items
    said = [f"{e.reason}: {e.message}" for e in events if e.reason in ("WorkerUnhealthy", "ForceDeletedPods")]
    print(
        f"node {lost[0]} powered off: two replicas serving again on {driver_node} after {took:.0f} s; "
        f"{seen['ok']} requests answered, {len(seen['failed'])} failed with 2 retries, "
        f"{seen['attempts_failed']} attempts failed; {said}"
    )
    assert seen["failed"] == [], seen["failed"][:5]
    assert seen["ok"] >= 20, seen
