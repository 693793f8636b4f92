"""Real Kubernetes nodes for tests: each a kubelet with its own containerd (Debian's, with runc) in a mount and
network namespace of its own, joined to a `ControlPlane`.

Layout (nothing of it in the host's network namespace; every file under one temporary directory):

  fabric namespace   bridge fab0 10.250.0.1/24, routes to every node's pods; CoreDNS (10.250.0.1:53) and
                     whatever a test runs "in the cluster network" (the operator) run here
  node i namespace   eth0 10.250.0.(10+i) on fab0; bridge CNI cni0 with pods in 10.244.i.0/24, routes to
                     the other nodes' pod ranges, the fabric its default gateway; containerd, kubelet
                     (node name realnode-i), kube-proxy
  relay (host)       the apiserver's 127.0.0.1:PORT inside every namespace, and host ports to pods
                     (tests/realnodes/relay.py)

The host changes only by the nodes' cgroups (a `cgroupRoot` per node in each cgroup v1 hierarchy, which the
kubelet needs made beforehand), removed on stop. Host sysctls the kubelet would set are stand-in files
inside the node's mount namespace. Pods run the light image from tests/realnodes/image.sh: Debian
libraries only; the test environment (the repository with its .venv) and the Python it was made with are
bind-mounted read-only at their own paths into every container (containerd's base runtime spec).
Processes are stopped by pid: the ones started here by their records, the containers and shims by the
node's cgroups and mount namespace.
"""

from __future__ import annotations

import contextlib
import functools
import ipaddress
import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil
import yaml
from kubernetes import client

from tests.cluster import binaries
from tests.cluster.control_plane import (
    ControlPlane,
    ProcessRecord,
    _kill_with_parent,
    kill_until_gone,
    stop_processes,
)

REPO_ROOT = Path(__file__).resolve().parents[2]
IMAGE_SCRIPT = Path(__file__).resolve().parent / "image.sh"
FABRIC_GATEWAY = "10.250.0.1"
FABRIC_PREFIX = 24
POD_RANGE = ipaddress.ip_network("10.244.0.0/16")
CLUSTER_DOMAIN = "cluster.local"
NODE_PREFIX = "realnode-"
PAUSE_IMAGE = "iwg.local/pause:1"
WORKER_IMAGE = "iwg.local/iwg-worker-light:1"
# The sysctls the kubelet sets host-wide at start; inside a node they are files of its own.
KUBELET_SYSCTLS = ("vm/overcommit_memory", "kernel/panic", "kernel/panic_on_oops")
CGROUP_ROOT = Path("/sys/fs/cgroup")
GPU_RESOURCE = "nvidia.com/gpu"
CTR = "ctr --address /run/containerd/containerd.sock --namespace k8s.io"
# What every container gets besides its own env (the base runtime spec's; image and pod env come after): no
# model hubs, one thread per process (the machine has 2 cores shared by everything), unbuffered output for the
# logs, and the repository importable (test-only worker classes: tests/realnodes/faulty_worker.py).
CONTAINER_ENV = {
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "OMP_NUM_THREADS": "1",
    "MKL_NUM_THREADS": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "PYTHONUNBUFFERED": "1",
    "PYTHONPATH": str(REPO_ROOT),
}


def images() -> Path:
    """The directory with the nodes' image archives (built and cached by image.sh)."""
    out = subprocess.run(["bash", str(IMAGE_SCRIPT)], check=True, capture_output=True, text=True).stdout
    return Path(out.strip().splitlines()[-1])


KUBE_PROXY_MIN_SYNC = "3s"  # below the driver's default lame duck (5 s), as a cluster's propagation should be


@dataclass
class Node:
    index: int
    name: str
    holder: ProcessRecord  # `sleep infinity` holding the node's mount and network namespaces
    workdir: Path
    cgroup: str

    @property
    def address(self) -> str:
        return f"10.250.0.{10 + self.index}"

    @property
    def pod_range(self) -> str:
        return str(list(POD_RANGE.subnets(new_prefix=24))[self.index])

    @property
    def netns(self) -> str:
        return f"/proc/{self.holder.pid}/ns/net"


