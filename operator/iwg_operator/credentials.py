"""Where the API server is and how to authenticate: the pod's service account, else a kubeconfig.

Read without the official `kubernetes` client: importing it costs the operator about 40 MB of memory (its
generated models), and Kopf imports those models whenever the package is importable (iwg_operator.main keeps
it out). Supported: in-cluster service accounts; kubeconfig clusters with a CA file or data (or
insecure-skip-tls-verify) and users with a token, token file, client certificate or an exec plugin.

Tokens expire: a projected service-account token is rotated by the kubelet (and stops being accepted an hour
or so later), an exec plugin's token lasts what its issuer says. `TokenSource` keeps the operator's own client
current the way client-go does: the token file is read again every `TOKEN_FILE_REREAD_S`, an exec plugin is
run again once its credential expires, and both are renewed at once when the API server answers 401.
"""

from __future__ import annotations

import atexit
import base64
import contextlib
import json
import os
import shutil
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import yaml

SERVICE_ACCOUNT_DIR = Path("/var/run/secrets/kubernetes.io/serviceaccount")
DEFAULT_KUBECONFIG = "~/.kube/config"
# How old a token read from a file may get before it is read again: client-go's cachingTokenSource re-reads
# the projected service-account token every minute (the kubelet rotates it at 80% of its life).
TOKEN_FILE_REREAD_S = 60.0
# An exec plugin's credential is asked for again this long before its expirationTimestamp.
EXEC_EXPIRY_MARGIN_S = 30.0


class CredentialsError(Exception):
    """No usable credentials; the message names the kubeconfig field or file."""


@dataclass(frozen=True)
class Credentials:
    """Where the API server is and how to authenticate; shared by Kopf's watches and the operator's client."""

    server: str
    ca_file: str | None
    verify: bool
    token: str | None  # without the "Bearer " scheme
    cert_file: str | None
    key_file: str | None
    token_file: str | None = None  # where `token` was read from: read again while running (TokenSource)
    exec_plugin: Mapping[str, Any] | None = field(default=None, compare=False)  # users[].user.exec
    expires_at: float | None = None  # wall-clock time the exec plugin's credential expires, if it said

    @classmethod
    def from_environment(cls) -> Credentials:
        """In-cluster service account when running in a pod, else the kubeconfig (KUBECONFIG or ~/.kube)."""
        in_cluster = from_service_account(os.environ)
        if in_cluster is not None:
            return in_cluster
        paths = os.environ.get("KUBECONFIG") or DEFAULT_KUBECONFIG
        return from_kubeconfig([Path(p).expanduser() for p in paths.split(os.pathsep) if p])


def from_service_account(
    environ: Mapping[str, str], directory: Path = SERVICE_ACCOUNT_DIR
) -> Credentials | None:
    host, port = environ.get("KUBERNETES_SERVICE_HOST"), environ.get("KUBERNETES_SERVICE_PORT")
    token_file = directory / "token"
    if not host or not port or not token_file.exists():
        return None
    host = f"[{host}]" if ":" in host else host  # IPv6
    return Credentials(
        server=f"https://{host}:{port}",
        ca_file=str(directory / "ca.crt"),
        verify=True,
        token=token_file.read_text().strip(),
        cert_file=None,
        key_file=None,
        token_file=str(token_file),
    )


def from_kubeconfig(paths: list[Path]) -> Credentials:
    """The current context of the merged kubeconfig files (the first file to set a name wins)."""
    current: str | None = None
    sections: dict[str, dict[str, tuple[Path, dict[str, Any]]]] = {
        "contexts": {},
        "clusters": {},
        "users": {},
    }
    for path in paths:
        if not path.exists():
            continue
        loaded = yaml.safe_load(path.read_text()) or {}
        current = current or loaded.get("current-context")
        for section, named in sections.items():
            for item in loaded.get(section) or []:
                named.setdefault(item["name"], (path.parent, item.get(section[:-1]) or {}))
    if not current:
        raise CredentialsError(f"no current-context in kubeconfig {os.pathsep.join(map(str, paths))}")
    if current not in sections["contexts"]:
        raise CredentialsError(f"kubeconfig: current-context {current!r} is not among contexts")
    _, context = sections["contexts"][current]
    cluster_dir, cluster = _named(sections["clusters"], context.get("cluster"), "cluster")
    user_dir, user = _named(sections["users"], context.get("user"), "user")
    if not cluster.get("server"):
        raise CredentialsError(f"kubeconfig: clusters[{context['cluster']}].cluster.server is missing")

    token = user.get("token")
    token_file = None
    if not token and user.get("tokenFile"):
        token_file = str(_relative(user_dir, user["tokenFile"]))
        token = Path(token_file).read_text().strip()
    cert_file = _file(user_dir, user, "client-certificate")
    key_file = _file(user_dir, user, "client-key")
    expires_at = None
    if "exec" in user:
        issued = _exec_credential(user["exec"])
        token = issued.get("token") or token
        expires_at = _expiry(issued)
        if issued.get("clientCertificateData"):
            cert_file = _write_private(issued["clientCertificateData"].encode())
            key_file = _write_private(issued["clientKeyData"].encode())
    return Credentials(
        server=str(cluster["server"]).rstrip("/"),
        ca_file=_file(cluster_dir, cluster, "certificate-authority"),
        verify=not cluster.get("insecure-skip-tls-verify", False),
        token=token or None,
        cert_file=cert_file,
        key_file=key_file,
        token_file=token_file,
        exec_plugin=user.get("exec"),
        expires_at=expires_at,
    )


