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
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable, Sequence
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

# Set to 1 to keep each stopped control plane's directory (component logs, etcd data) for debugging.
KEEP_FILES_ENV = "IWG_KEEP_CLUSTER_FILES"
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
# Gang placement (Kubernetes 1.37: beta, off by default): the feature gate on the apiserver, scheduler and
# controller manager, the API group version on the apiserver, and the controller that lifts a deleted
# PodGroup's protection finalizer once its pods are gone (without it the PodGroup stays Terminating).
GANG_FEATURE_GATES = ("GenericWorkload",)
GANG_RUNTIME_CONFIG = ("scheduling.k8s.io/v1beta1",)
GANG_CONTROLLERS = ("podgroup-protection-controller",)


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


def stop_processes(records: Sequence[ProcessRecord], grace_s: float = 0.5) -> None:
    """SIGTERM each process group, SIGKILL what is still there after the grace period.

    The grace is short on purpose: kube-apiserver drains for many seconds and etcd waits for the
    apiserver's connections, and nothing they would save survives the data directory's removal.
    """
    live = [r for r in records if r.alive()]
    for rec in live:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(rec.pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while any(r.alive() for r in live) and time.monotonic() < deadline:
        time.sleep(0.05)
    for rec in live:
        if rec.alive():  # never signal a pid that has since been reused
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(rec.pid, signal.SIGKILL)


def kill_until_gone(pids: Callable[[], Iterable[int]], pause_s: float = 0.02, tries: int = 50) -> None:
    """SIGKILLs what `pids()` lists until it lists nothing (a process tree that forks while it is killed:
    a pod's processes, a cgroup's)."""
    for _ in range(tries):
        found = list(pids())
        if not found:
            return
        for pid in found:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(pause_s)


@dataclass
class _Proc:
    record: ProcessRecord
    popen: subprocess.Popen[bytes] | None
    log: Path


class ControlPlane:
    """One control plane. `start()` brings up etcd + kube-apiserver; the rest starts on request."""

    def __init__(
        self,
        *,
        die_with_parent: bool = True,
        name: str = "iwg",
        feature_gates: Sequence[str] = (),
        runtime_config: Sequence[str] = (),
        apiserver_args: Sequence[str] = (),
    ) -> None:
        """`feature_gates` are turned on in the apiserver, scheduler and controller manager; `runtime_config`
        names API group versions the apiserver serves besides its defaults; `apiserver_args` are passed as they
        are."""
        self.name = name
        self.die_with_parent = die_with_parent
        self.feature_gates = tuple(feature_gates)
        self.runtime_config = tuple(runtime_config)
        self.apiserver_args = tuple(apiserver_args)
        self.workdir = Path(tempfile.mkdtemp(prefix=f"{name}-cp-"))
        self.token = secrets.token_hex(24)
        self.port = 0
        self.startup_seconds: dict[str, float] = {}
        self._procs: list[_Proc] = []
        self._nodes: GpuNodePool | None = None
        self._etcd_url = ""

    @classmethod
    def with_gang_scheduling(cls, **kwargs: Any) -> ControlPlane:
        """A control plane that serves Workload and PodGroup (scheduling.k8s.io/v1beta1) and schedules gangs."""
        return cls(feature_gates=GANG_FEATURE_GATES, runtime_config=GANG_RUNTIME_CONFIG, **kwargs)

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
            etcd_url = self._etcd_url = self._start_etcd()
            self._start_apiserver(etcd_url)
            self._write_kubeconfig()
        except BaseException:
            self.stop()
            raise
        self.startup_seconds["etcd+kube-apiserver"] = time.monotonic() - t0
        return self

    def start_scheduler(self, extra_args: Sequence[str] = ()) -> None:
        """kube-scheduler with its defaults; `extra_args` are passed as they are (a bench's client QPS)."""
        if self.running("kube-scheduler"):
            return
        t0 = time.monotonic()
        self._start_on_free_port(
            "kube-scheduler",
            lambda port: [
                f"--kubeconfig={self.kubeconfig}",
                "--bind-address=127.0.0.1",
                f"--secure-port={port}",
                "--leader-elect=false",
                *self._gate_flags(),
                *extra_args,
            ],
            health=lambda port: f"https://127.0.0.1:{port}/healthz",
        )
        self.startup_seconds["kube-scheduler"] = time.monotonic() - t0

    def start_controller_manager(
        self, controllers: Sequence[str] = CONTROLLERS, extra_args: Sequence[str] = ()
    ) -> None:
        if self.running("kube-controller-manager"):
            return
        if "GenericWorkload" in self.feature_gates:
            controllers = (*controllers, *GANG_CONTROLLERS)
        t0 = time.monotonic()
        self._start_on_free_port(
            "kube-controller-manager",
            lambda port: [
                f"--kubeconfig={self.kubeconfig}",
                "--bind-address=127.0.0.1",
                f"--secure-port={port}",
                "--leader-elect=false",
                f"--controllers={','.join(controllers)}",
                f"--service-account-private-key-file={self.workdir / 'sa.key'}",
                f"--root-ca-file={self.ca_file}",
                f"--service-cluster-ip-range={SERVICE_CLUSTER_IP_RANGE}",
                *self._gate_flags(),
                *extra_args,
            ],
            health=lambda port: f"https://127.0.0.1:{port}/healthz",
        )
        self.startup_seconds["kube-controller-manager"] = time.monotonic() - t0

    def start_gpu_nodes(
        self,
        count: int = 4,
        gpus_per_node: int = 8,
        prefix: str = "kwok-gpu-",
        labels: dict[str, str] | None = None,
    ) -> list[str]:
        """Starts kwok (once) and creates simulated GPU nodes `<prefix>0..count-1` (with `labels` besides the
        GPU ones, e.g. for a test's own pool); returns their names once Ready."""
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
            count=count,
            gpus_per_node=gpus_per_node,
            alive=lambda: self._alive("kwok"),
            prefix=prefix,
            labels=labels,
        )
        self.startup_seconds.setdefault("kwok+gpu-nodes", time.monotonic() - t0)
        return names

    def stop_component(self, name: str) -> None:
        """Stops one started component (kube-scheduler, kube-controller-manager, kube-apiserver)."""
        procs = [p for p in self._procs if p.record.name == name]
        stop_processes([p.record for p in procs], grace_s=5.0)
        for proc in procs:
            if proc.popen is not None:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.popen.wait(timeout=5)

    def restart_apiserver(self) -> None:
        """kube-apiserver stopped and started again on the same port and etcd (its data kept), with the
        current `feature_gates` and `runtime_config`: clients keep their kubeconfig (a cluster enabling an API
        group version the way an administrator would)."""
        self.stop_component("kube-apiserver")
        t0 = time.monotonic()
        self._start_apiserver(self._etcd_url, port=self.port)
        self.startup_seconds["kube-apiserver restart"] = time.monotonic() - t0

    def delete_nodes(self, names: list[str]) -> None:
        if self._nodes is not None:
            self._nodes.delete(names)

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
        if os.environ.get(KEEP_FILES_ENV) == "1":
            print(f"{KEEP_FILES_ENV}=1: control-plane files and logs kept in {self.workdir}", file=sys.stderr)
            return
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

    def _gate_flags(self) -> list[str]:
        if not self.feature_gates:
            return []
        return [f"--feature-gates={','.join(f'{gate}=true' for gate in self.feature_gates)}"]

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
        def args(port: int) -> list[str]:
            # The peer port is only ever used by this one-member cluster; it is picked the same way.
            client_url, peer_url = f"http://127.0.0.1:{port}", f"http://127.0.0.1:{free_port()}"
            return [
                f"--name={self.name}",
                f"--data-dir={self.workdir / 'etcd'}",
                f"--listen-client-urls={client_url}",
                f"--advertise-client-urls={client_url}",
                f"--listen-peer-urls={peer_url}",
                f"--initial-advertise-peer-urls={peer_url}",
                f"--initial-cluster={self.name}={peer_url}",
                "--unsafe-no-fsync",
                "--log-level=warn",
            ]

        port = self._start_on_free_port("etcd", args, health=lambda port: f"http://127.0.0.1:{port}/health")
        return f"http://127.0.0.1:{port}"

    def _start_apiserver(self, etcd_url: str, port: int | None = None) -> None:
        self.port = self._start_on_free_port(
            "kube-apiserver",
            lambda port: [
                f"--etcd-servers={etcd_url}",
                "--bind-address=127.0.0.1",
                "--advertise-address=127.0.0.1",
                # The endpoint reconciler refuses loopback addresses; nothing here needs the
                # `kubernetes` Service to have endpoints.
                "--endpoint-reconciler-type=none",
                f"--secure-port={port}",
                f"--cert-dir={self.workdir / 'certs'}",
                f"--token-auth-file={self.workdir / 'tokens.csv'}",
                "--authorization-mode=Node,RBAC",
                f"--service-account-issuer={SERVICE_ACCOUNT_ISSUER}",
                f"--service-account-key-file={self.workdir / 'sa.pub'}",
                f"--service-account-signing-key-file={self.workdir / 'sa.key'}",
                f"--service-cluster-ip-range={SERVICE_CLUSTER_IP_RANGE}",
                # Lets PodSecurity, not the cluster-wide switch, be what refuses privileged pods.
                "--allow-privileged=true",
                *self._gate_flags(),
                *(
                    [f"--runtime-config={','.join(f'{gv}=true' for gv in self.runtime_config)}"]
                    if self.runtime_config
                    else []
                ),
                *self.apiserver_args,
            ],
            health=lambda port: f"https://127.0.0.1:{port}/readyz",
            token=self.token,
            port=port,
        )

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

    def _spawn(self, name: str, args: list[str]) -> int:
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
        return popen.pid

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

    def _start_on_free_port(
        self,
        name: str,
        args: Callable[[int], list[str]],
        health: Callable[[int], str],
        token: str | None = None,
        attempts: int = 3,
        port: int | None = None,
    ) -> int:
        """Starts `name` on a free loopback port and waits until it answers there healthy.

        A port found free can be taken by another process before ours binds it (other test runs
        share this machine): then ours exits and is started again on another port (`port`: that one only).
        Health only
        counts once our own process listens on the port, so we never mistake a neighbour for ours.
        """
        # Serving certificates are generated at startup, so health is polled unverified;
        # clients verify against the kubeconfig's CA afterwards.
        context = ssl.create_default_context()
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        fixed = port
        for attempt in range(1, attempts + 1):
            port = fixed or free_port()
            pid = self._spawn(name, args(port))

            def ready(port: int = port, pid: int = pid) -> bool:
                return _listens(pid, port) and _http_ok(health(port), headers=headers, context=context)

            try:
                self._wait_until(name, ready, timeout=60)
                return port
            except StartupError as exc:
                if attempt == attempts or fixed or "address already in use" not in str(exc):
                    raise
                self._procs.pop()  # it has exited; forget it
        raise AssertionError("unreachable")


def _http_ok(url: str, headers: dict[str, str] | None = None, context: ssl.SSLContext | None = None) -> bool:
    request = urllib.request.Request(url, headers=headers or {})
    try:
        with urllib.request.urlopen(request, timeout=2, context=context) as response:
            return bool(response.status == 200)
    except (urllib.error.URLError, OSError):
        return False


def _listens(pid: int, port: int) -> bool:
    try:
        conns = psutil.Process(pid).net_connections(kind="tcp")
    except psutil.Error:
        return False
    return any(c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == port for c in conns)


def stop_detached(state: dict[str, Any]) -> None:
    """Stops a control plane that `detach()` let go of (see tests/cluster/down.py)."""
    stop_processes([ProcessRecord(**rec) for rec in state["processes"]])
    shutil.rmtree(state["workdir"], ignore_errors=True)


def dump_state(state: dict[str, Any], path: Path) -> None:
    path.write_text(json.dumps(state, indent=2))