class RealNodes:
    """`count` real nodes joined to `control_plane` (started with `apiserver_args()`); `start()` returns once
    every node is Ready."""

    def __init__(
        self,
        control_plane: ControlPlane,
        count: int = 2,
        extra_images: tuple[Path, ...] = (),
        test_environment: bool = True,
    ) -> None:
        """``extra_images``: docker archives imported into every node besides the pause and light images.
        ``test_environment``: every container gets the test environment (this checkout, its venv and Python
        bind-mounted read-only, ``CONTAINER_ENV``); without it containers get only what their image and pod
        give them, as on any cluster (the built worker image's test, tests/image)."""
        self.cp = control_plane
        self.count = count
        self.extra_images = extra_images
        self.test_environment = test_environment
        self.workdir = Path(tempfile.mkdtemp(prefix="iwg-nodes-"))
        self.token = secrets.token_hex(3)
        self.nodes: list[Node] = []
        self.fabric: ProcessRecord | None = None
        self.timings: dict[str, float] = {}
        self._procs: list[ProcessRecord] = []
        self._daemons: dict[str, ProcessRecord] = {}
        self._forwards: dict[tuple[str, str, int], int] = {}  # (namespace, ip, port) -> the relay's host port

    # -- public surface -------------------------------------------------------------------------

    @property
    def egress_socket(self) -> Path:
        return self.workdir / "egress.sock"

    def apiserver_args(self) -> list[str]:
        """What the control plane's apiserver needs to reach these nodes' kubelets (logs, exec): their
        InternalIP, through the relay's HTTP CONNECT proxy. Written before the control plane starts."""
        config = self.workdir / "egress.yaml"
        config.write_text(
            yaml.safe_dump(
                {
                    "apiVersion": "apiserver.k8s.io/v1beta1",
                    "kind": "EgressSelectorConfiguration",
                    "egressSelections": [
                        {
                            "name": "cluster",
                            "connection": {
                                "proxyProtocol": "HTTPConnect",
                                "transport": {"uds": {"udsName": str(self.egress_socket)}},
                            },
                        }
                    ],
                }
            )
        )
        return ["--kubelet-preferred-address-types=InternalIP", f"--egress-selector-config-file={config}"]

    @property
    def fabric_netns(self) -> str:
        assert self.fabric is not None
        return f"/proc/{self.fabric.pid}/ns/net"

    @property
    def names(self) -> list[str]:
        return [node.name for node in self.nodes]

    def in_fabric(self, argv: list[str]) -> list[str]:
        """A command line that runs `argv` in the fabric namespace (the cluster network, as a pod would)."""
        return ["nsenter", f"--net={self.fabric_netns}", "--", *argv]

    def forward(self, ip: str, port: int, via: str | None = None) -> int:
        """A port on the host's loopback relayed to `ip:port` in the cluster network: connecting from the
        fabric, or from the node `via` (its own namespace, where its kube-proxy's rules turn a ClusterIP into a
        pod's address, as for any client on that node; a refused or failed connect there closes the client's
        connection without an answer). One port per destination: asked again, the same port."""
        import socket

        netns = self.fabric_netns if via is None else next(n.netns for n in self.nodes if n.name == via)
        known = self._forwards.get((netns, ip, port))
        if known is not None:
            return known
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.connect(str(self.workdir / "relay.sock"))
            sock.sendall(f"{netns} {ip} {port}\n".encode())
            answer = sock.makefile().readline().strip()
        if not answer.isdigit():
            raise RuntimeError(f"relay to {ip}:{port}: {answer}")
        self._forwards[(netns, ip, port)] = int(answer)
        return int(answer)

    def advertise_gpus(self, node_name: str, count: int, timeout: float = 60) -> None:
        """Simulated GPUs through the kubelet's own path: a device plugin on the node
        (tests/cluster/tools/deviceplugin) registers `count` healthy `nvidia.com/gpu` devices with its
        kubelet, which counts them in the node's capacity, admits pods against them and, for each container it
        allocates devices to, sets the plugin's visible devices (``NVIDIA_VISIBLE_DEVICES`` with the device
        IDs, ``CUDA_VISIBLE_DEVICES`` with their indices) in its environment. Called again, the node's plugin
        is replaced by one with the new count. Returns once the node's allocatable shows `count`."""
        node = next(n for n in self.nodes if n.name == node_name)
        name = f"{node.name}-deviceplugin"
        stop_processes([r for r in self._procs if r.name == name], grace_s=2.0)
        self._procs = [r for r in self._procs if r.name != name]
        self._spawn(name, self._nsenter(node, [str(binaries.binary("deviceplugin")), f"--count={count}"]))
        core = client.CoreV1Api(self.cp.api_client())
        _wait_for(
            lambda: (core.read_node(node_name).status.allocatable or {}).get(GPU_RESOURCE) == str(count),
            timeout,
            f"{count} GPUs in {node_name}'s allocatable",
            self,
        )

    def tag_image(self, source: str, *targets: str) -> None:
        """Gives every node's image `source` the names `targets` as well (`ctr images tag`): a new image for a
        rollout, of the same content."""
        for node in self.nodes:
            self._in(node.netns, node.holder.pid, f"{CTR} images tag --force {source} {' '.join(targets)}")

    def container_pid(self, node_name: str, container_id: str) -> int:
        """The host pid of a container's first process (`container_id` as a pod's status gives it)."""
        node = next(n for n in self.nodes if n.name == node_name)
        wanted = container_id.split("://", 1)[-1]
        tasks = self._in(node.netns, node.holder.pid, f"{CTR} tasks ls", capture=True)
        for line in tasks.splitlines()[1:]:
            task, pid = line.split()[:2]
            if task == wanted:
                return int(pid)
        raise LookupError(f"no task {wanted} on {node_name}:\n{tasks}")

    def start(self, timeout: float = 120) -> RealNodes:
        try:
            self._start(timeout)
        except BaseException:
            self.stop()
            raise
        return self

    def log_tail(self, name: str, lines: int = 30) -> str:
        path = self.workdir / f"{name}.log"
        if not path.exists():
            return f"(no log {path})"
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])

    # -- lifecycle ------------------------------------------------------------------------------

    def _start(self, timeout: float) -> None:
        sweep_stale()
        t0 = time.monotonic()
        archives = images()
        self.timings["images"] = time.monotonic() - t0

        t0 = time.monotonic()
        self.fabric = self._holder("fabric", ["--net"])
        self._in(self.fabric_netns, None, "ip link set lo up")
        self._in(
            self.fabric_netns,
            None,
            f"ip link add fab0 type bridge && ip link set fab0 up && "
            f"ip addr add {FABRIC_GATEWAY}/{FABRIC_PREFIX} dev fab0",
        )
        for index in range(self.count):
            self.nodes.append(self._make_node(index))
        self._spawn(
            "relay",
            [
                sys.executable,
                "-m",
                "tests.realnodes.relay",
                "--api-port",
                str(self.cp.port),
                "--control",
                str(self.workdir / "relay.sock"),
                "--egress",
                str(self.egress_socket),
                "--egress-netns",
                self.fabric_netns,
                "--netns",
                self.fabric_netns,
                *(arg for node in self.nodes for arg in ("--netns", node.netns)),
            ],
        )
        _wait_for(lambda: (self.workdir / "relay.sock.ready").exists(), 30, "the relay", self)
        self._start_coredns()
        self.timings["network"] = time.monotonic() - t0

        t0 = time.monotonic()
        for node in self.nodes:
            self._start_containerd(node)
        for node in self.nodes:
            self._import_images(node, archives)
        self.timings["containerd+images"] = time.monotonic() - t0

        t0 = time.monotonic()
        for node in self.nodes:
            self._start_kubelet(node)
            self._start_kube_proxy(node)
        core = client.CoreV1Api(self.cp.api_client())
        _wait_for(lambda: all(_node_ready(core, n.name) for n in self.nodes), timeout, "nodes Ready", self)
        self.timings["kubelets Ready"] = time.monotonic() - t0

    def _make_node(self, index: int) -> Node:
        name = f"{NODE_PREFIX}{index}"
        workdir = self.workdir / name
        for sub in ("run", "var-lib", "var-log", "sysctl", "cni", "etc"):
            (workdir / sub).mkdir(parents=True)
        holder = self._holder(name, ["--mount", "--net", "--propagation", "private"])
        # The owner's pid in the name lets a later start sweep what a killed test run left (sweep_stale).
        node = Node(index, name, holder, workdir, f"iwg-{os.getpid()}-{self.token}-{name}")
        # The veth pair is made in the fabric namespace, its node end moved into the node's as eth0.
        self._in(
            self.fabric_netns,
            None,
            f"ip link add v{index} type veth peer name eth0 netns {holder.pid} && "
            f"ip link set v{index} master fab0 up && "
            f"ip route add {node.pod_range} via {node.address}",
        )
        mounts = [
            f"mount -n --bind {workdir / 'run'} /run",
            f"mount -n --bind {workdir / 'var-lib'} /var/lib",
            f"mount -n --bind {workdir / 'var-log'} /var/log",
        ]
        for sysctl in KUBELET_SYSCTLS:
            standin = workdir / "sysctl" / sysctl.replace("/", ".")
            standin.write_text(Path(f"/proc/sys/{sysctl}").read_text())
            mounts.append(f"mount -n --bind {standin} /proc/sys/{sysctl}")
        routes = [
            f"ip route add {other_range} via 10.250.0.{10 + other}"
            for other in range(self.count)
            if other != index
            for other_range in [str(list(POD_RANGE.subnets(new_prefix=24))[other])]
        ]
        self._in(
            node.netns,
            holder.pid,
            " && ".join(
                [
                    *mounts,
                    "ip link set lo up",
                    f"ip addr add {node.address}/{FABRIC_PREFIX} dev eth0",
                    "ip link set eth0 up",
                    *routes,
                    # The fabric is the node's gateway, as a node's network has one: the node's own
                    # connections to a ClusterIP need a route before kube-proxy's OUTPUT rules rewrite them
                    # (nothing lies beyond the fabric: what is not a node or pod goes nowhere).
                    f"ip route add default via {FABRIC_GATEWAY}",
                    "sysctl -qw net.ipv4.ip_forward=1",
                ]
            ),
        )
        _make_cgroups(node.cgroup)
        return node

    def _start_coredns(self) -> None:
        corefile = self.workdir / "Corefile"
        corefile.write_text(
            f".:53 {{\n  bind {FABRIC_GATEWAY}\n  errors\n"
            f"  kubernetes {CLUSTER_DOMAIN} in-addr.arpa ip6.arpa {{\n"
            f"    kubeconfig {self.cp.kubeconfig} {self.cp.name}\n    pods insecure\n"
            "    fallthrough in-addr.arpa ip6.arpa\n  }\n}\n"
        )
        self._spawn("coredns", self.in_fabric([str(binaries.binary("coredns")), "-conf", str(corefile)]))

    def _start_containerd(self, node: Node) -> None:
        spec = json.loads(self._in(node.netns, node.holder.pid, "ctr oci spec", capture=True))
        if self.test_environment:
            spec["process"]["env"] = [
                *spec["process"].get("env", []),
                *(f"{key}={value}" for key, value in CONTAINER_ENV.items()),
            ]
            # containerd sets the default PATH in every container: the environment's commands (iwg-worker,
            # iwg-driver, python) are found through /usr/local/bin, where its bin directory is mounted.
            python_home = Path(os.path.realpath(sys.executable)).parents[1]
            for source, destination in (
                (REPO_ROOT, REPO_ROOT),
                (python_home, python_home),
                (Path(sys.prefix) / "bin", Path("/usr/local/bin")),
            ):
                spec["mounts"].append(
                    {
                        "destination": str(destination),
                        "type": "bind",
                        "source": str(source),
                        "options": ["rbind", "ro"],
                    }
                )
        base_spec = node.workdir / "etc" / "base-spec.json"
        base_spec.write_text(json.dumps(spec))
        (node.workdir / "cni" / "10-iwg.conflist").write_text(
            json.dumps(
                {
                    "cniVersion": "0.4.0",
                    "name": "iwg",
                    "plugins": [
                        {
                            "type": "bridge",
                            "bridge": "cni0",
                            "isGateway": True,
                            "ipMasq": False,
                            "hairpinMode": True,
                            "ipam": {
                                "type": "host-local",
                                "ranges": [[{"subnet": node.pod_range}]],
                                "routes": [{"dst": "0.0.0.0/0"}],
                            },
                        }
                    ],
                }
            )
        )
        config = node.workdir / "etc" / "containerd.toml"
        config.write_text(
            f"""version = 2
disabled_plugins = ["io.containerd.internal.v1.opt", "io.containerd.snapshotter.v1.btrfs",
  "io.containerd.snapshotter.v1.zfs", "io.containerd.snapshotter.v1.devmapper",
  "io.containerd.snapshotter.v1.aufs", "io.containerd.tracing.processor.v1.otlp"]
[grpc]
  address = "/run/containerd/containerd.sock"
[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "{PAUSE_IMAGE}"
  restrict_oom_score_adj = true
  [plugins."io.containerd.grpc.v1.cri".containerd]
    snapshotter = "overlayfs"
    default_runtime_name = "runc"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      base_runtime_spec = "{base_spec}"
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "/usr/lib/cni"
    conf_dir = "{node.workdir / "cni"}"
"""
        )
        self._spawn(f"{node.name}-containerd", self._nsenter(node, ["containerd", "--config", str(config)]))

    def _import_images(self, node: Node, archives: Path) -> None:
        ctr = CTR
        _wait_for(
            lambda: (
                subprocess.run(self._nsenter(node, [*ctr.split(), "version"]), capture_output=True).returncode
                == 0
            ),
            30,
            f"containerd of {node.name}",
            self,
        )
        for archive in (archives / "pause.tar", archives / "worker.tar", *self.extra_images):
            # A built worker image is about 5 GB (torch with its CUDA libraries): minutes to unpack.
            self._in(node.netns, node.holder.pid, f"{ctr} images import {archive} >/dev/null", timeout=900)

    def _start_kubelet(self, node: Node) -> None:
        config = node.workdir / "etc" / "kubelet.yaml"
        config.write_text(
            yaml.safe_dump(
                {
                    "apiVersion": "kubelet.config.k8s.io/v1beta1",
                    "kind": "KubeletConfiguration",
                    "failCgroupV1": False,
                    "cgroupDriver": "cgroupfs",
                    "cgroupRoot": f"/{node.cgroup}",
                    "failSwapOn": False,
                    "clusterDNS": [FABRIC_GATEWAY],
                    "clusterDomain": CLUSTER_DOMAIN,
                    "authentication": {"anonymous": {"enabled": True}, "webhook": {"enabled": False}},
                    "authorization": {"mode": "AlwaysAllow"},
                    "address": node.address,
                    "readOnlyPort": 0,
                    "healthzPort": 0,
                    "serializeImagePulls": False,
                    "containerRuntimeEndpoint": "unix:///run/containerd/containerd.sock",
                    # The disk is shared with everything on this machine: never evict for it.
                    "evictionHard": {
                        "memory.available": "1Mi",
                        "nodefs.available": "0%",
                        "imagefs.available": "0%",
                        "nodefs.inodesFree": "0%",
                    },
                    "imageGCHighThresholdPercent": 100,
                    "imageGCLowThresholdPercent": 99,
                    "nodeStatusUpdateFrequency": "5s",
                    "resolvConf": "/etc/resolv.conf",
                }
            )
        )
        self._spawn(
            f"{node.name}-kubelet",
            self._nsenter(
                node,
                [
                    str(binaries.binary("kubelet")),
                    f"--config={config}",
                    f"--kubeconfig={self.cp.kubeconfig}",
                    f"--hostname-override={node.name}",
                    f"--node-ip={node.address}",
                    "--v=1",
                ],
            ),
        )

    def _start_kube_proxy(self, node: Node) -> None:
        """kube-proxy in iptables mode, in the node's namespace (its rules are the node's). Conntrack sizes
        are left alone: they are host-wide sysctls. Endpoint changes are applied at most every
        KUBE_PROXY_MIN_SYNC (the default is 1 s; large clusters raise it): on two nodes a terminating pod
        would otherwise leave the rules within milliseconds, and the lame duck a driver needs on a real
        cluster would go untested."""
        config = node.workdir / "etc" / "kube-proxy.yaml"
        config.write_text(
            yaml.safe_dump(
                {
                    "apiVersion": "kubeproxy.config.k8s.io/v1alpha1",
                    "kind": "KubeProxyConfiguration",
                    "mode": "iptables",
                    "clientConnection": {"kubeconfig": str(self.cp.kubeconfig)},
                    "hostnameOverride": node.name,
                    "clusterCIDR": str(POD_RANGE),
                    "bindAddress": node.address,
                    "healthzBindAddress": "127.0.0.1:10256",
                    "metricsBindAddress": "127.0.0.1:10249",
                    "iptables": {"minSyncPeriod": KUBE_PROXY_MIN_SYNC},
                    "conntrack": {
                        "maxPerCore": 0,
                        "min": 0,
                        "tcpEstablishedTimeout": "0s",
                        "tcpCloseWaitTimeout": "0s",
                    },
                }
            )
        )
        self._spawn(
            f"{node.name}-kube-proxy",
            self._nsenter(node, [str(binaries.binary("kube-proxy")), f"--config={config}", "--v=1"]),
        )

    def power_off(self, node_name: str) -> None:
        """The node as if its power were cut: its kubelet, kube-proxy and containerd die without a word (no
        status, no Lease renewal, no pod deleted), so do its containers, and its link goes down, so nothing at
        its addresses or its pods' answers (connections time out). The control plane is left to find out."""
        node = next(n for n in self.nodes if n.name == node_name)
        for record in self._procs:
            if record.name.startswith(f"{node.name}-"):
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(record.pid, signal.SIGKILL)
        kill_until_gone(functools.partial(_cgroup_pids, node.cgroup), pause_s=0.1)
        _kill_in_mount_namespace(node.holder)
        self._in(node.netns, None, "ip link set eth0 down")

    def stop(self) -> None:
        """Stops every process of the nodes (kubelets first, then containers, shims, containerd, the rest)
        and removes the cgroups and files."""
        kubelets = [r for r in self._procs if r.name.endswith("-kubelet")]
        stop_processes(kubelets, grace_s=2.0)
        for node in self.nodes:
            kill_until_gone(functools.partial(_cgroup_pids, node.cgroup), pause_s=0.1)
            _kill_in_mount_namespace(node.holder)
            _remove_cgroups(node.cgroup)
        stop_processes(self._procs, grace_s=2.0)
        self._procs = []
        if os.environ.get("IWG_KEEP_CLUSTER_FILES") == "1":
            print(f"IWG_KEEP_CLUSTER_FILES=1: node files kept in {self.workdir}", file=sys.stderr)
            return
        shutil.rmtree(self.workdir, ignore_errors=True)

    # -- internals ------------------------------------------------------------------------------

    def _nsenter(self, node: Node, argv: list[str]) -> list[str]:
        return ["nsenter", f"--net={node.netns}", f"--mount=/proc/{node.holder.pid}/ns/mnt", "--", *argv]

    def _in(
        self, netns: str, mount_pid: int | None, script: str, capture: bool = False, timeout: float = 120
    ) -> str:
        argv = ["nsenter", f"--net={netns}"]
        if mount_pid is not None:
            argv.append(f"--mount=/proc/{mount_pid}/ns/mnt")
        done = subprocess.run(
            [*argv, "--", "sh", "-c", script], capture_output=True, text=True, timeout=timeout
        )
        if done.returncode != 0:
            raise RuntimeError(f"{script!r} failed: {done.stderr.strip()}")
        return done.stdout

    def _holder(self, name: str, namespaces: list[str]) -> ProcessRecord:
        """`sleep infinity` in new namespaces, returned once unshare has made them and exec'd sleep (before
        that, /proc/PID/ns/* are still the host's: nothing may enter them)."""
        record = self._spawn(name, ["unshare", *namespaces, "--", "sleep", "infinity"])
        _wait_for(
            lambda: os.path.basename(os.readlink(f"/proc/{record.pid}/exe")) == "sleep",
            10,
            f"{name}'s namespaces",
            self,
        )
        assert os.readlink(f"/proc/{record.pid}/ns/net") != os.readlink("/proc/self/ns/net")
        return record

    def _spawn(self, name: str, argv: list[str]) -> ProcessRecord:
        with (self.workdir / f"{name}.log").open("ab") as out:
            popen = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                cwd=REPO_ROOT,
                start_new_session=True,
                preexec_fn=_kill_with_parent,
            )
        record = ProcessRecord(name, popen.pid, psutil.Process(popen.pid).create_time())
        self._procs.append(record)
        return record


