"""The operator's own client keeps working after the ServiceAccount token it started with stops being accepted.

Tokens come from the real API server's TokenRequest API, each bound to a Secret of its own: deleting that
Secret revokes the token at once (the server checks a bound token's object on every request), which stands in
for a projected token that the kubelet rotated and that then expired. The token file is rewritten the way the
kubelet does it (a new file renamed over the old one).
"""

from __future__ import annotations

import dataclasses
import ssl
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import yaml
from iwg_operator.credentials import TokenSource, from_kubeconfig, from_service_account
from iwg_operator.kube import CONFIG_MAPS, Connection, KubeApi
from kubernetes import client
from kubernetes.client import ApiClient

from tests.cluster.waiting import eventually
from tests.iwg_operator.conftest import Groups, running_operator

pytestmark = pytest.mark.cluster

ACCOUNT = "iwg-operator"


class Tokens:
    """Short-lived tokens of one ServiceAccount, each revocable by deleting the Secret it is bound to."""

    def __init__(self, k8s: ApiClient, namespace: str, control_plane: Any) -> None:
        self.core = client.CoreV1Api(k8s)
        self.namespace = namespace
        self.control_plane = control_plane
        self.issued = 0
        self.core.create_namespaced_service_account(
            namespace, client.V1ServiceAccount(metadata=client.V1ObjectMeta(name=ACCOUNT))
        )

    def issue(self) -> tuple[str, str]:
        """A new token (10 minutes, the shortest the API server issues) and the name of its Secret."""
        self.issued += 1
        name = f"token-{self.issued}"
        secret = self.core.create_namespaced_secret(
            self.namespace, client.V1Secret(metadata=client.V1ObjectMeta(name=name))
        )
        request = client.AuthenticationV1TokenRequest(
            spec=client.V1TokenRequestSpec(
                audiences=[],
                expiration_seconds=600,
                bound_object_ref=client.V1BoundObjectReference(
                    api_version="v1", kind="Secret", name=name, uid=secret.metadata.uid
                ),
            )
        )
        issued = self.core.create_namespaced_service_account_token(ACCOUNT, self.namespace, request)
        return str(issued.status.token), name

    def revoke(self, secret: str, token: str) -> None:
        self.core.delete_namespaced_secret(secret, self.namespace)
        eventually(lambda: self.status(token) == 401, what="the revoked token refused")

    def status(self, token: str) -> int:
        """What the API server answers a plain request carrying `token`."""
        context = ssl.create_default_context(cafile=str(self.control_plane.ca_file))
        request = urllib.request.Request(
            f"{self.control_plane.server}/api/v1/namespaces/{self.namespace}/configmaps",
            headers={"Authorization": f"Bearer {token}"},
        )
        try:
            with urllib.request.urlopen(request, context=context, timeout=10) as response:
                return int(response.status)
        except urllib.error.HTTPError as error:
            return int(error.code)


def write_token(path: Path, token: str) -> None:
    """As the kubelet does: the new token lands complete, never half-written."""
    staged = path.with_name(f".{path.name}.new")
    staged.write_text(token)
    staged.replace(path)


def config_map(name: str) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": name}}


@pytest.fixture
def tokens(controller_manager: Any, k8s: ApiClient, namespace: str, control_plane: Any) -> Tokens:
    made = Tokens(k8s, namespace, control_plane)
    client.RbacAuthorizationV1Api(k8s).create_namespaced_role_binding(
        namespace,
        client.V1RoleBinding(
            metadata=client.V1ObjectMeta(name=ACCOUNT),
            role_ref=client.V1RoleRef(
                api_group="rbac.authorization.k8s.io", kind="ClusterRole", name="cluster-admin"
            ),
            subjects=[client.RbacV1Subject(kind="ServiceAccount", name=ACCOUNT, namespace=namespace)],
        ),
    )
    return made


