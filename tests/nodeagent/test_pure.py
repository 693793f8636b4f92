"""Pure parts of the node agent: the DNS table and the pod -> process translation."""

from __future__ import annotations

import base64
from pathlib import Path
from typing import Any

import pytest

from tests.nodeagent.dns import DnsTable, build_table
from tests.nodeagent.podspec import (
    MissingObjectError,
    PodSpecError,
    expand,
    materialise_volumes,
    plan_container,
    resolve_env,
)


def service(name: str, headless: bool = False, publish: bool = False) -> dict[str, Any]:
    spec: dict[str, Any] = {"clusterIP": "None" if headless else "10.96.0.10"}
    if publish:
        spec["publishNotReadyAddresses"] = True
    return {"metadata": {"namespace": "ns", "name": name}, "spec": spec}


def endpoint_slice(svc: str, endpoints: list[tuple[str, bool, str | None]]) -> dict[str, Any]:
    return {
        "metadata": {"namespace": "ns", "name": f"{svc}-x", "labels": {"kubernetes.io/service-name": svc}},
        "addressType": "IPv4",
        "endpoints": [
            {"addresses": [ip], "conditions": {"ready": ready}, **({"hostname": host} if host else {})}
            for ip, ready, host in endpoints
        ],
    }


def test_headless_service_publishes_ready_endpoints_and_per_pod_names() -> None:
    table = build_table(
        [service("peers", headless=True)],
        [endpoint_slice("peers", [("10.1.0.2", True, "w-0"), ("10.1.0.3", False, "w-1")])],
        [],
    )
    assert table["peers.ns.svc.cluster.local"] == ("10.1.0.2",)
    assert table["w-0.peers.ns.svc.cluster.local"] == ("10.1.0.2",)
    assert "w-1.peers.ns.svc.cluster.local" not in table


def test_publish_not_ready_addresses_includes_unready_pods() -> None:
    table = build_table(
        [service("peers", headless=True, publish=True)],
        [endpoint_slice("peers", [("10.1.0.2", True, "w-0"), ("10.1.0.3", False, "w-1")])],
        [],
    )
    assert table["w-1.peers.ns.svc.cluster.local"] == ("10.1.0.3",)


def test_cluster_ip_service_resolves_to_ready_endpoints_or_to_any_while_none_is_ready() -> None:
    both = endpoint_slice("front", [("10.1.0.2", False, None), ("10.1.0.3", True, None)])
    assert build_table([service("front")], [both], [])["front.ns.svc.cluster.local"] == ("10.1.0.3",)
    starting = endpoint_slice("front", [("10.1.0.2", False, None)])
    assert build_table([service("front")], [starting], [])["front.ns.svc.cluster.local"] == ("10.1.0.2",)
    empty = build_table([service("front")], [], [])
    assert empty["front.ns.svc.cluster.local"] == ()


def test_lookup_is_case_insensitive_and_unknown_names_are_none() -> None:
    table = DnsTable()
    table.replace({"a.ns.svc.cluster.local": ("10.1.0.9",)})
    assert table.lookup("A.NS.svc.cluster.local.") == ("10.1.0.9",)
    assert table.lookup("b.ns.svc.cluster.local.") is None


POD: dict[str, Any] = {
    "metadata": {"name": "p", "namespace": "ns", "uid": "u1", "labels": {"app": "x"}},
    "spec": {"nodeName": "agent-0", "hostname": "p-host"},
    "status": {"podIP": "10.1.0.7"},
}


def test_env_resolves_downward_api_secrets_config_maps_and_dependent_vars() -> None:
    container = {
        "name": "c",
        "envFrom": [{"configMapRef": {"name": "cm"}, "prefix": "CM_"}],
        "env": [
            {"name": "IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
            {"name": "APP", "valueFrom": {"fieldRef": {"fieldPath": "metadata.labels['app']"}}},
            {"name": "URL", "value": "tcp://$(IP):5555 $$(IP) $(UNKNOWN)"},
            {"name": "PW", "valueFrom": {"secretKeyRef": {"name": "s", "key": "pw"}}},
            {"name": "CPU", "valueFrom": {"resourceFieldRef": {"resource": "limits.cpu"}}},
        ],
        "resources": {"limits": {"cpu": "1500m"}},
    }
    objects = {
        ("Secret", "s"): {"kind": "Secret", "data": {"pw": base64.b64encode(b"hunter2").decode()}},
        ("ConfigMap", "cm"): {"kind": "ConfigMap", "data": {"MODE": "fast"}},
    }
    env = resolve_env(POD, container, objects, {"PATH": "/bin"})
    assert env["IP"] == "10.1.0.7" and env["APP"] == "x"
    assert env["URL"] == "tcp://10.1.0.7:5555 $(IP) $(UNKNOWN)"
    assert env["PW"] == "hunter2" and env["CM_MODE"] == "fast" and env["CPU"] == "2"
    with pytest.raises(MissingObjectError, match="Secret 's'"):
        resolve_env(POD, container, {k: v for k, v in objects.items() if k[0] != "Secret"}, {})


def test_volumes_are_written_and_mounted_at_their_paths(tmp_path: Path) -> None:
    pod = {
        **POD,
        "spec": {
            **POD["spec"],
            "volumes": [
                {
                    "name": "keys",
                    "secret": {"secretName": "s", "items": [{"key": "pw", "path": "sub/pw.txt"}]},
                },
                {"name": "shm", "emptyDir": {"medium": "Memory", "sizeLimit": "1Mi"}},
            ],
        },
    }
    objects = {("Secret", "s"): {"kind": "Secret", "data": {"pw": base64.b64encode(b"hunter2").decode()}}}
    volumes = materialise_volumes(pod, tmp_path, objects)
    assert (tmp_path / "keys" / "sub" / "pw.txt").read_bytes() == b"hunter2"
    assert volumes["shm"] == str(2**20)
    container = {
        "name": "c",
        "command": ["run", "$(HOSTNAME)"],
        "volumeMounts": [
            {"name": "keys", "mountPath": "/etc/keys", "readOnly": True},
            {"name": "shm", "mountPath": "/dev/shm"},
        ],
    }
    plan = plan_container(pod, container, volumes, objects, {}, "/tmp")
    assert plan.argv == ("run", "p-host") and plan.hostname == "p-host"
    assert plan.mounts[0].target == "/etc/keys" and plan.mounts[0].read_only
    assert plan.mounts[1].tmpfs_size == str(2**20)
    with pytest.raises(PodSpecError, match="command is required"):
        plan_container(pod, {"name": "c"}, volumes, objects, {}, "/tmp")


def test_expand_leaves_unknown_references_alone() -> None:
    assert expand("$(A)-$(B)-$$(A)", {"A": "1"}) == "1-$(B)-$(A)"