def _node_ready(core: client.CoreV1Api, name: str) -> bool:
    try:
        node = core.read_node(name)
    except client.ApiException:
        return False
    return any(c.type == "Ready" and c.status == "True" for c in node.status.conditions or [])


def _wait_for(ready: Any, timeout: float, what: str, nodes: RealNodes) -> None:
    deadline = time.monotonic() + timeout
    while not ready():
        if time.monotonic() > deadline:
            logs = "\n".join(
                f"==== {path.name}\n{nodes.log_tail(path.stem, 15)}"
                for path in sorted(nodes.workdir.glob("*.log"))
            )
            raise RuntimeError(f"{what}: not within {timeout:.0f}s\n{logs}")
        time.sleep(0.2)


def _hierarchies() -> list[Path]:
    return [p for p in CGROUP_ROOT.iterdir() if p.is_dir() and (p / "cgroup.procs").exists()]


def _make_cgroups(name: str) -> None:
    for hierarchy in _hierarchies():
        path = hierarchy / name
        path.mkdir(exist_ok=True)
        if hierarchy.name == "cpuset":
            for knob in ("cpuset.cpus", "cpuset.mems"):
                (path / knob).write_text((hierarchy / knob).read_text())


def _cgroup_pids(name: str) -> set[int]:
    pids: set[int] = set()
    for hierarchy in _hierarchies():
        # os.walk, not rglob: the kubelet and runc remove a container's cgroup while we walk (a FileNotFoundError
        # out of rglob failed a teardown); os.walk skips a directory that went away.
        for directory, _dirs, files in os.walk(hierarchy / name):
            if "cgroup.procs" in files:
                with contextlib.suppress(OSError, ValueError):
                    pids.update(int(p) for p in Path(directory, "cgroup.procs").read_text().split())
    return pids


