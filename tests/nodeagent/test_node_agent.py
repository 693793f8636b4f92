"""The node agent against the real control plane: pods bound to its nodes run as real processes.

One small "inspector" pod program serves what it sees (env, files, name resolution) over HTTP from its pod
address, so every check reads what the process itself observed.
"""

from __future__ import annotations

import base64
import json
import os
import signal
import textwrap
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import pytest
from kubernetes import client
from kubernetes.client import ApiClient
from kubernetes.client.exceptions import ApiException

from tests.cluster.waiting import eventually as _eventually
from tests.nodeagent import network
from tests.nodeagent.fixture import NodeAgentProcess

pytestmark = pytest.mark.cluster

T = TypeVar("T")

INSPECTOR = textwrap.dedent(
    """
    import json, os, socket, sys, urllib.parse
    from http.server import BaseHTTPRequestHandler, HTTPServer

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):
            url = urllib.parse.urlparse(self.path)
            query = dict(urllib.parse.parse_qsl(url.query))
            try:
                if url.path == "/env":
                    body = dict(os.environ)
                elif url.path == "/file":
                    body = {"content": open(query["path"]).read()}
                elif url.path == "/resolve":
                    body = {"addresses": sorted({a[4][0] for a in socket.getaddrinfo(query["name"], None, socket.AF_INET)})}
                elif url.path == "/whoami":
                    body = {"hostname": socket.gethostname(), "argv": sys.argv, "cwd": os.getcwd()}
                else:
                    body = {"ok": True}
                code = 200
            except Exception as error:
                body, code = {"error": repr(error)}, 200
            data = json.dumps(body).encode()
            self.send_response(code)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args):
            pass

    HTTPServer((os.environ["BIND"], 8080), Handler).serve_forever()
    """
)


def eventually(check: Callable[[], T | None], timeout: float = 30, what: str = "condition") -> T:
    return _eventually(check, timeout, what, tolerate=(ApiException, OSError, KeyError, ValueError))


def get_json(url: str, timeout: float = 3) -> Any:
    with urllib.request.urlopen(url, timeout=timeout) as response:
        return json.loads(response.read())


def inspector_pod(name: str, node: str | None = None, **spec_extra: Any) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "restartPolicy": "Always",
        "automountServiceAccountToken": False,
        "containers": [
            {
                "name": "main",
                "image": "example.invalid/inspector:1",
                "command": ["python", "-c", INSPECTOR],
                "args": ["$(POD_NAME)", "$$literal"],
                "env": [
                    {"name": "BIND", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
                    {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
                    {"name": "POD_NAMESPACE", "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}},
                    {"name": "GREETING", "value": "hello $(POD_NAME)"},
                    {"name": "FROM_SECRET", "valueFrom": {"secretKeyRef": {"name": "creds", "key": "token"}}},
                ],
                "envFrom": [{"configMapRef": {"name": "settings"}, "prefix": "CFG_"}],
                "ports": [{"name": "http", "containerPort": 8080}],
                "readinessProbe": {"httpGet": {"path": "/ready", "port": "http"}, "periodSeconds": 1},
                "volumeMounts": [
                    # first: it hides the host's /tmp, where the agent keeps the other volumes' files
                    {"name": "tmp", "mountPath": "/tmp"},
                    {"name": "creds", "mountPath": "/etc/iwg-nodeagent-test/creds", "readOnly": True},
                    {"name": "shm", "mountPath": "/dev/shm"},
                ],
            }
        ],
        "volumes": [
            {
                "name": "creds",
                "secret": {"secretName": "creds", "items": [{"key": "token", "path": "token.txt"}]},
            },
            {"name": "shm", "emptyDir": {"medium": "Memory", "sizeLimit": "16Mi"}},
            {"name": "tmp", "emptyDir": {}},
        ],
        **spec_extra,
    }
    if node:
        spec["nodeName"] = node
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "labels": {"app": name}},
        "spec": spec,
    }


@pytest.fixture
def core(k8s: ApiClient) -> client.CoreV1Api:
    return client.CoreV1Api(k8s)


