"""Credentials from a kubeconfig or a service account directory, read without the kubernetes client."""

from __future__ import annotations

import base64
import stat
import sys
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
import yaml
from iwg_operator.credentials import CredentialsError, TokenSource, from_kubeconfig, from_service_account


def kubeconfig(path: Path, user: dict[str, Any], cluster: dict[str, Any], current: str = "ctx") -> Path:
    path.write_text(
        yaml.safe_dump(
            {
                "current-context": current,
                "contexts": [{"name": "ctx", "context": {"cluster": "c", "user": "u"}}],
                "clusters": [{"name": "c", "cluster": cluster}],
                "users": [{"name": "u", "user": user}],
            }
        )
    )
    return path


def test_token_and_inline_ca_are_read_and_the_ca_lands_in_a_private_file(tmp_path: Path) -> None:
    ca = b"-----BEGIN CERTIFICATE-----\nnot really\n-----END CERTIFICATE-----\n"
    path = kubeconfig(
        tmp_path / "config",
        {"token": "t0k"},
        {"server": "https://127.0.0.1:6443/", "certificate-authority-data": base64.b64encode(ca).decode()},
    )
    found = from_kubeconfig([path])
    assert (found.server, found.token, found.verify) == ("https://127.0.0.1:6443", "t0k", True)
    assert found.ca_file is not None and Path(found.ca_file).read_bytes() == ca
    assert stat.S_IMODE(Path(found.ca_file).stat().st_mode) == 0o600


def test_relative_files_resolve_against_the_kubeconfig_and_the_first_file_wins(tmp_path: Path) -> None:
    (tmp_path / "a").mkdir()
    first = kubeconfig(
        tmp_path / "a" / "config",
        {"client-certificate": "u.crt", "client-key": "/abs/u.key"},
        {"server": "https://one", "certificate-authority": "ca.crt", "insecure-skip-tls-verify": True},
    )
    second = kubeconfig(tmp_path / "config", {"token": "other"}, {"server": "https://two"}, current="x")
    found = from_kubeconfig([tmp_path / "missing", first, second])
    assert found.server == "https://one" and found.token is None and not found.verify
    assert found.ca_file == str(tmp_path / "a" / "ca.crt")
    assert (found.cert_file, found.key_file) == (str(tmp_path / "a" / "u.crt"), "/abs/u.key")


def test_an_exec_plugin_supplies_the_token(tmp_path: Path) -> None:
    plugin = tmp_path / "plugin.py"
    plugin.write_text(
        "import json, os\n"
        "info = json.loads(os.environ['KUBERNETES_EXEC_INFO'])\n"
        "print(json.dumps({'kind': info['kind'], 'status': {'token': os.environ['PREFIX'] + '-issued'}}))\n"
    )
    user = {
        "exec": {
            "apiVersion": "client.authentication.k8s.io/v1",
            "command": sys.executable,
            "args": [str(plugin)],
            "env": [{"name": "PREFIX", "value": "plugin"}],
        }
    }
    found = from_kubeconfig([kubeconfig(tmp_path / "config", user, {"server": "https://s"})])
    assert found.token == "plugin-issued"


@pytest.mark.parametrize(
    ("change", "words"),
    [
        ({"current": "nope"}, "current-context 'nope'"),
        ({"cluster": {}}, "cluster.server"),
    ],
)
def test_unusable_kubeconfigs_are_refused_naming_the_field(
    tmp_path: Path, change: dict[str, Any], words: str
) -> None:
    path = kubeconfig(
        tmp_path / "config",
        {"token": "t"},
        change.get("cluster", {"server": "https://s"}),
        current=change.get("current", "ctx"),
    )
    with pytest.raises(CredentialsError, match=words):
        from_kubeconfig([path])
    with pytest.raises(CredentialsError, match="current-context"):
        from_kubeconfig([tmp_path / "absent"])


def test_the_service_account_is_used_only_inside_a_pod(tmp_path: Path) -> None:
    (tmp_path / "token").write_text("sa-token\n")
    assert from_service_account({}, tmp_path) is None, "no service host: not in a pod"
    found = from_service_account(
        {"KUBERNETES_SERVICE_HOST": "fd00::1", "KUBERNETES_SERVICE_PORT": "443"}, tmp_path
    )
    assert found is not None
    assert (found.server, found.token, found.ca_file) == (
        "https://[fd00::1]:443",
        "sa-token",
        str(tmp_path / "ca.crt"),
    )
    assert found.verify


def test_an_exec_plugins_token_is_issued_again_when_it_expires_and_after_a_401(tmp_path: Path) -> None:
    plugin = tmp_path / "plugin.py"
    runs = tmp_path / "runs"
    plugin.write_text(
        "import json, pathlib\n"
        f"runs = pathlib.Path({str(runs)!r})\n"
        "n = len(runs.read_text()) if runs.exists() else 0\n"
        "runs.write_text('x' * (n + 1))\n"
        "status = {'token': f'issued-{n}', 'expirationTimestamp': '2030-01-01T00:10:00Z'}\n"
        "print(json.dumps({'kind': 'ExecCredential', 'status': status}))\n"
    )
    user = {
        "exec": {
            "apiVersion": "client.authentication.k8s.io/v1",
            "command": sys.executable,
            "args": [str(plugin)],
        }
    }
    found = from_kubeconfig([kubeconfig(tmp_path / "config", user, {"server": "https://s"})])
    expiry = datetime(2030, 1, 1, 0, 10, tzinfo=UTC).timestamp()
    assert (found.token, found.expires_at) == ("issued-0", expiry)
    now = [expiry - 60]
    source = TokenSource(found, wall_clock=lambda: now[0])
    assert not source.due() and source.token() == "issued-0", "not yet within a minute of its expiry"
    now[0] = expiry - 10
    assert source.token() == "issued-1", "issued again shortly before it expires"
    assert source.renew("issued-0") == "issued-1", "a 401 of a token already replaced runs nothing"
    assert source.renew("issued-1") == "issued-2", "a 401 of the current token runs the plugin again"


def test_a_token_file_is_read_again_after_a_minute_or_a_401_and_a_static_token_never(tmp_path: Path) -> None:
    (tmp_path / "token").write_text("first\n")
    found = from_service_account({"KUBERNETES_SERVICE_HOST": "h", "KUBERNETES_SERVICE_PORT": "1"}, tmp_path)
    assert found is not None and found.token_file == str(tmp_path / "token")
    clock = [0.0]
    source = TokenSource(found, clock=lambda: clock[0])
    (tmp_path / "token").write_text("second\n")
    clock[0] = 59
    assert source.token() == "first"
    clock[0] = 60
    assert source.token() == "second"
    (tmp_path / "token").write_text("third\n")
    assert source.renew("second") == "third"
    (tmp_path / "token").unlink()  # mid-rotation
    assert source.renew("third") == "third"
    static = TokenSource(
        from_kubeconfig([kubeconfig(tmp_path / "config", {"token": "t"}, {"server": "https://s"})])
    )
    assert not static.renewable and static.renew("t") == "t"