async def test_the_client_rereads_the_service_account_token_on_401_and_every_minute(
    tokens: Tokens, namespace: str, control_plane: Any, tmp_path: Path
) -> None:
    account = tmp_path / "serviceaccount"
    account.mkdir()
    (account / "ca.crt").write_bytes(control_plane.ca_file.read_bytes())
    first, first_secret = tokens.issue()
    write_token(account / "token", first)
    host, port = control_plane.server.removeprefix("https://").rsplit(":", 1)
    credentials = from_service_account(
        {"KUBERNETES_SERVICE_HOST": host, "KUBERNETES_SERVICE_PORT": port}, account
    )
    assert credentials is not None and credentials.token == first
    clock = [0.0]
    connection = Connection.from_credentials(credentials)
    connection = dataclasses.replace(connection, tokens=TokenSource(credentials, clock=lambda: clock[0]))
    kube = KubeApi(connection)
    try:
        await kube.create(CONFIG_MAPS, namespace, config_map("with-the-first"))

        # Rotated and the old one revoked before the minute is up: the 401 makes the client read the file again.
        second, second_secret = tokens.issue()
        write_token(account / "token", second)
        tokens.revoke(first_secret, first)
        await kube.create(CONFIG_MAPS, namespace, config_map("after-a-401"))
        counts = kube.requests.counts
        assert counts[("create", "configmaps", 401)] == 1, counts
        assert counts[("create", "configmaps", 201)] == 2, counts

        # Rotated again: a minute later the file is read before the request, so revoking the second token
        # costs no 401 at all.
        third, _ = tokens.issue()
        write_token(account / "token", third)
        clock[0] += 61
        await kube.create(CONFIG_MAPS, namespace, config_map("after-a-minute"))
        tokens.revoke(second_secret, second)
        await kube.create(CONFIG_MAPS, namespace, config_map("with-the-third"))
        counts = kube.requests.counts
        assert counts[("create", "configmaps", 401)] == 1, counts
        assert counts[("create", "configmaps", 201)] == 4, counts
    finally:
        await kube.close()


@pytest.fixture
def operator_account(tokens: Tokens, k8s: ApiClient, namespace: str) -> Iterator[Tokens]:
    """The ServiceAccount with what the operator needs (cluster-admin, for brevity: RBAC is tested elsewhere)."""
    rbac = client.RbacAuthorizationV1Api(k8s)
    name = f"{namespace}-{ACCOUNT}"
    rbac.create_cluster_role_binding(
        client.V1ClusterRoleBinding(
            metadata=client.V1ObjectMeta(name=name),
            role_ref=client.V1RoleRef(
                api_group="rbac.authorization.k8s.io", kind="ClusterRole", name="cluster-admin"
            ),
            subjects=[client.RbacV1Subject(kind="ServiceAccount", name=ACCOUNT, namespace=namespace)],
        )
    )
    try:
        yield tokens
    finally:
        rbac.delete_cluster_role_binding(name)


def test_the_operator_keeps_reconciling_after_its_first_token_is_revoked(
    operator_account: Tokens,
    iwg_crd: Any,
    groups: Groups,
    control_plane: Any,
    namespace: str,
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
) -> None:
    tokens = operator_account
    token_file = tmp_path / "token"
    first, first_secret = tokens.issue()
    write_token(token_file, first)
    admin = yaml.safe_load(control_plane.kubeconfig.read_text())
    admin["users"] = [{"name": "sa", "user": {"tokenFile": str(token_file)}}]
    admin["contexts"][0]["context"]["user"] = "sa"
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(yaml.safe_dump(admin))
    assert from_kubeconfig([kubeconfig]).token == first

    with running_operator(SimpleNamespace(kubeconfig=kubeconfig), namespace, monkeypatch):
        groups.create("before", replicas=2, worker={"gpus": 0})
        eventually(lambda: len(groups.pods("before")) == 2, timeout=60, what="2 pods with the first token")

        second, _ = tokens.issue()
        write_token(token_file, second)
        tokens.revoke(first_secret, first)
        groups.create("after", replicas=2, worker={"gpus": 0})
        eventually(lambda: len(groups.pods("after")) == 2, timeout=60, what="2 pods after the revocation")
        eventually(
            lambda: (groups.get("after").get("status") or {}).get("replicas") == 2,
            timeout=60,
            what="the status written after the revocation",
        )
