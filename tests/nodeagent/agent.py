"""A kubelet for tests: registers nodes, runs the pods bound to them as real processes, reports their status.

One asyncio loop does everything (informers, node heartbeats and Leases, one task per pod and container,
probes); only the DNS server has threads of its own. Each pod gets a network namespace on the agent's
bridge (tests/nodeagent/network.py), its volumes materialised and mounted in a private mount namespace
(podspec.py, launch.py), and name resolution from the agent's DNS server (dns.py). Product code sees what it
would see in a cluster: its env, its files at their paths, its own address, cluster DNS names.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import datetime as dt
import json
import logging
import os
import shutil
import signal
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import psutil

from tests.nodeagent import network
from tests.nodeagent.dns import CLUSTER_DOMAIN, ClusterDnsServer, DnsTable, build_table
from tests.nodeagent.kubeapi import ApiError, Credentials, Informer, KubeApi, Obj
from tests.nodeagent.podspec import (
    ContainerPlan,
    MissingObjectError,
    PodSpecError,
    materialise_volumes,
    plan_container,
    referenced_objects,
)

log = logging.getLogger("nodeagent")

GPU_RESOURCE = "nvidia.com/gpu"
GPU_PRODUCT_LABEL = "nvidia.com/gpu.product"
GPU_PRODUCT = "NVIDIA-H100-80GB-HBM3"
GPU_TAINT = {"key": GPU_RESOURCE, "value": "present", "effect": "NoSchedule"}
AGENT_LABEL = "iwg.dev/node-agent"
LAUNCHER = Path(__file__).resolve().parent / "launch.py"
MAX_GRACE_S = 30.0


def now() -> str:
    return dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def now_micro() -> str:
    return dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def _die_with_agent() -> None:
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


@dataclass
class AgentConfig:
    kubeconfig: Path
    nodes: list[str]
    workdir: Path
    token: str
    gpus_per_node: int = 8
    taint_gpu: bool = False
    labels: dict[str, str] = field(default_factory=dict)
    extra_env: dict[str, str] = field(default_factory=dict)
    heartbeat_s: float = 5.0
    restart_backoff_s: float = 1.0
    max_restart_backoff_s: float = 10.0


# --------------------------------------------------------------------------------------------- probes


@dataclass
class ProbeState:
    successes: int = 0
    failures: int = 0
    passed: bool = False


async def run_probe(probe: Obj, container: Obj, pod_ip: str, netns: str, http: aiohttp.ClientSession) -> bool:
    timeout = float(probe.get("timeoutSeconds", 1))

    def port_of(value: Any) -> int:
        if isinstance(value, int) or str(value).isdigit():
            return int(value)
        for port in container.get("ports") or []:
            if port.get("name") == value:
                return int(port["containerPort"])
        raise PodSpecError(f"probe port {value!r} names no container port")

    try:
        if "httpGet" in probe:
            get = probe["httpGet"]
            scheme = str(get.get("scheme", "HTTP")).lower()
            host = get.get("host") or pod_ip
            url = f"{scheme}://{host}:{port_of(get['port'])}{get.get('path', '/')}"
            async with http.get(url, timeout=aiohttp.ClientTimeout(total=timeout)) as response:
                return 200 <= response.status < 400
        if "tcpSocket" in probe:
            _, writer = await asyncio.wait_for(
                asyncio.open_connection(pod_ip, port_of(probe["tcpSocket"]["port"])), timeout
            )
            writer.close()
            return True
        if "exec" in probe:
            proc = await asyncio.create_subprocess_exec(
                "ip",
                "netns",
                "exec",
                netns,
                *probe["exec"]["command"],
                stdout=asyncio.subprocess.DEVNULL,
                stderr=asyncio.subprocess.DEVNULL,
            )
            try:
                return await asyncio.wait_for(proc.wait(), timeout) == 0
            except TimeoutError:
                proc.kill()
                return False
    except (TimeoutError, OSError, aiohttp.ClientError):
        return False
    log.warning("unsupported probe %s: counted as passing", sorted(probe))
    return True


# ----------------------------------------------------------------------------------------- containers


class ContainerRunner:
    """One container: its process, restarts per the pod's restartPolicy, readiness and liveness."""

    def __init__(self, pod: PodRunner, spec: Obj, plan: ContainerPlan) -> None:
        self.pod = pod
        self.spec = spec
        self.plan = plan
        self.restart_count = 0
        self.state: Obj = {"waiting": {"reason": "ContainerCreating"}}
        self.last_state: Obj = {}
        self.ready = False
        self.started = False
        self.finished = False  # exited and will not be restarted
        self.exit_code: int | None = None
        self.process: asyncio.subprocess.Process | None = None
        self._liveness_failed = asyncio.Event()

    def status(self) -> Obj:
        status: Obj = {
            "name": self.plan.name,
            "image": self.spec.get("image", ""),
            "imageID": "",
            "ready": self.ready,
            "started": self.started,
            "restartCount": self.restart_count,
            "state": self.state,
        }
        if self.process is not None:
            status["containerID"] = f"nodeagent://{self.process.pid}"
        if self.last_state:
            status["lastState"] = self.last_state
        return status

    async def run(self) -> None:
        policy = self.pod.spec.get("restartPolicy", "Always")
        backoff = self.pod.agent.config.restart_backoff_s
        while True:
            started_at = now()
            began = time.monotonic()
            self.process = await self._spawn()
            self.state = {"running": {"startedAt": started_at}}
            self.started = True
            self._liveness_failed.clear()
            await self.pod.report()
            probes = asyncio.create_task(self._probe_loop())
            wait_exit = asyncio.create_task(self.process.wait())
            wait_live = asyncio.create_task(self._liveness_failed.wait())
            done, _ = await asyncio.wait({wait_exit, wait_live}, return_when=asyncio.FIRST_COMPLETED)
            if wait_live in done and wait_exit not in done:
                log.info("%s/%s: liveness failed, restarting", self.pod.key, self.plan.name)
                self.kill()
                await wait_exit
            wait_live.cancel()
            probes.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await probes
            code = self.process.returncode if self.process.returncode is not None else -1
            self.exit_code = code
            self.ready = False
            self.started = False
            terminated = {
                "exitCode": code if code >= 0 else 128 - code,
                "reason": "Completed" if code == 0 else "Error",
                "startedAt": started_at,
                "finishedAt": now(),
            }
            if code < 0:
                terminated["signal"] = -code
            if code != 0 and self.spec.get("terminationMessagePolicy") == "FallbackToLogsOnError":
                terminated["message"] = self._log_tail()  # as the kubelet: the end of the container's log
            restart = policy == "Always" or (policy == "OnFailure" and code != 0)
            if not restart:
                self.state = {"terminated": terminated}
                self.finished = True
                await self.pod.report()
                return
            self.last_state = {"terminated": terminated}
            self.restart_count += 1
            if time.monotonic() - began > 10 * self.pod.agent.config.max_restart_backoff_s:
                backoff = self.pod.agent.config.restart_backoff_s
            self.state = {"waiting": {"reason": "CrashLoopBackOff", "message": f"back-off {backoff:.0f}s"}}
            await self.pod.report()
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, self.pod.agent.config.max_restart_backoff_s)

    def _log_tail(self, max_lines: int = 80, max_bytes: int = 2048) -> str:
        try:
            with self.log_path.open("rb") as log:
                log.seek(max(0, log.seek(0, os.SEEK_END) - max_bytes))
                tail = log.read().decode(errors="replace")
        except OSError:
            return ""
        return "\n".join(tail.splitlines()[-max_lines:])

    @property
    def log_path(self) -> Path:
        return self.pod.agent.logs / f"{self.pod.key.replace('/', '_')}_{self.plan.name}.log"

    async def _spawn(self) -> asyncio.subprocess.Process:
        plan_file = self.pod.dir / f"{self.plan.name}.plan.json"
        plan_file.write_text(
            json.dumps(
                {
                    "argv": list(self.plan.argv),
                    "env": dict(self.plan.env),
                    "working_dir": self.plan.working_dir,
                    "hostname": self.plan.hostname,
                    "mounts": [vars(m) for m in self.plan.mounts],
                    "image_paths": self.pod.agent.image_paths,
                }
            )
        )
        with self.log_path.open("ab") as out:
            out.write(f"--- {now()} start #{self.restart_count}: {' '.join(self.plan.argv)}\n".encode())
            out.flush()
            return await asyncio.create_subprocess_exec(
                "ip",
                "netns",
                "exec",
                self.pod.netns,
                sys.executable,
                str(LAUNCHER),
                str(plan_file),
                stdin=asyncio.subprocess.DEVNULL,
                stdout=out,
                stderr=asyncio.subprocess.STDOUT,
                start_new_session=True,
                preexec_fn=_die_with_agent,
            )

    def kill(self, sig: int = signal.SIGKILL) -> None:
        if self.process is None or self.process.returncode is not None:
            return
        with contextlib.suppress(psutil.NoSuchProcess):
            for child in psutil.Process(self.process.pid).children(recursive=True):
                with contextlib.suppress(psutil.NoSuchProcess):
                    child.send_signal(sig)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.process.pid, sig)

    async def _probe_loop(self) -> None:
        readiness = self.spec.get("readinessProbe")
        liveness = self.spec.get("livenessProbe")
        startup = self.spec.get("startupProbe")
        if startup:
            await self._until_startup(startup)
        tasks = []
        if readiness:
            tasks.append(asyncio.create_task(self._probe_forever(readiness, self._on_readiness)))
        else:
            self.ready = True
            await self.pod.report()
        if liveness:
            threshold = int(liveness.get("failureThreshold", 3))

            async def on_liveness(state: ProbeState) -> None:
                if state.failures >= threshold:
                    self._liveness_failed.set()

            tasks.append(asyncio.create_task(self._probe_forever(liveness, on_liveness)))
        try:
            await asyncio.gather(*tasks)
        finally:
            for task in tasks:
                task.cancel()

    async def _until_startup(self, probe: Obj) -> None:
        state = ProbeState()
        await asyncio.sleep(float(probe.get("initialDelaySeconds", 0)))
        while True:
            if await run_probe(probe, self.spec, self.pod.ip, self.pod.netns, self.pod.agent.http):
                return
            state.failures += 1
            if state.failures >= int(probe.get("failureThreshold", 3)):
                self._liveness_failed.set()
                await asyncio.Event().wait()
            await asyncio.sleep(float(probe.get("periodSeconds", 10)))

    async def _probe_forever(self, probe: Obj, on_result: Any) -> None:
        state = ProbeState()
        await asyncio.sleep(float(probe.get("initialDelaySeconds", 0)))
        while True:
            ok = await run_probe(probe, self.spec, self.pod.ip, self.pod.netns, self.pod.agent.http)
            if ok:
                state.successes, state.failures = state.successes + 1, 0
                if state.successes >= int(probe.get("successThreshold", 1)):
                    state.passed = True
            else:
                state.successes, state.failures = 0, state.failures + 1
                if state.failures >= int(probe.get("failureThreshold", 3)):
                    state.passed = False
            await on_result(state)
            await asyncio.sleep(float(probe.get("periodSeconds", 10)))

    async def _on_readiness(self, state: ProbeState) -> None:
        if self.ready != state.passed:
            self.ready = state.passed
            await self.pod.report()