def _kill_in_mount_namespace(holder: ProcessRecord) -> None:
    """Every process in the node's mount namespace but its holder (containerd's shims, which daemonize)."""
    try:
        ns = os.readlink(f"/proc/{holder.pid}/ns/mnt")
    except OSError:
        return
    for proc in psutil.process_iter():
        with contextlib.suppress(OSError, psutil.Error):
            if proc.pid != holder.pid and os.readlink(f"/proc/{proc.pid}/ns/mnt") == ns:
                proc.kill()


def _remove_cgroups(name: str) -> None:
    for hierarchy in _hierarchies():
        root = hierarchy / name
        if not root.is_dir():
            continue
        for path in sorted((p for p in root.rglob("*") if p.is_dir()), key=lambda p: -len(p.parts)):
            with contextlib.suppress(OSError):
                path.rmdir()
        with contextlib.suppress(OSError):
            root.rmdir()


STALE_CGROUP = re.compile(r"iwg-(\d+)-[0-9a-f]+-realnode-\d+")


def sweep_stale() -> list[str]:
    """Kills the containers of nodes whose owning process is gone (a test run killed before its teardown)
    and removes their cgroups; returns the cgroup names swept."""
    stale = {
        path.name
        for hierarchy in _hierarchies()
        for path in hierarchy.iterdir()
        if (found := STALE_CGROUP.fullmatch(path.name)) and not psutil.pid_exists(int(found.group(1)))
    }
    for name in sorted(stale):
        kill_until_gone(functools.partial(_cgroup_pids, name), pause_s=0.1)
        _remove_cgroups(name)
    return sorted(stale)
