"""Pod networking for the node agent: one bridge per agent, one network namespace + veth pair per pod.

Every name carries the agent's token, and the agent's state directory records its pid, so a later agent
(or `python -m tests.nodeagent.cleanup`) can remove what a killed agent left behind. Addresses come from a
private /24 chosen at random among those no route on this machine uses; nothing routes out of it.
"""

from __future__ import annotations

import contextlib
import ipaddress
import json
import logging
import os
import random
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from tests.cluster.control_plane import kill_until_gone

log = logging.getLogger("nodeagent.network")

STATE_ROOT = Path("/run/iwg-nodeagent")
NETNS_ETC = Path("/etc/netns")
# 10.200.0.0/13 .. : a private range unlikely to meet anything of the machine's own.
SUBNET_POOL = ipaddress.ip_network("10.200.0.0/13")


class NetworkError(RuntimeError):
    pass


def ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(["ip", *args], capture_output=True, text=True)
    if check and done.returncode != 0:
        raise NetworkError(f"ip {' '.join(args)}: {done.stderr.strip()}")
    return done


def _used_networks() -> list[ipaddress.IPv4Network]:
    routes = ip("-4", "-j", "route", "show", "table", "all").stdout
    nets = []
    for route in json.loads(routes or "[]"):
        dst = route.get("dst", "")
        if dst and dst != "default":
            with contextlib.suppress(ValueError):
                nets.append(ipaddress.ip_network(dst, strict=False))
    return nets


def pick_subnet() -> ipaddress.IPv4Network:
    used = _used_networks()
    candidates = list(SUBNET_POOL.subnets(new_prefix=24))
    random.shuffle(candidates)
    for net in candidates:
        if not any(net.overlaps(u) for u in used):
            return net
    raise NetworkError(f"no free /24 left in {SUBNET_POOL}")


@dataclass(frozen=True)
class Bridge:
    token: str
    name: str
    subnet: ipaddress.IPv4Network

    @property
    def gateway(self) -> str:
        return str(self.subnet.network_address + 1)

    @property
    def state_dir(self) -> Path:
        return STATE_ROOT / self.token

    @classmethod
    def create(cls, token: str) -> Bridge:
        bridge = cls(token=token, name=f"iwgb{token}", subnet=pick_subnet())
        bridge.state_dir.mkdir(parents=True, exist_ok=True)
        (bridge.state_dir / "owner").write_text(f"{os.getpid()}\n")
        ip("link", "add", bridge.name, "type", "bridge")
        ip("addr", "add", f"{bridge.gateway}/{bridge.subnet.prefixlen}", "dev", bridge.name)
        ip("link", "set", bridge.name, "up")
        return bridge

    def netns_name(self, index: int) -> str:
        return f"iwg-{self.token}-{index}"

    def veth_name(self, index: int) -> str:
        return f"iv{self.token}{index}"

    def address(self, index: int) -> str:
        """Pod addresses start at .2 (.1 is the bridge: the node, the DNS server)."""
        if not 0 <= index < self.subnet.num_addresses - 3:
            raise NetworkError(f"pod address index {index} outside {self.subnet}")
        return str(self.subnet.network_address + 2 + index)

    def add_sandbox(self, index: int, nameserver: str, search: list[str]) -> str:
        """A network namespace with eth0 on the bridge and a resolv.conf pointing at `nameserver`."""
        netns = self.netns_name(index)
        host_veth = self.veth_name(index)
        address = self.address(index)
        ip("link", "del", host_veth, check=False)  # left by a namespace the kernel has not freed yet
        ip("netns", "add", netns)
        try:
            ip("link", "add", host_veth, "type", "veth", "peer", "name", "eth0", "netns", netns)
            ip("link", "set", host_veth, "master", self.name, "up")
            ip("-n", netns, "link", "set", "lo", "up")
            ip("-n", netns, "addr", "add", f"{address}/{self.subnet.prefixlen}", "dev", "eth0")
            ip("-n", netns, "link", "set", "eth0", "up")
            ip("-n", netns, "route", "add", "default", "via", self.gateway)
            etc = NETNS_ETC / netns
            etc.mkdir(parents=True, exist_ok=True)
            (etc / "resolv.conf").write_text(
                f"nameserver {nameserver}\nsearch {' '.join(search)}\noptions ndots:5 timeout:1 attempts:3\n"
            )
        except BaseException:
            remove_sandbox(netns, host_veth)
            raise
        return address


def sandbox_pids(netns: str) -> list[int]:
    done = ip("netns", "pids", netns, check=False)
    return [int(p) for p in done.stdout.split() if p.strip().isdigit()]


def kill_sandbox_processes(netns: str, grace_s: float = 0.0) -> None:
    """Every process inside the namespace: the whole process tree of the pod, whatever it forked."""
    pids = sandbox_pids(netns)
    if grace_s > 0 and pids:
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        while sandbox_pids(netns) and time.monotonic() < deadline:
            time.sleep(0.05)
    kill_until_gone(lambda: sandbox_pids(netns))


def remove_sandbox(netns: str, veth: str | None = None) -> None:
    kill_sandbox_processes(netns)
    if veth is not None:
        # Deleting one end removes the pair now; the namespace itself is freed by the kernel later.
        ip("link", "del", veth, check=False)
    ip("netns", "del", netns, check=False)
    shutil.rmtree(NETNS_ETC / netns, ignore_errors=True)


def remove_agent_network(token: str) -> None:
    """Everything an agent with this token created: its pods' namespaces, veths, bridge, state."""
    prefix = f"iwg-{token}-"
    for line in ip("netns", "list", check=False).stdout.splitlines():
        name = line.split()[0] if line.split() else ""
        if name.startswith(prefix):
            remove_sandbox(name)
    for line in ip("-br", "link", check=False).stdout.splitlines():
        name = line.split()[0].split("@")[0] if line.split() else ""
        if name.startswith((f"iv{token}", f"iwgb{token}")):
            ip("link", "del", name, check=False)
    for etc in NETNS_ETC.glob(f"{prefix}*"):
        shutil.rmtree(etc, ignore_errors=True)
    shutil.rmtree(STATE_ROOT / token, ignore_errors=True)


def sweep_stale_agents() -> list[str]:
    """Removes the networks of agents whose process is gone (killed before their own teardown)."""
    removed = []
    if not STATE_ROOT.is_dir():
        return removed
    for state in STATE_ROOT.iterdir():
        owner = state / "owner"
        try:
            pid = int(owner.read_text().strip())
        except (OSError, ValueError):
            pid = 0
        if pid and Path(f"/proc/{pid}").exists():
            continue
        remove_agent_network(state.name)
        removed.append(state.name)
    return removed
