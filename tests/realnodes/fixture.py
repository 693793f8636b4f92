"""A cluster of real nodes for a test module: its own control plane (the one real kubelets join: the
nodelifecycle controller on, the apiserver reaching kubelets by InternalIP), two `RealNodes`, the CRD, one
namespace and the operator as its own process in the cluster network (as a pod would be: its prober reaches
the workers' addresses). One per module that asks for it, shared by its tests."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml
from iwg_operator.api import v1alpha1 as api
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from tests.cluster.control_plane import CONTROLLERS, ControlPlane
from tests.iwg_operator.conftest import Groups, install_crd
from tests.realnodes.nodes import WORKER_IMAGE, RealNodes

NAMESPACE = "realnodes"
AUTOSCALE_INTERVAL_S = "1"  # the test clusters' autoscaler looks every second
# The light image every node imported (tests/realnodes/image.sh); the kubelet must not try to pull it.
LIGHT = {"image": WORKER_IMAGE, "imagePullPolicy": "Never"}


def spread_workers(group: str) -> dict[str, Any]:
    """spec.scheduling.affinity that prefers the group's worker pods on different nodes (weight 100, by
    hostname): the scheduler spreads them where they fit."""
    return {
        "podAntiAffinity": {
            "preferredDuringSchedulingIgnoredDuringExecution": [
                {
                    "weight": 100,
                    "podAffinityTerm": {
                        "labelSelector": {
                            "matchLabels": {
                                "inference.iwg.dev/group": group,
                                "app.kubernetes.io/component": "worker",
                            }
                        },
                        "topologyKey": "kubernetes.io/hostname",
                    },
                }
            ]
        }
    }


@dataclass
class RealCluster:
    control_plane: ControlPlane
    nodes: RealNodes
    namespace: str
    operator: subprocess.Popen[bytes]

    @property
    def groups(self) -> Groups:
        return Groups(self.control_plane.api_client(), self.namespace)

    @property
    def core(self) -> client.CoreV1Api:
        return client.CoreV1Api(self.control_plane.api_client())

    def operator_log(self, lines: int = 30) -> str:
        return self.nodes.log_tail("operator", lines)

    def apply(self, manifest: dict[str, Any]) -> None:
        self.control_plane.kubectl("apply", "-n", self.namespace, "-f", "-", input=yaml.safe_dump(manifest))

    def remove(self, group: str, timeout: float = 120) -> None:
        """Deletes the group and waits until its pods are gone (pods being deleted are killed at once), so
        the next test starts on quiet nodes."""
        from tests.cluster.waiting import eventually

        self.groups.delete(group)
        selector = f"inference.iwg.dev/group={group}"
        for pod in self.core.list_namespaced_pod(self.namespace, label_selector=selector).items:
            with contextlib.suppress(ApiException):
                self.core.delete_namespaced_pod(pod.metadata.name, self.namespace, grace_period_seconds=0)
        eventually(
            lambda: not self.core.list_namespaced_pod(self.namespace, label_selector=selector).items,
            timeout,
            f"the pods of {group} gone",
            interval=0.5,
        )

    def model_volume(self, claim: str, host_path: Path, mount_path: str = "/models") -> dict[str, Any]:
        """A PersistentVolumeClaim `claim` bound to a read-only hostPath PersistentVolume of `host_path` (every
        node sees the host's files), as a cluster's pre-provisioned model volume (the persistentvolume-binder
        binds them); returns the group's spec.model.volume for it. Applying it again changes nothing."""
        volume = f"{self.namespace}-{claim}"
        manifests = [
            {
                "apiVersion": "v1",
                "kind": "PersistentVolume",
                "metadata": {"name": volume},
                "spec": {
                    "capacity": {"storage": "1Gi"},
                    "accessModes": ["ReadOnlyMany"],
                    "storageClassName": "",
                    "hostPath": {"path": str(host_path), "type": "Directory"},
                    "claimRef": {"namespace": self.namespace, "name": claim},
                },
            },
            {
                "apiVersion": "v1",
                "kind": "PersistentVolumeClaim",
                "metadata": {"name": claim},
                "spec": {
                    "accessModes": ["ReadOnlyMany"],
                    "storageClassName": "",
                    "volumeName": volume,
                    "resources": {"requests": {"storage": "1Gi"}},
                },
            },
        ]
        self.control_plane.kubectl(
            "apply", "-n", self.namespace, "-f", "-", input=yaml.safe_dump_all(manifests)
        )
        return {"claimName": claim, "mountPath": mount_path}

    def pid_of(self, pod: Any) -> int:
        """The host pid of the first process of the pod's (first) container."""
        return self.nodes.container_pid(pod.spec.node_name, pod.status.container_statuses[0].container_id)

    def signal_container(self, pod: Any, sig: signal.Signals) -> int:
        """Sends `sig` to the first process of the pod's (first) container; returns its host pid."""
        pid = self.pid_of(pod)
        os.kill(pid, sig)
        return pid

    def log_of(self, pod: str) -> str:
        """The pod's (current) container log, as `kubectl logs` gives it."""
        return str(self.control_plane.kubectl("logs", "-n", self.namespace, pod).stdout)

    def service_port(self, group: str) -> int:
        """A loopback port whose connections reach the group's driver Service as a client on the first node
        does: to its ClusterIP, which that node's kube-proxy turns into a ready driver pod's address (no
        retry: a refused connect closes the client's connection)."""
        service = next(
            s
            for s in self.core.list_namespaced_service(
                self.namespace, label_selector=f"inference.iwg.dev/group={group}"
            ).items
            if s.spec.cluster_ip not in (None, "None")
            and s.metadata.labels.get("app.kubernetes.io/component") == "driver"
        )
        return self.nodes.forward(
            service.spec.cluster_ip, service.spec.ports[0].port, via=self.nodes.names[0]
        )

    def wait_serving(self, group: str, replicas: int, timeout: float = 240) -> int:
        """Waits until `replicas` replicas are ready and the driver's Service answers with all of them;
        returns the Service's loopback port (`service_port`)."""
        from tests.cluster.waiting import eventually
        from tests.e2e.harness import answers, openai_client

        try:
            eventually(
                lambda: (self.groups.get(group).get("status") or {}).get("readyReplicas") == replicas,
                timeout,
                f"{replicas} replica(s) of {group} ready",
                interval=1.0,
            )
            self.ready_driver(group, timeout)
            port = self.service_port(group)
            api = openai_client("127.0.0.1", port)
            spec = self.groups.get(group)["spec"]
            eventually(
                lambda: answers(api, spec["model"]), timeout, "the driver's Service to answer", interval=1.0
            )
            # Ready pods are the operator's view; a test that faults one replica assumes every driver routes to
            # the others already (a worker joins a driver by its own connection, which can lag on a loaded
            # machine).
            eventually(
                lambda: self.drivers_serving(group, (spec.get("driver") or {}).get("port", 8000)) >= replicas,
                timeout,
                f"every ready driver of {group} routing to {replicas} replica(s)",
                interval=0.5,
            )
            return port
        except AssertionError as error:
            raise AssertionError(f"{error}\n{self.diagnose()}") from None

    def drivers_serving(self, group: str, port: int = 8000) -> int:
        """The fewest replicas any ready driver pod of `group` routes to (its /readyz); 0 while none is ready or
        one does not answer."""
        import json
        import urllib.request

        from tests.e2e.harness import driver_pods, pod_ready

        counts = []
        for pod in driver_pods(self.core, self.namespace, group):
            if pod.metadata.deletion_timestamp is not None or not pod_ready(pod) or not pod.status.pod_ip:
                continue
            try:
                local = self.nodes.forward(pod.status.pod_ip, port)
                with urllib.request.urlopen(f"http://127.0.0.1:{local}/readyz", timeout=5) as response:
                    counts.append(len(json.load(response)["serving_replicas"]))
            except (OSError, ValueError, KeyError):  # HTTPError (503: not ready) is an OSError
                return 0
        return min(counts, default=0)

    def diagnose(self) -> str:
        """Everything worth reading when a test on these nodes fails."""
        lines = ["==== pods"]
        for pod in self.core.list_namespaced_pod(self.namespace).items:
            statuses = [
                (s.name, s.ready, s.restart_count, s.state.to_dict())
                for s in pod.status.container_statuses or []
            ]
            lines.append(f"{pod.metadata.name} node={pod.spec.node_name} phase={pod.status.phase} {statuses}")
        events = self.control_plane.kubectl(
            "get",
            "events",
            "-n",
            self.namespace,
            "-o",
            "custom-columns=OBJ:.involvedObject.name,R:.reason,M:.message",
        )
        lines += ["==== events", events.stdout[-3000:], "==== operator", self.operator_log(30)]
        for pod in self.core.list_namespaced_pod(self.namespace).items:
            driver = pod.metadata.labels.get("app.kubernetes.io/component") == "driver"
            tail = "--tail=40" if driver else "--tail=12"
            logs = self.control_plane.kubectl(
                "logs", "-n", self.namespace, tail, pod.metadata.name, check=False
            )
            lines += [f"==== log of {pod.metadata.name}", (logs.stdout + logs.stderr)[-6000:]]
        for node in self.nodes.names:
            lines += [f"==== {node} kubelet", self.nodes.log_tail(f"{node}-kubelet", 10)]
        return "\n".join(lines)

    def ready_driver(self, group: str, timeout: float) -> Any:
        """A ready driver pod of `group`, once there is one."""
        from tests.cluster.waiting import eventually
        from tests.e2e.harness import driver_pods, pod_ready

        ready = eventually(
            lambda: [p for p in driver_pods(self.core, self.namespace, group) if pod_ready(p)],
            timeout,
            f"a driver of {group} ready",
        )
        return ready[0]


def smollm2_on_a_volume(
    cluster: RealCluster, name: str, world_size: int, health: dict[str, Any]
) -> dict[str, Any]:
    """The sharded SmolLM2 group on the light image, its converted model on a volume (a hostPath
    PersistentVolume of the host's directory; the pods see nothing else of the host's caches)."""
    from tests.e2e.harness import sharded_smollm2

    manifest = sharded_smollm2(name, world_size, health)
    spec = manifest["spec"]
    spec["worker"] = {**spec["worker"], **LIGHT}
    volume = cluster.model_volume("smollm2", Path(spec["model"]["path"]))
    spec["model"] = {**spec["model"], "volume": volume, "path": volume["mountPath"]}
    return manifest


@contextlib.contextmanager
def real_cluster_running(
    count: int = 2,
    extra_images: tuple[Path, ...] = (),
    test_environment: bool = True,
    namespace: str = NAMESPACE,
    log: Callable[[str], object] = lambda _: None,
    operator_env: dict[str, str] | None = None,
) -> Iterator[RealCluster]:
    """The cluster, up: `log` is told each step's time as it is done; `operator_env` is added to the
    operator's environment."""
    cp = ControlPlane(name="iwg-nodes")
    nodes = RealNodes(cp, count, extra_images, test_environment)
    cp.apiserver_args = tuple(nodes.apiserver_args())
    operator: subprocess.Popen[bytes] | None = None
    try:
        started = time.monotonic()
        cp.start()
        cp.start_scheduler()
        # The node lifecycle controller marks a node whose Lease stopped NotReady after the grace period (30 s
        # here, 50 s by default: the kubelets renew every 10 s either way) and taints it, as on any cluster;
        # the persistentvolume-binder binds model volumes' claims (model_volume).
        cp.start_controller_manager(
            (*CONTROLLERS, "nodelifecycle", "taint-eviction-controller", "persistentvolume-binder"),
            ["--node-monitor-grace-period=30s", "--node-monitor-period=2s"],
        )
        install_crd(cp)
        cp.kubectl("create", "namespace", namespace)
        log(f"  control plane, CRD and namespace: {time.monotonic() - started:.1f} s")
        started = time.monotonic()
        nodes.start()
        log(
            f"  {count} real nodes ({', '.join(nodes.names)}: kubelet, containerd, kube-proxy; CoreDNS), "
            f"Ready: {time.monotonic() - started:.1f} s"
        )
        started = time.monotonic()
        with (nodes.workdir / "operator.log").open("ab") as out:
            operator = subprocess.Popen(
                nodes.in_fabric(
                    [
                        str(Path(sys.executable).parent / "iwg-operator"),
                        "-n",
                        namespace,
                        "--log-level",
                        "info",
                    ]
                ),
                env={**os.environ, "KUBECONFIG": str(cp.kubeconfig), **(operator_env or {})},
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        time.sleep(1.0)
        if operator.poll() is not None:
            raise RuntimeError(f"iwg-operator exited:\n{nodes.log_tail('operator')}")
        log(f"  operator (iwg-operator): {time.monotonic() - started:.1f} s")
        yield RealCluster(cp, nodes, namespace, operator)
    finally:
        if operator is not None and operator.poll() is None:
            os.killpg(operator.pid, signal.SIGTERM)
            try:
                operator.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(operator.pid, signal.SIGKILL)
                operator.wait(timeout=5)
        nodes.stop()
        cp.stop()


@pytest.fixture(scope="module")
def real_cluster() -> Iterator[RealCluster]:
    if os.geteuid() != 0:
        pytest.skip("real nodes need root (namespaces, cgroups, containerd); CI runs as root")
    repo = Path(__file__).resolve().parents[2]
    if repo.is_relative_to("/tmp"):
        # Containers see the checkout (its .venv, whose scripts name their interpreter by absolute path) through a
        # bind mount at the same path, and the operator's pods mount an emptyDir at /tmp, which hides it.
        pytest.skip(
            f"the checkout {repo} is under /tmp, which the worker and driver pods mount over: clone elsewhere"
        )
    with real_cluster_running(operator_env={"IWG_AUTOSCALE_INTERVAL_S": AUTOSCALE_INTERVAL_S}) as cluster:
        yield cluster


@pytest.fixture
def cluster(real_cluster: RealCluster) -> Iterator[RealCluster]:
    """The module's cluster; the groups a test made are removed after it, their pods gone."""
    yield real_cluster
    listed = real_cluster.groups.custom.list_namespaced_custom_object(
        api.GROUP, api.VERSION, real_cluster.namespace, api.PLURAL
    )
    for group in listed["items"]:
        real_cluster.remove(group["metadata"]["name"])
