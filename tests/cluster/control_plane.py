"""A real Kubernetes control plane on loopback, for tests and for people (`make cluster-up`).

etcd and kube-apiserver always; kube-scheduler, kube-controller-manager and kwok (which keeps
simulated GPU nodes Ready and runs the pods bound to them) on request. Every process runs in its
own process group and is stopped by pid; every file lives in one temporary directory.
"""

from __future__ import annotations

import base64
import contextlib
import ctypes
import json
import os
import secrets
import shutil
import signal
import socket
import ssl
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil
import yaml
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import rsa
from kubernetes import config
from kubernetes.client import ApiClient

from tests.cluster import binaries
from tests.cluster.gpu_nodes import GpuNodePool

KWOK_STAGES = Path(__file__).resolve().parent / "kwok-stages.yaml"
SERVICE_CLUSTER_IP_RANGE = "10.96.0.0/16"
SERVICE_ACCOUNT_ISSUER = "https://kubernetes.default.svc.cluster.local"
ADMIN_USER = "iwg-admin"

# The controllers the tests rely on (ownership, namespaces, service accounts and their tokens,
# workloads, endpoints, disruption budgets); everything else stays off to keep the process light.
CONTROLLERS = (
    "garbagecollector",
    "namespace",
    "serviceaccount",
    "serviceaccount-token",
    "root-ca-cert-publisher",
    "replicaset",
    "deployment",
    "statefulset",
    "job",
    "endpointslice",
    "disruption",
)


class StartupError(RuntimeError):
    pass


class KubectlError(subprocess.CalledProcessError):
    def __str__(self) -> str:
        return f"{super().__str__()}\nstderr: {self.stderr.strip()}"


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def _kill_with_parent() -> None:
    """Runs in the child before exec: a test run that dies abruptly takes its cluster with it."""
    pr_set_pdeathsig = 1
    ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL)


@dataclass(frozen=True)
class ProcessRecord:
    """Enough to find a started process again, and to be sure it is still the same process."""

    name: str
    pid: int
    create_time: float

    def alive(self) -> bool:
        try:
            proc = psutil.Process(self.pid)
            return abs(proc.create_time() - self.create_time) < 0.01 and proc.status() != psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return False