@pytest.fixture
def objects(core: client.CoreV1Api, namespace: str) -> Iterator[None]:
    core.create_namespaced_secret(
        namespace, {"metadata": {"name": "creds"}, "data": {"token": base64.b64encode(b"s3cret").decode()}}
    )
    core.create_namespaced_config_map(namespace, {"metadata": {"name": "settings"}, "data": {"MODE": "fast"}})
    yield


def running_pod(core: client.CoreV1Api, namespace: str, name: str, timeout: float = 30) -> client.V1Pod:
    def ready() -> client.V1Pod | None:
        pod = core.read_namespaced_pod(name, namespace)
        conditions = {c.type: c.status for c in (pod.status.conditions or [])}
        return pod if pod.status.phase == "Running" and conditions.get("Ready") == "True" else None

    return eventually(ready, timeout, f"pod {name} Running and Ready")


def test_nodes_are_registered_ready_with_gpus_and_not_kwok_managed(
    node_agent: NodeAgentProcess, core: client.CoreV1Api
) -> None:
    for name in node_agent.nodes:
        node = core.read_node(name)
        assert "kwok.x-k8s.io/node" not in (node.metadata.annotations or {})
        assert node.status.allocatable["nvidia.com/gpu"] == "8"
        assert node.metadata.labels["nvidia.com/gpu.product"]
        assert {c.type: c.status for c in node.status.conditions}["Ready"] == "True"
        assert not node.spec.taints  # untainted: pods land here without tolerations
    lease_api = client.CoordinationV1Api(core.api_client)
    first = lease_api.read_namespaced_lease(node_agent.nodes[0], "kube-node-lease").spec.renew_time
    eventually(
        lambda: (
            lease_api.read_namespaced_lease(node_agent.nodes[0], "kube-node-lease").spec.renew_time > first
        ),
        timeout=15,
        what="the node Lease to be renewed",
    )


def test_pod_runs_as_a_process_with_its_env_files_and_address(
    node_agent: NodeAgentProcess, core: client.CoreV1Api, namespace: str, objects: None
) -> None:
    core.create_namespaced_pod(namespace, inspector_pod("inspect", node=node_agent.nodes[0]))
    pod = running_pod(core, namespace, "inspect")
    ip = pod.status.pod_ip
    assert network.ipaddress.ip_address(ip) in network.ipaddress.ip_network(node_agent.subnet)
    base = f"http://{ip}:8080"
    env = get_json(f"{base}/env")
    assert env["POD_NAME"] == "inspect" and env["POD_NAMESPACE"] == namespace
    assert env["BIND"] == ip
    assert env["GREETING"] == "hello inspect"
    assert env["FROM_SECRET"] == "s3cret" and env["CFG_MODE"] == "fast"
    assert env["HF_HUB_OFFLINE"] == "1"
    who = get_json(f"{base}/whoami")
    assert who["hostname"] == "inspect"
    assert who["argv"][1:] == ["inspect", "$literal"]
    token = get_json(f"{base}/file?path=/etc/iwg-nodeagent-test/creds/token.txt")
    assert token["content"] == "s3cret"
    # The mount is private to the pod: the host sees an empty mount point at most.
    assert not os.path.exists("/etc/iwg-nodeagent-test/creds/token.txt")
    status = pod.status.container_statuses[0]
    assert status.ready and status.restart_count == 0 and status.state.running is not None


