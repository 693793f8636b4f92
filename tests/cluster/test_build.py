"""tests/cluster/build.sh: one cache key per binary, and binaries of the earlier all-pins cache taken over."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.cluster import binaries

HERE = Path(__file__).resolve().parent


def _copy_of_the_script(tmp_path: Path) -> Path:
    """build.sh with its pins and tools modules, in a directory the test may edit."""
    tree = tmp_path / "cluster"
    tree.mkdir()
    shutil.copy2(HERE / "build.sh", tree / "build.sh")
    shutil.copy2(HERE / "versions.env", tree / "versions.env")
    shutil.copytree(HERE / "tools", tree / "tools")
    return tree


def _run(tree: Path, *args: str, cache: Path, check: bool = True) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "IWG_CACHE_DIR": str(cache)}
    return subprocess.run(
        ["bash", str(tree / "build.sh"), *args],
        capture_output=True,
        text=True,
        env=env,
        check=check,
        timeout=120,
    )


def _keys(tree: Path, cache: Path) -> dict[str, str]:
    lines = _run(tree, "--print-keys", cache=cache).stdout.splitlines()
    return dict(line.split() for line in lines)


def _edit(path: Path, old: str, new: str) -> None:
    text = path.read_text()
    assert old in text, (path, old)
    path.write_text(text.replace(old, new))


def test_changing_a_pin_changes_the_keys_of_the_binaries_that_use_it_only(tmp_path: Path) -> None:
    tree = _copy_of_the_script(tmp_path)
    cache = tmp_path / "cache"
    before = _keys(tree, cache)
    assert set(before) == {*binaries.BUILT}
    directory = _run(tree, "--print-dir", cache=cache).stdout.strip()

    def changed() -> set[str]:
        now = _keys(tree, cache)
        return {name for name in before if now[name] != before[name]}

    helm = binaries.pin("HELM_VERSION", tree / "versions.env")
    _edit(tree / "versions.env", f"HELM_VERSION={helm}", "HELM_VERSION=v3.21.3")
    assert changed() == {"helm"}
    assert _run(tree, "--print-dir", cache=cache).stdout.strip() != directory
    _edit(tree / "versions.env", "HELM_VERSION=v3.21.3", f"HELM_VERSION={helm}")
    assert changed() == set()

    _edit(tree / "tools" / "etcd" / "main.go", "package main", "package main\n\n// edited")
    assert changed() == {"etcd"}
    _edit(
        tree / "versions.env",
        f"KUBE_SCORE_VERSION={binaries.pin('KUBE_SCORE_VERSION', tree / 'versions.env')}",
        "KUBE_SCORE_VERSION=v1.19.0",
    )
    assert changed() == {"etcd", "kube-score"}
    # helm's default Kubernetes version is the pinned cluster's, so it follows that pin too.
    kubernetes = binaries.pin("KUBERNETES_VERSION", tree / "versions.env")
    _edit(tree / "versions.env", f"KUBERNETES_VERSION={kubernetes}", "KUBERNETES_VERSION=v1.36.3")
    assert changed() == {
        "etcd", "kube-score", "kube-apiserver", "kube-scheduler", "kube-controller-manager", "kubelet",
        "kube-proxy", "helm"
    }  # fmt: skip


@pytest.mark.cluster
def test_a_binary_of_the_all_pins_cache_is_taken_over_when_its_build_info_matches(tmp_path: Path) -> None:
    built_etcd = binaries.binary("etcd")  # needs `make cluster-bins`
    tree = _copy_of_the_script(tmp_path)
    cache = tmp_path / "cache"
    old = cache / "bin-0123456789ab"  # as the cache before per-binary keys named its directory
    old.mkdir(parents=True)
    shutil.copy2(built_etcd, old / "etcd")
    shutil.copy2(built_etcd, old / "kube-apiserver")  # an etcd is no kube-apiserver

    assert _run(tree, "--find-earlier", "etcd", cache=cache).stdout.strip() == str(old / "etcd")
    assert _run(tree, "--find-earlier", "kube-apiserver", cache=cache, check=False).returncode == 1

    done = _run(tree, "etcd", cache=cache)
    assert f"etcd taken over from {old / 'etcd'}" in done.stdout
    assert "building" not in done.stdout
    linked = Path(_run(tree, "--print-dir", cache=cache).stdout.strip()) / "etcd"
    assert linked.resolve().read_bytes() == built_etcd.read_bytes()
    assert "etcd cached" in _run(tree, "etcd", cache=cache).stdout

    # A sum added to the tools module (another binary's dependency) gives etcd a new key; the binary of
    # the store entry under the old key still has all its sums there, so it is taken over, not rebuilt.
    go_sum = tree / "tools" / "etcd" / "go.sum"
    old_entry = linked.resolve()
    go_sum.write_text(go_sum.read_text() + "example.com/another v1.0.0 h1:AAAA=\n")
    shutil.rmtree(old)
    assert _run(tree, "--find-earlier", "etcd", cache=cache).stdout.strip() == str(old_entry)
    go_sum.write_text(go_sum.read_text().replace("example.com/another v1.0.0 h1:AAAA=\n", ""))

    # Another dependency sum in the tools module: not the recipe that built it, so not taken over.
    go_sum = tree / "tools" / "etcd" / "go.sum"
    line = next(
        line for line in go_sum.read_text().splitlines() if line.startswith("go.etcd.io/etcd/server/v3 ")
    )
    _edit(go_sum, line, line[:-5] + "AAAA=")
    assert _run(tree, "--find-earlier", "etcd", cache=cache, check=False).returncode == 1