# ----------------------------------------------------------------------------------------------- pods


class PodRunner:
    def __init__(self, agent: NodeAgent, pod: Obj, index: int) -> None:
        self.agent = agent
        self.pod = pod
        self.uid = pod["metadata"]["uid"]
        self.key = f"{pod['metadata']['namespace']}/{pod['metadata']['name']}"
        self.spec: Obj = pod.get("spec") or {}
        self.index = index
        self.netns = agent.bridge.netns_name(index)
        self.ip = agent.bridge.address(index)
        self.dir = agent.config.workdir / "pods" / self.uid
        self.containers: list[ContainerRunner] = []
        self.start_time = now()
        self.waiting_reason: tuple[str, str] | None = None
        self._last_status: Obj | None = None
        self._task: asyncio.Task[None] | None = None
        self._terminating = False
        self._report_lock = asyncio.Lock()

    def start(self) -> None:
        self._task = asyncio.create_task(self._run())

    async def _run(self) -> None:
        try:
            for attempt in range(3):
                try:
                    await asyncio.to_thread(self._make_sandbox)
                    break
                except network.NetworkError as error:
                    log.warning("%s: sandbox attempt %d failed: %s", self.key, attempt + 1, error)
                    if attempt == 2:
                        raise
                    await asyncio.sleep(1.0)
            await self.report()
            plans = await self._plans()
            self.containers = [
                ContainerRunner(self, spec, plan)
                for spec, plan in zip(self.spec.get("containers") or [], plans, strict=True)
            ]
            self.waiting_reason = None
            await asyncio.gather(*(c.run() for c in self.containers))
        except asyncio.CancelledError:
            raise
        except PodSpecError as error:
            self.waiting_reason = ("CreateContainerConfigError", str(error))
            log.error("%s: %s", self.key, error)
            await self.report()
        except Exception:
            log.exception("%s: pod runner failed", self.key)

    def _make_sandbox(self) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        namespace = self.pod["metadata"]["namespace"]
        search = [f"{namespace}.svc.{CLUSTER_DOMAIN}", f"svc.{CLUSTER_DOMAIN}", CLUSTER_DOMAIN]
        self.agent.bridge.add_sandbox(self.index, self.agent.bridge.gateway, search)
        hostname = self.spec.get("hostname") or self.pod["metadata"]["name"]
        names = [hostname]
        if self.spec.get("subdomain"):
            names.insert(0, f"{hostname}.{self.spec['subdomain']}.{namespace}.svc.{CLUSTER_DOMAIN}")
        (network.NETNS_ETC / self.netns / "hosts").write_text(
            f"127.0.0.1\tlocalhost\n::1\tlocalhost ip6-localhost ip6-loopback\n{self.ip}\t{' '.join(names)}\n"
        )

    async def _plans(self) -> list[ContainerPlan]:
        """Waits (as ContainerCreating) until every Secret and ConfigMap the pod reads exists."""
        pod = json.loads(json.dumps(self.pod))
        pod.setdefault("status", {}).update(
            podIP=self.ip,
            podIPs=[{"ip": self.ip}],
            hostIP=self.agent.bridge.gateway,
            hostIPs=[{"ip": self.agent.bridge.gateway}],
        )
        while True:
            try:
                objects = await self.agent.fetch_objects(
                    pod["metadata"]["namespace"], referenced_objects(pod)
                )
                volumes = await asyncio.to_thread(materialise_volumes, pod, self.dir / "volumes", objects)
                plans = [
                    plan_container(pod, c, volumes, objects, self.agent.base_env, "/")
                    for c in self.spec.get("containers") or []
                ]
                for plan in plans:
                    self.agent.prepare_mount_targets(plan)
                return plans
            except MissingObjectError as error:
                if self.waiting_reason is None or self.waiting_reason[1] != str(error):
                    self.waiting_reason = ("CreateContainerConfigError", str(error))
                    await self.report()
                await asyncio.sleep(0.5)

    def phase(self) -> str:
        if not self.containers or not all(c.finished for c in self.containers):
            return "Running" if any(c.started for c in self.containers) else "Pending"
        return "Succeeded" if all(c.exit_code == 0 for c in self.containers) else "Failed"

    def status(self) -> Obj:
        ready = bool(self.containers) and all(c.ready for c in self.containers) and self.phase() == "Running"
        phase = self.phase()
        if phase == "Pending" and any(c.restart_count for c in self.containers):
            phase = "Running"

        def condition(kind: str, value: bool) -> Obj:
            return {"type": kind, "status": "True" if value else "False", "lastProbeTime": None}

        statuses = [c.status() for c in self.containers]
        if not statuses:
            reason, message = self.waiting_reason or ("ContainerCreating", "")
            statuses = [
                {
                    "name": c["name"],
                    "image": c.get("image", ""),
                    "imageID": "",
                    "ready": False,
                    "restartCount": 0,
                    "started": False,
                    "state": {"waiting": {"reason": reason, "message": message}},
                }
                for c in self.spec.get("containers") or []
            ]
        return {
            "phase": phase,
            "podIP": self.ip,
            "podIPs": [{"ip": self.ip}],
            "hostIP": self.agent.bridge.gateway,
            "hostIPs": [{"ip": self.agent.bridge.gateway}],
            "startTime": self.start_time,
            "conditions": [
                condition("PodReadyToStartContainers", True),
                condition("Initialized", True),
                condition("Ready", ready),
                condition("ContainersReady", ready),
                condition("PodScheduled", True),
            ],
            "containerStatuses": statuses,
        }

    async def report(self) -> None:
        if self._terminating:
            return
        async with self._report_lock:
            status = self.status()
            if status == self._last_status:
                return
            # Condition transition times only move when a condition's status does.
            previous = {c["type"]: c for c in (self._last_status or {}).get("conditions", [])}
            stamp = now()
            for cond in status["conditions"]:
                old = previous.get(cond["type"])
                cond["lastTransitionTime"] = (
                    old["lastTransitionTime"] if old and old["status"] == cond["status"] else stamp
                )
            ns, name = self.key.split("/")
            try:
                await self.agent.api.merge_patch(
                    f"/api/v1/namespaces/{ns}/pods/{name}/status", {"status": status}
                )
                self._last_status = {**status, "conditions": [dict(c) for c in status["conditions"]]}
            except ApiError as error:
                if error.status != 404:
                    log.warning("%s: status update failed: %s", self.key, error)

    async def terminate(self, grace_s: float) -> None:
        """Kills the pod's processes (SIGTERM, then SIGKILL after the grace period) and its sandbox."""
        if self._terminating:
            return
        self._terminating = True
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task
        await asyncio.to_thread(network.kill_sandbox_processes, self.netns, min(grace_s, MAX_GRACE_S))
        for container in self.containers:
            if container.process is not None and container.process.returncode is None:
                container.kill()
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(container.process.wait(), 5)
        await asyncio.to_thread(network.remove_sandbox, self.netns, self.agent.bridge.veth_name(self.index))
        shutil.rmtree(self.dir, ignore_errors=True)


