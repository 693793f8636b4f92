"""Starting and stopping the node agent from tests: `NodeAgentProcess` and the session fixture `node_agent`."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

from tests.nodeagent import network

REPO_ROOT = Path(__file__).resolve().parents[2]
AGENT_NODES = ("agent-0", "agent-1")
# What every pod process gets on top of its own env: no network for model hubs, one thread per process
# (the machine has 2 cores shared by everything), unbuffered output for the logs.
POD_ENV = {
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "OMP_NUM_THREADS": "1",
    "MKL_NUM_THREADS": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "PYTHONUNBUFFERED": "1",
    # Test-only worker classes (tests/e2e/faulty_worker.py) are importable in pods.
    "PYTHONPATH": str(REPO_ROOT),
}


class NodeAgentProcess:
    def __init__(
        self,
        kubeconfig: Path,
        nodes: Sequence[str] = AGENT_NODES,
        *,
        gpus_per_node: int = 8,
        taint_gpu: bool = False,
        env: dict[str, str] | None = None,
        restart_backoff_s: float = 1.0,
    ) -> None:
        self.kubeconfig = kubeconfig
        self.nodes = list(nodes)
        self.workdir = Path(tempfile.mkdtemp(prefix="iwg-nodeagent-"))
        self.gpus_per_node = gpus_per_node
        self.taint_gpu = taint_gpu
        self.env = {**POD_ENV, **(env or {})}
        self.restart_backoff_s = restart_backoff_s
        self.popen: subprocess.Popen[bytes] | None = None
        self.state: dict[str, Any] = {}

    @property
    def log_path(self) -> Path:
        return self.workdir / "agent.log"

    @property
    def gateway(self) -> str:
        return str(self.state["gateway"])

    @property
    def subnet(self) -> str:
        return str(self.state["subnet"])

    @property
    def token(self) -> str:
        return str(self.state["token"])

    def start(self, timeout: float = 120) -> NodeAgentProcess:
        ready = self.workdir / "ready.json"
        cmd = [
            sys.executable,
            "-m",
            "tests.nodeagent",
            "--kubeconfig",
            str(self.kubeconfig),
            "--workdir",
            str(self.workdir),
            "--gpus",
            str(self.gpus_per_node),
            "--ready-file",
            str(ready),
            "--restart-backoff",
            str(self.restart_backoff_s),
        ]
        for node in self.nodes:
            cmd += ["--node", node]
        for key, value in self.env.items():
            cmd += ["--env", f"{key}={value}"]
        if self.taint_gpu:
            cmd.append("--taint-gpu")
        with self.log_path.open("ab") as out:
            self.popen = subprocess.Popen(
                cmd,
                cwd=REPO_ROOT,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        deadline = time.monotonic() + timeout
        while not ready.exists():
            if self.popen.poll() is not None:
                raise RuntimeError(f"node agent exited during startup:\n{self.log_tail()}")
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"node agent not ready after {timeout:.0f}s:\n{self.log_tail()}")
            time.sleep(0.1)
        self.state = json.loads(ready.read_text())
        return self

    def stop(self, timeout: float = 60) -> None:
        if self.popen is not None and self.popen.poll() is None:
            self.popen.send_signal(signal.SIGTERM)
            try:
                self.popen.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.popen.pid, signal.SIGKILL)
                self.popen.wait(timeout=10)
        if self.state:
            network.remove_agent_network(self.token)  # after a crash of the agent itself
        network.sweep_stale_agents()

    def log_tail(self, lines: int = 40) -> str:
        if not self.log_path.exists():
            return "(no log)"
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def container_log(self, namespace: str, pod: str, container: str, lines: int = 60) -> str:
        path = self.workdir / "logs" / f"{namespace}_{pod}_{container}.log"
        if not path.exists():
            return f"(no log for {namespace}/{pod}/{container})"
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])

    def pod_logs(self, namespace: str, lines: int = 30) -> str:
        out = []
        for path in sorted((self.workdir / "logs").glob(f"{namespace}_*.log")):
            tail = path.read_text(errors="replace").splitlines()[-lines:]
            out.append(f"==== {path.name}\n" + "\n".join(tail))
        return "\n".join(out)


@pytest.fixture(scope="module")
def node_agent(control_plane: Any, scheduler: Any, controller_manager: Any) -> Iterator[NodeAgentProcess]:
    """Two untainted nodes (agent-0, agent-1) with 8 nvidia.com/gpu each whose pods run as real processes.

    Module scope: the nodes exist only while a module that asks for them runs, so no other test's pods
    (which expect kwok's pretend nodes) are ever started as real processes.
    """
    if os.geteuid() != 0:
        pytest.skip("the node agent needs root (network and mount namespaces); CI runs as root")
    agent = NodeAgentProcess(Path(control_plane.kubeconfig)).start()
    try:
        yield agent
    finally:
        agent.stop()
        shutil.rmtree(agent.workdir, ignore_errors=True)
