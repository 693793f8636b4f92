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
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client

from tests.cluster.control_plane import CONTROLLERS, ControlPlane
from tests.iwg_operator.conftest import Groups, install_crd
from tests.realnodes.nodes import RealNodes

NAMESPACE = "realnodes"


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


@contextlib.contextmanager
def real_cluster_running(
    count: int = 2, extra_images: tuple[Path, ...] = (), test_environment: bool = True
) -> Iterator[RealCluster]:
    cp = ControlPlane(name="iwg-nodes")
    nodes = RealNodes(cp, count, extra_images, test_environment)
    cp.apiserver_args = tuple(nodes.apiserver_args())
    operator: subprocess.Popen[bytes] | None = None
    try:
        cp.start()
        cp.start_scheduler()
        # The node lifecycle controller marks a node whose Lease stopped NotReady after the grace period (30 s
        # here, 50 s by default: the kubelets renew every 10 s either way) and taints it, as on any cluster.
        cp.start_controller_manager(
            (*CONTROLLERS, "nodelifecycle", "taint-eviction-controller"),
            ["--node-monitor-grace-period=30s", "--node-monitor-period=2s"],
        )
        install_crd(cp)
        cp.kubectl("create", "namespace", NAMESPACE)
        nodes.start()
        with (nodes.workdir / "operator.log").open("ab") as out:
            operator = subprocess.Popen(
                nodes.in_fabric(
                    [
                        str(Path(sys.executable).parent / "iwg-operator"),
                        "-n",
                        NAMESPACE,
                        "--log-level",
                        "info",
                    ]
                ),
                env={**os.environ, "KUBECONFIG": str(cp.kubeconfig)},
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        time.sleep(1.0)
        if operator.poll() is not None:
            raise RuntimeError(f"iwg-operator exited:\n{nodes.log_tail('operator')}")
        yield RealCluster(cp, nodes, NAMESPACE, operator)
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
    with real_cluster_running() as cluster:
        yield cluster