# ---------------------------------------------------------------------------------------------- agent


class NodeAgent:
    def __init__(self, config: AgentConfig) -> None:
        self.config = config
        self.api = KubeApi(Credentials.from_kubeconfig(config.kubeconfig))
        self.http = aiohttp.ClientSession()
        self.bridge = network.Bridge.create(config.token)
        self.logs = config.workdir / "logs"
        self.logs.mkdir(parents=True, exist_ok=True)
        self.table = DnsTable()
        self.dns = ClusterDnsServer(self.table, self.bridge.gateway)
        self.runners: dict[str, PodRunner] = {}
        self._next_index = 0
        self._created_dirs: list[Path] = []
        self._finishing: set[str] = set()
        self._background: set[asyncio.Task[None]] = set()
        self.base_env = {
            "PATH": os.pathsep.join(
                [
                    str(Path(sys.executable).parent),
                    "/usr/local/sbin",
                    "/usr/local/bin",
                    "/usr/sbin",
                    "/usr/bin",
                    "/sbin",
                    "/bin",
                ]
            ),
            "HOME": os.environ.get("HOME", "/root"),
            "LANG": "C.UTF-8",
            **config.extra_env,
        }
        # What stands in for the container image: the Python environment and the PYTHONPATH entries. A pod's
        # volume (an emptyDir on /tmp, say) must not hide them when the checkout or venv lives under its path.
        self.image_paths = sorted(
            {sys.prefix, *filter(None, self.base_env.get("PYTHONPATH", "").split(os.pathsep))}
        )
        self.pods = Informer(self.api, "/api/v1/pods", self._on_pod)
        self.services = Informer(self.api, "/api/v1/services", self._on_dns_source)
        self.slices = Informer(self.api, "/apis/discovery.k8s.io/v1/endpointslices", self._on_dns_source)

    # -- lifecycle ------------------------------------------------------------------------------

    async def run(self, ready_file: Path | None, stop: asyncio.Event) -> None:
        self.dns.start()
        for node in self.config.nodes:
            await self._register_node(node)
        tasks = [
            asyncio.create_task(self.pods.run()),
            asyncio.create_task(self.services.run()),
            asyncio.create_task(self.slices.run()),
            asyncio.create_task(self._heartbeat()),
        ]
        await asyncio.gather(self.pods.synced.wait(), self.services.synced.wait(), self.slices.synced.wait())
        if ready_file is not None:
            # Written whole, then renamed into place: the fixture reads it the moment it exists (it once read
            # an empty file, created but not yet written).
            partial = ready_file.with_name(f".{ready_file.name}.partial")
            partial.write_text(
                json.dumps(
                    {
                        "pid": os.getpid(),
                        "token": self.config.token,
                        "nodes": self.config.nodes,
                        "subnet": str(self.bridge.subnet),
                        "gateway": self.bridge.gateway,
                        "logs": str(self.logs),
                    }
                )
            )
            partial.replace(ready_file)
        log.info("node agent ready: nodes %s, subnet %s", self.config.nodes, self.bridge.subnet)
        await stop.wait()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def shutdown(self) -> None:
        await asyncio.gather(
            *(r.terminate(grace_s=2) for r in list(self.runners.values())), return_exceptions=True
        )
        for runner in list(self.runners.values()):
            ns, name = runner.key.split("/")
            with contextlib.suppress(Exception):
                await self.api.delete(
                    f"/api/v1/namespaces/{ns}/pods/{name}",
                    {"gracePeriodSeconds": 0, "preconditions": {"uid": runner.uid}},
                )
        for node in self.config.nodes:
            with contextlib.suppress(Exception):
                await self.api.delete(f"/api/v1/nodes/{node}")
            with contextlib.suppress(Exception):
                await self.api.delete(
                    f"/apis/coordination.k8s.io/v1/namespaces/kube-node-lease/leases/{node}"
                )
        self.dns.stop()
        await self.http.close()
        await self.api.close()
        network.remove_agent_network(self.config.token)
        for directory in sorted(self._created_dirs, key=lambda p: len(p.parts), reverse=True):
            with contextlib.suppress(OSError):
                directory.rmdir()

    def prepare_mount_targets(self, plan: ContainerPlan) -> None:
        """Creates missing mount points on the host (bind mounts need one); removed again at shutdown."""
        for mount in plan.mounts:
            missing = []
            path = Path(mount.target)
            while not path.exists():
                missing.append(path)
                path = path.parent
            is_file = Path(mount.source).is_file()
            for created in reversed(missing):
                if created == Path(mount.target) and is_file:
                    created.touch()
                else:
                    created.mkdir()
                self._created_dirs.append(created)

    # -- nodes ----------------------------------------------------------------------------------

    def _node_manifest(self, name: str) -> Obj:
        labels = {
            "kubernetes.io/hostname": name,
            "kubernetes.io/os": "linux",
            "kubernetes.io/arch": "amd64",
            AGENT_LABEL: "true",
            GPU_PRODUCT_LABEL: GPU_PRODUCT,
            "nvidia.com/gpu.count": str(self.config.gpus_per_node),
            "nvidia.com/gpu.present": "true",
            **self.config.labels,
        }
        spec: Obj = {"taints": [GPU_TAINT]} if self.config.taint_gpu else {}
        return {
            "apiVersion": "v1",
            "kind": "Node",
            "metadata": {"name": name, "labels": labels},
            "spec": spec,
        }

    def _node_status(self, name: str) -> Obj:
        capacity = {
            "cpu": str(max(os.cpu_count() or 2, 32)),  # a fiction like the rest: the pods share this machine
            "memory": f"{psutil.virtual_memory().total // 1024}Ki",
            "pods": "110",
            "ephemeral-storage": "100Gi",
            GPU_RESOURCE: str(self.config.gpus_per_node),
        }
        stamp = now()

        def condition(kind: str, status: str, reason: str) -> Obj:
            return {
                "type": kind,
                "status": status,
                "reason": reason,
                "message": "node agent",
                "lastHeartbeatTime": stamp,
                "lastTransitionTime": self._started_at,
            }

        return {
            "capacity": capacity,
            "allocatable": capacity,
            "conditions": [
                condition("Ready", "True", "KubeletReady"),
                condition("MemoryPressure", "False", "KubeletHasSufficientMemory"),
                condition("DiskPressure", "False", "KubeletHasNoDiskPressure"),
                condition("PIDPressure", "False", "KubeletHasSufficientPID"),
            ],
            "addresses": [
                {"type": "InternalIP", "address": self.bridge.gateway},
                {"type": "Hostname", "address": name},
            ],
            "nodeInfo": {
                "kubeletVersion": "v1.37.2-iwg-nodeagent",
                "kubeProxyVersion": "",
                "operatingSystem": "linux",
                "architecture": "amd64",
                "containerRuntimeVersion": "iwg-nodeagent://0.1",
                "osImage": "",
                "kernelVersion": os.uname().release,
                "machineID": "",
                "systemUUID": "",
                "bootID": "",
            },
        }

    _started_at = now()

    async def _register_node(self, name: str) -> None:
        try:
            await self.api.create("/api/v1/nodes", self._node_manifest(name))
        except ApiError as error:
            if error.status != 409:
                raise
            await self.api.merge_patch(f"/api/v1/nodes/{name}", self._node_manifest(name))
        await self._update_node(name)
        # The TaintNodesByCondition admission plugin taints a new node not-ready; the node lifecycle
        # controller would lift it once the node reports Ready (this agent does, at once).
        taints = [GPU_TAINT] if self.config.taint_gpu else []
        await self.api.merge_patch(f"/api/v1/nodes/{name}", {"spec": {"taints": taints}})

    async def _update_node(self, name: str) -> None:
        await self.api.merge_patch(f"/api/v1/nodes/{name}/status", {"status": self._node_status(name)})
        lease_path = f"/apis/coordination.k8s.io/v1/namespaces/kube-node-lease/leases/{name}"
        spec = {"holderIdentity": name, "leaseDurationSeconds": 40, "renewTime": now_micro()}
        try:
            await self.api.merge_patch(lease_path, {"spec": spec})
        except ApiError as error:
            if error.status != 404:
                raise
            await self.api.create(
                "/apis/coordination.k8s.io/v1/namespaces/kube-node-lease/leases",
                {
                    "apiVersion": "coordination.k8s.io/v1",
                    "kind": "Lease",
                    "metadata": {"name": name},
                    "spec": spec,
                },
            )

    async def _heartbeat(self) -> None:
        while True:
            await asyncio.sleep(self.config.heartbeat_s)
            for node in self.config.nodes:
                try:
                    await self._update_node(node)
                except Exception as error:
                    log.warning("heartbeat of %s failed: %s", node, error)

    # -- pods -----------------------------------------------------------------------------------

    async def fetch_objects(self, namespace: str, wanted: set[tuple[str, str]]) -> dict[tuple[str, str], Obj]:
        found: dict[tuple[str, str], Obj] = {}
        for kind, name in wanted:
            plural = "secrets" if kind == "Secret" else "configmaps"
            try:
                found[(kind, name)] = await self.api.get(f"/api/v1/namespaces/{namespace}/{plural}/{name}")
            except ApiError as error:
                if error.status != 404:
                    raise
        return found

    def _allocate_index(self) -> int:
        """The next free address, round-robin: a pod's address is not handed out again soon after it ends."""
        used = {r.index for r in self.runners.values()}
        capacity = self.bridge.subnet.num_addresses - 3
        for _ in range(capacity):
            index = self._next_index % capacity
            self._next_index += 1
            if index not in used:
                return index
        raise network.NetworkError(f"no free pod address left in {self.bridge.subnet}")

    async def _on_pod(self, kind: str, pod: Obj) -> None:
        self._rebuild_dns()
        if (pod.get("spec") or {}).get("nodeName") not in self.config.nodes:
            return
        uid = pod["metadata"]["uid"]
        runner = self.runners.get(uid)
        if kind == "DELETED":
            if runner is not None:
                await self._finish(runner, grace_s=0, delete=False)
            return
        if pod["metadata"].get("deletionTimestamp"):
            if runner is None:
                await self._force_delete(pod)
            else:
                grace = pod["metadata"].get("deletionGracePeriodSeconds")
                if grace is None:
                    grace = (pod.get("spec") or {}).get("terminationGracePeriodSeconds", 30)
                task = asyncio.create_task(self._finish(runner, grace_s=float(grace), delete=True))
                self._background.add(task)
                task.add_done_callback(self._background.discard)
            return
        if runner is None and (pod.get("status") or {}).get("phase") not in ("Succeeded", "Failed"):
            runner = PodRunner(self, pod, self._allocate_index())
            self.runners[uid] = runner
            log.info("%s: starting on %s at %s", runner.key, pod["spec"]["nodeName"], runner.ip)
            runner.start()

    async def _finish(self, runner: PodRunner, grace_s: float, delete: bool) -> None:
        if self.runners.get(runner.uid) is not runner or runner.uid in self._finishing:
            return
        self._finishing.add(runner.uid)
        try:
            await runner.terminate(grace_s)
        finally:
            self._finishing.discard(runner.uid)
        self.runners.pop(runner.uid, None)
        if delete:
            await self._force_delete(runner.pod)

    async def _force_delete(self, pod: Obj) -> None:
        meta = pod["metadata"]
        with contextlib.suppress(ApiError):
            await self.api.delete(
                f"/api/v1/namespaces/{meta['namespace']}/pods/{meta['name']}",
                {"gracePeriodSeconds": 0, "preconditions": {"uid": meta["uid"]}},
            )

    async def _on_dns_source(self, kind: str, obj: Obj) -> None:
        self._rebuild_dns()

    def _rebuild_dns(self) -> None:
        self.table.replace(
            build_table(self.services.items.values(), self.slices.items.values(), self.pods.items.values())
        )


def pod_processes(agent_state: Mapping[str, Any]) -> list[int]:
    """Pids of every pod process of an agent (for tests that check nothing is left)."""
    pids: list[int] = []
    for line in network.ip("netns", "list", check=False).stdout.splitlines():
        name = line.split()[0] if line.split() else ""
        if name.startswith(f"iwg-{agent_state['token']}-"):
            pids.extend(network.sandbox_pids(name))
    return pids