def stop_processes(records: Sequence[ProcessRecord], grace_s: float = 3.0) -> None:
    """SIGTERM each process group, SIGKILL what is still there after the grace period."""
    live = [r for r in records if r.alive()]
    for rec in live:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(rec.pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while any(r.alive() for r in live) and time.monotonic() < deadline:
        time.sleep(0.05)
    for rec in live:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(rec.pid, signal.SIGKILL)


@dataclass
class _Proc:
    record: ProcessRecord
    popen: subprocess.Popen[bytes] | None
    log: Path


class ControlPlane:
    """One control plane. `start()` brings up etcd + kube-apiserver; the rest starts on request."""

    def __init__(self, *, die_with_parent: bool = True, name: str = "iwg") -> None:
        self.name = name
        self.die_with_parent = die_with_parent
        self.workdir = Path(tempfile.mkdtemp(prefix=f"{name}-cp-"))
        self.token = secrets.token_hex(24)
        self.port = 0
        self.startup_seconds: dict[str, float] = {}
        self._procs: list[_Proc] = []
        self._nodes: GpuNodePool | None = None

    # -- public surface -------------------------------------------------------------------------

    @property
    def server(self) -> str:
        return f"https://127.0.0.1:{self.port}"

    @property
    def kubeconfig(self) -> Path:
        return self.workdir / "kubeconfig"

    @property
    def ca_file(self) -> Path:
        return self.workdir / "certs" / "apiserver.crt"

    @property
    def processes(self) -> list[ProcessRecord]:
        return [p.record for p in self._procs]

    @property
    def pids(self) -> list[int]:
        return [p.record.pid for p in self._procs]

    def running(self, name: str) -> bool:
        return any(p.record.name == name and p.record.alive() for p in self._procs)

    def bin(self, name: str) -> Path:
        return binaries.binary(name)

    def env(self) -> dict[str, str]:
        return {**os.environ, "KUBECONFIG": str(self.kubeconfig), "PATH": binaries.search_path()}

    def kubectl(
        self, *args: str, check: bool = True, input: str | None = None, timeout: float = 60
    ) -> subprocess.CompletedProcess[str]:
        cmd = [str(self.bin("kubectl")), "--kubeconfig", str(self.kubeconfig), *args]
        done = subprocess.run(
            cmd, capture_output=True, text=True, input=input, timeout=timeout, env=self.env()
        )
        if check and done.returncode != 0:
            raise KubectlError(done.returncode, cmd, done.stdout, done.stderr)
        return done

    def api_client(self) -> ApiClient:
        api: ApiClient = config.new_client_from_config(config_file=str(self.kubeconfig))  # type: ignore[no-untyped-call]
        return api

    # -- lifecycle ------------------------------------------------------------------------------

    def start(self) -> ControlPlane:
        """etcd and kube-apiserver, ready to serve; a kubeconfig for the admin at `.kubeconfig`."""
        t0 = time.monotonic()
        try:
            self._write_credentials()
            etcd_url = self._start_etcd()
            self._start_apiserver(etcd_url)
            self._write_kubeconfig()
        except BaseException:
            self.stop()
            raise
        self.startup_seconds["etcd+kube-apiserver"] = time.monotonic() - t0
        return self

    def start_scheduler(self) -> None:
        if self.running("kube-scheduler"):
            return
        t0 = time.monotonic()
        port = free_port()
        kc = str(self.kubeconfig)
        self._spawn(
            "kube-scheduler",
            [
                f"--kubeconfig={kc}",
                "--bind-address=127.0.0.1",
                f"--secure-port={port}",
                "--leader-elect=false",
            ],
        )
        self._wait_https("kube-scheduler", f"https://127.0.0.1:{port}/healthz", token=None)
        self.startup_seconds["kube-scheduler"] = time.monotonic() - t0

    def start_controller_manager(self, controllers: Sequence[str] = CONTROLLERS) -> None:
        if self.running("kube-controller-manager"):
            return
        t0 = time.monotonic()
        port = free_port()
        kc = str(self.kubeconfig)
        self._spawn(
            "kube-controller-manager",
            [
                f"--kubeconfig={kc}",
                "--bind-address=127.0.0.1",
                f"--secure-port={port}",
                "--leader-elect=false",
                f"--controllers={','.join(controllers)}",
                f"--service-account-private-key-file={self.workdir / 'sa.key'}",
                f"--root-ca-file={self.ca_file}",
                f"--service-cluster-ip-range={SERVICE_CLUSTER_IP_RANGE}",
            ],
        )
        self._wait_https("kube-controller-manager", f"https://127.0.0.1:{port}/healthz", token=None)
        self.startup_seconds["kube-controller-manager"] = time.monotonic() - t0

    def start_gpu_nodes(self, count: int = 4, gpus_per_node: int = 8) -> list[str]:
        """Starts kwok (once) and creates simulated GPU nodes; returns their names once Ready."""
        t0 = time.monotonic()
        if self._nodes is None:
            self._nodes = GpuNodePool(self.api_client())
        if not self.running("kwok"):
            self._spawn(
                "kwok",
                [
                    f"--config={KWOK_STAGES}",
                    f"--kubeconfig={self.kubeconfig}",
                ],
            )
        names = self._nodes.ensure(
            count=count, gpus_per_node=gpus_per_node, alive=lambda: self._alive("kwok")
        )
        self.startup_seconds.setdefault("kwok+gpu-nodes", time.monotonic() - t0)
        return names

    def stop(self) -> None:
        """Stops every process this control plane started and removes its files."""
        if self._nodes is not None:
            self._nodes.close()
            self._nodes = None
        stop_processes([p.record for p in self._procs])
        for proc in self._procs:
            if proc.popen is not None:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.popen.wait(timeout=5)
        shutil.rmtree(self.workdir, ignore_errors=True)

    def detach(self) -> dict[str, Any]:
        """Forgets the processes without stopping them; returns what `stop_detached` needs."""
        state = {
            "workdir": str(self.workdir),
            "server": self.server,
            "processes": [vars(p.record) for p in self._procs],
        }
        self._procs = []
        if self._nodes is not None:
            self._nodes.close()
            self._nodes = None
        return state

    # -- internals ------------------------------------------------------------------------------

    def _write_credentials(self) -> None:
        key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
        (self.workdir / "sa.key").write_bytes(
            key.private_bytes(
                serialization.Encoding.PEM,
                serialization.PrivateFormat.TraditionalOpenSSL,
                serialization.NoEncryption(),
            )
        )
        (self.workdir / "sa.pub").write_bytes(
            key.public_key().public_bytes(
                serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
            )
        )
        # token,user,uid,"group1,group2"
        (self.workdir / "tokens.csv").write_text(f'{self.token},{ADMIN_USER},{ADMIN_USER},"system:masters"\n')
        (self.workdir / "certs").mkdir()

    def _start_etcd(self) -> str:
        client, peer = free_port(), free_port()
        client_url, peer_url = f"http://127.0.0.1:{client}", f"http://127.0.0.1:{peer}"
        self._spawn(
            "etcd",
            [
                f"--name={self.name}",
                f"--data-dir={self.workdir / 'etcd'}",
                f"--listen-client-urls={client_url}",
                f"--advertise-client-urls={client_url}",
                f"--listen-peer-urls={peer_url}",
                f"--initial-advertise-peer-urls={peer_url}",
                f"--initial-cluster={self.name}={peer_url}",
                "--unsafe-no-fsync",
                "--log-level=warn",
            ],
        )
        self._wait_until("etcd", lambda: _http_ok(f"{client_url}/health"), timeout=30)
        return client_url

    def _start_apiserver(self, etcd_url: str) -> None:
        self.port = free_port()
        self._spawn(
            "kube-apiserver",
            [
                f"--etcd-servers={etcd_url}",
                "--bind-address=127.0.0.1",
                "--advertise-address=127.0.0.1",
                # The endpoint reconciler refuses loopback addresses; nothing here needs the
                # `kubernetes` Service to have endpoints.
                "--endpoint-reconciler-type=none",
                f"--secure-port={self.port}",
                f"--cert-dir={self.workdir / 'certs'}",
                f"--token-auth-file={self.workdir / 'tokens.csv'}",
                "--authorization-mode=Node,RBAC",
                f"--service-account-issuer={SERVICE_ACCOUNT_ISSUER}",
                f"--service-account-key-file={self.workdir / 'sa.pub'}",
                f"--service-account-signing-key-file={self.workdir / 'sa.key'}",
                f"--service-cluster-ip-range={SERVICE_CLUSTER_IP_RANGE}",
                # Lets PodSecurity, not the cluster-wide switch, be what refuses privileged pods.
                "--allow-privileged=true",
            ],
        )
        self._wait_https("kube-apiserver", f"{self.server}/readyz", token=self.token, timeout=60)

    def _write_kubeconfig(self) -> None:
        ca = base64.b64encode(self.ca_file.read_bytes()).decode()
        config = {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [
                {"name": self.name, "cluster": {"server": self.server, "certificate-authority-data": ca}}
            ],
            "users": [{"name": ADMIN_USER, "user": {"token": self.token}}],
            "contexts": [{"name": self.name, "context": {"cluster": self.name, "user": ADMIN_USER}}],
            "current-context": self.name,
        }
        self.kubeconfig.write_text(yaml.safe_dump(config))
        self.kubeconfig.chmod(0o600)

    def _spawn(self, name: str, args: list[str]) -> None:
        log = self.workdir / f"{name}.log"
        with log.open("ab") as out:
            popen = subprocess.Popen(
                [str(self.bin(name)), *args],
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                cwd=self.workdir,
                start_new_session=True,
                preexec_fn=_kill_with_parent if self.die_with_parent else None,
            )
        record = ProcessRecord(name, popen.pid, psutil.Process(popen.pid).create_time())
        self._procs.append(_Proc(record, popen, log))

    def _alive(self, name: str) -> bool:
        proc = next(p for p in reversed(self._procs) if p.record.name == name)
        return proc.popen is None or proc.popen.poll() is None

    def _log_tail(self, name: str, lines: int = 25) -> str:
        log = self.workdir / f"{name}.log"
        if not log.exists():
            return "(no log)"
        return "\n".join(log.read_text(errors="replace").splitlines()[-lines:])

    def _wait_until(self, name: str, ready: Callable[[], bool], timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not self._alive(name):
                raise StartupError(f"{name} exited during startup:\n{self._log_tail(name)}")
            if ready():
                return
            time.sleep(0.1)
        raise StartupError(f"{name} not ready after {timeout:.0f}s:\n{self._log_tail(name)}")

    def _wait_https(self, name: str, url: str, token: str | None, timeout: float = 60) -> None:
        # The serving certificates are generated at startup, so readiness is polled unverified;
        # clients verify against the kubeconfig's CA afterwards.
        context = ssl.create_default_context()
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._wait_until(name, lambda: _http_ok(url, headers=headers, context=context), timeout=timeout)


def _http_ok(url: str, headers: dict[str, str] | None = None, context: ssl.SSLContext | None = None) -> bool:
    request = urllib.request.Request(url, headers=headers or {})
    try:
        with urllib.request.urlopen(request, timeout=2, context=context) as response:
            return bool(response.status == 200)
    except (urllib.error.URLError, OSError):
        return False


def stop_detached(state: dict[str, Any]) -> None:
    """Stops a control plane that `detach()` let go of (see tests/cluster/down.py)."""
    stop_processes([ProcessRecord(**rec) for rec in state["processes"]])
    shutil.rmtree(state["workdir"], ignore_errors=True)


def dump_state(state: dict[str, Any], path: Path) -> None:
    path.write_text(json.dumps(state, indent=2))