class TokenSource:
    """The bearer token of one set of credentials, kept current while the process runs (as client-go does).

    A token read from a file (the projected service-account token, a kubeconfig's tokenFile) is read again
    once it is `reread_s` old; one from an exec plugin is asked for again `EXEC_EXPIRY_MARGIN_S` before the
    expirationTimestamp the plugin gave. `renew()` does either at once: the caller saw a 401. A static token
    (kubeconfig `token`) never changes. Thread-safe: the exec plugin runs in a worker thread.
    """

    def __init__(
        self,
        credentials: Credentials,
        reread_s: float = TOKEN_FILE_REREAD_S,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        self._credentials = credentials
        self._token = credentials.token
        self._expires_at = credentials.expires_at
        self._reread_s = reread_s
        self._clock = clock
        self._wall_clock = wall_clock
        self._read_at = clock()
        self._lock = threading.Lock()

    @property
    def renewable(self) -> bool:
        """Whether asking again can give another token (a file or a plugin, not a static token)."""
        return bool(self._credentials.token_file or self._credentials.exec_plugin)

    @property
    def current(self) -> str | None:
        """The token as last read, without looking whether it is due."""
        return self._token

    def token(self) -> str | None:
        """The current token; re-read or re-issued first when it is due (may run the exec plugin: call it
        from a worker thread when `due()`)."""
        with self._lock:
            if self.due():
                self._load()
            return self._token

    def renew(self, rejected: str | None) -> str | None:
        """After a 401 with `rejected`: read the file or run the plugin again, unless another request already
        replaced that token. Returns the token to retry with (unchanged when nothing newer exists)."""
        with self._lock:
            if self.renewable and self._token == rejected:
                self._load()
            return self._token

    def due(self) -> bool:
        """Whether the token should be read or issued again before the next request."""
        if self._credentials.exec_plugin is not None:
            expires = self._expires_at
            return expires is not None and self._wall_clock() >= expires - EXEC_EXPIRY_MARGIN_S
        if self._credentials.token_file is not None:
            return self._clock() - self._read_at >= self._reread_s
        return False

    def _load(self) -> None:
        self._read_at = self._clock()
        if self._credentials.exec_plugin is not None:
            issued = _exec_credential(self._credentials.exec_plugin)
            self._token = issued.get("token") or self._token
            self._expires_at = _expiry(issued)
        elif self._credentials.token_file is not None:
            # Unreadable mid-rotation (the kubelet swaps a symlink): keep the last token, read again next time.
            with contextlib.suppress(OSError):
                self._token = Path(self._credentials.token_file).read_text().strip() or self._token


def _expiry(status: Mapping[str, Any]) -> float | None:
    """An ExecCredential status's expirationTimestamp (RFC 3339) as a wall-clock time."""
    stamp = status.get("expirationTimestamp")
    if not stamp:
        return None
    try:
        return datetime.fromisoformat(str(stamp).replace("Z", "+00:00")).timestamp()
    except ValueError:
        return None


def _named(
    named: dict[str, tuple[Path, dict[str, Any]]], name: str | None, kind: str
) -> tuple[Path, dict[str, Any]]:
    if name not in named:
        raise CredentialsError(f"kubeconfig: the current context's {kind} {name!r} is not among {kind}s")
    return named[name]


def _relative(directory: Path, value: str) -> Path:
    path = Path(value).expanduser()
    return path if path.is_absolute() else directory / path


def _file(directory: Path, section: Mapping[str, Any], key: str) -> str | None:
    """`<key>` (a path, relative to the kubeconfig) or `<key>-data` (base64, written to a private file)."""
    if section.get(f"{key}-data"):
        return _write_private(base64.b64decode(section[f"{key}-data"]))
    if section.get(key):
        return str(_relative(directory, section[key]))
    return None


def _exec_credential(plugin: Mapping[str, Any]) -> dict[str, Any]:
    """Run a client-go credential plugin (users[].user.exec) and return its ExecCredential status."""
    command = [plugin["command"], *(plugin.get("args") or [])]
    env = {**os.environ, **{item["name"]: item["value"] for item in plugin.get("env") or []}}
    env["KUBERNETES_EXEC_INFO"] = json.dumps(
        {"apiVersion": plugin.get("apiVersion"), "kind": "ExecCredential", "spec": {"interactive": False}}
    )
    try:
        output = subprocess.run(command, env=env, capture_output=True, text=True, check=True, timeout=60)
    except (OSError, subprocess.SubprocessError) as error:
        raise CredentialsError(f"kubeconfig: users[].user.exec {command[0]!r} failed: {error}") from error
    status: dict[str, Any] = json.loads(output.stdout).get("status") or {}
    return status


_private_dir: str | None = None


def _write_private(data: bytes) -> str:
    """A file only this user can read (ssl wants files), removed when the process exits."""
    global _private_dir
    if _private_dir is None:
        _private_dir = tempfile.mkdtemp(prefix="iwg-credentials-")
        atexit.register(shutil.rmtree, _private_dir, True)
    handle, name = tempfile.mkstemp(dir=_private_dir)
    with os.fdopen(handle, "wb") as out:
        out.write(data)
    return name
