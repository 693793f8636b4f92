"""The whole local stack in one context manager, for people (`make demo`) and for bench/recovery.py:
control plane (apiserver, scheduler, controller manager), the CRD, the node agent, the operator as its own
process. Everything it starts is stopped, and everything it creates removed, on exit.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import TracebackType
from typing import Any

import yaml
from iwg_operator import crdgen
from kubernetes import client

from tests.cluster.control_plane import ControlPlane
from tests.iwg_operator.conftest import Groups
from tests.nodeagent.fixture import NodeAgentProcess


class LocalStack:
    def __init__(self, namespace: str = "demo", autoscale_interval_s: float = 1.0, log: Any = print) -> None:
        self.namespace = namespace
        self.autoscale_interval_s = autoscale_interval_s
        self.log = log
        self.control_plane: ControlPlane | None = None
        self.agent: NodeAgentProcess | None = None
        self.operator: subprocess.Popen[bytes] | None = None
        self.timings: dict[str, float] = {}

    def __enter__(self) -> LocalStack:
        try:
            self._start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def _step(self, name: str, started: float) -> None:
        self.timings[name] = time.monotonic() - started
        self.log(f"  {name}: {self.timings[name]:.1f} s")

    def _start(self) -> None:
        started = time.monotonic()
        cp = self.control_plane = ControlPlane(name="iwg-local").start()
        cp.start_scheduler()
        cp.start_controller_manager()
        self._step("control plane (etcd, kube-apiserver, scheduler, controller manager)", started)

        started = time.monotonic()
        crd = yaml.safe_load(crdgen.render_crd())
        cp.kubectl("apply", "--server-side", "-f", "-", input=yaml.safe_dump(crd))
        cp.kubectl("wait", "--for=condition=Established", f"crd/{crd['metadata']['name']}", "--timeout=60s")
        cp.kubectl("create", "namespace", self.namespace)
        core = client.CoreV1Api(cp.api_client())
        deadline = time.monotonic() + 30
        while not core.list_namespaced_service_account(self.namespace).items and time.monotonic() < deadline:
            time.sleep(0.1)
        self._step("CRD and namespace", started)

        started = time.monotonic()
        self.agent = NodeAgentProcess(cp.kubeconfig).start()
        self._step(
            f"node agent (nodes {', '.join(self.agent.nodes)}, pod network {self.agent.subnet})", started
        )

        started = time.monotonic()
        env = {
            **os.environ,
            "KUBECONFIG": str(cp.kubeconfig),
            "IWG_AUTOSCALE_INTERVAL_S": str(self.autoscale_interval_s),
        }
        with (cp.workdir / "operator.log").open("ab") as out:
            self.operator = subprocess.Popen(
                [
                    str(Path(sys.executable).parent / "iwg-operator"),
                    "-n",
                    self.namespace,
                    "--log-level",
                    "warning",
                ],
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        time.sleep(1.5)
        if self.operator.poll() is not None:
            raise RuntimeError(f"iwg-operator exited: {(cp.workdir / 'operator.log').read_text()[-2000:]}")
        self._step("operator (iwg-operator)", started)

    @property
    def groups(self) -> Groups:
        assert self.control_plane is not None
        return Groups(self.control_plane.api_client(), self.namespace)

    @property
    def core(self) -> client.CoreV1Api:
        assert self.control_plane is not None
        return client.CoreV1Api(self.control_plane.api_client())

    def close(self) -> None:
        if self.operator is not None and self.operator.poll() is None:
            self.operator.send_signal(signal.SIGTERM)
            try:
                self.operator.wait(timeout=20)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.operator.pid, signal.SIGKILL)
                self.operator.wait(timeout=5)
        if self.control_plane is not None and self.agent is not None:
            apps = client.AppsV1Api(self.control_plane.api_client())
            with contextlib.suppress(Exception):
                for deployment in apps.list_namespaced_deployment(self.namespace).items:
                    apps.delete_namespaced_deployment(deployment.metadata.name, self.namespace)
        if self.agent is not None:
            self.agent.stop()
        if self.control_plane is not None:
            self.control_plane.stop()