def test_cluster_dns_names_resolve_inside_pods(
    node_agent: NodeAgentProcess, core: client.CoreV1Api, namespace: str, objects: None
) -> None:
    core.create_namespaced_service(
        namespace,
        {
            "metadata": {"name": "peers"},
            "spec": {
                "clusterIP": "None",
                "selector": {"group": "g"},
                "ports": [{"port": 8080}],
                "publishNotReadyAddresses": True,
            },
        },
    )
    core.create_namespaced_service(
        namespace,
        {
            "metadata": {"name": "front"},
            "spec": {"selector": {"app": "web-0"}, "ports": [{"port": 80, "targetPort": 8080}]},
        },
    )
    for index, node in enumerate(node_agent.nodes):
        manifest = inspector_pod(f"web-{index}", node=node, hostname=f"web-{index}", subdomain="peers")
        manifest["metadata"]["labels"]["group"] = "g"
        core.create_namespaced_pod(namespace, manifest)
    ips = [running_pod(core, namespace, f"web-{i}").status.pod_ip for i in range(len(node_agent.nodes))]
    base = f"http://{ips[1]}:8080"

    def resolves(name: str, expected: list[str]) -> bool:
        answer = get_json(f"{base}/resolve?name={urllib.parse.quote(name)}")
        return answer.get("addresses") == sorted(expected)

    eventually(lambda: resolves(f"web-0.peers.{namespace}.svc.cluster.local", [ips[0]]), what="per-pod name")
    eventually(lambda: resolves("web-0.peers", [ips[0]]), what="per-pod name through the search path")
    eventually(lambda: resolves(f"peers.{namespace}.svc", ips), what="headless Service name")
    eventually(lambda: resolves("front", [ips[0]]), what="ClusterIP Service name -> ready endpoint")
    eventually(lambda: resolves("web-1", [ips[1]]), what="own hostname")
    missing = get_json(f"{base}/resolve?name=nothing-here")
    assert "error" in missing


def test_restart_after_a_crash_and_teardown_on_delete(
    node_agent: NodeAgentProcess, core: client.CoreV1Api, namespace: str, objects: None
) -> None:
    core.create_namespaced_pod(namespace, inspector_pod("crashy", node=node_agent.nodes[1]))
    pod = running_pod(core, namespace, "crashy")
    pid = int(pod.status.container_statuses[0].container_id.split("//")[1])
    os.kill(pid, signal.SIGKILL)

    def restarted() -> client.V1Pod | None:
        current = core.read_namespaced_pod("crashy", namespace)
        status = current.status.container_statuses[0]
        return current if status.restart_count == 1 and status.ready else None

    pod = eventually(restarted, what="a restart after SIGKILL")
    status = pod.status.container_statuses[0]
    assert status.last_state.terminated.signal == signal.SIGKILL
    new_pid = int(status.container_id.split("//")[1])
    assert new_pid != pid and os.path.exists(f"/proc/{new_pid}")
    netns = [n.split()[0] for n in network.ip("netns", "list").stdout.splitlines() if node_agent.token in n]
    assert netns

    core.delete_namespaced_pod("crashy", namespace, grace_period_seconds=5)

    def gone() -> bool:
        try:
            core.read_namespaced_pod("crashy", namespace)
            return False
        except ApiException as error:
            return error.status == 404

    eventually(gone, what="the pod to be deleted")
    assert not os.path.exists(f"/proc/{new_pid}")


def test_agent_teardown_leaves_nothing(control_plane: Any, core: client.CoreV1Api, namespace: str) -> None:
    agent = NodeAgentProcess(control_plane.kubeconfig, nodes=["agent-teardown"]).start()
    try:
        manifest = inspector_pod("lonely", node="agent-teardown")
        manifest["spec"]["containers"][0].pop("envFrom")
        manifest["spec"]["containers"][0]["env"] = manifest["spec"]["containers"][0]["env"][:3]
        manifest["spec"]["containers"][0].pop("volumeMounts")
        manifest["spec"].pop("volumes")
        core.create_namespaced_pod(namespace, manifest)
        pod = running_pod(core, namespace, "lonely")
        pid = int(pod.status.container_statuses[0].container_id.split("//")[1])
    finally:
        agent.stop()
    assert not os.path.exists(f"/proc/{pid}")
    leftovers = [line for line in network.ip("-br", "link").stdout.splitlines() if agent.token in line]
    assert leftovers == []
    assert [n for n in network.ip("netns", "list").stdout.splitlines() if agent.token in n] == []
    with pytest.raises(ApiException) as missing:
        core.read_node("agent-teardown")
    assert missing.value.status == 404
