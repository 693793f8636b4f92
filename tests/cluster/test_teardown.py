"""A private control plane: it survives a port taken under its feet, and stopping it leaves no
process and no file behind (one control plane for both, since each start costs seconds)."""

from __future__ import annotations

import socket

import psutil
import pytest

from tests.cluster import control_plane as module
from tests.cluster.control_plane import KEEP_FILES_ENV, ControlPlane

pytestmark = pytest.mark.cluster


def test_private_control_plane_retries_a_taken_port_and_stop_leaves_nothing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv(KEEP_FILES_ENV, raising=False)
    spawned: list[int] = []
    real_spawn = ControlPlane._spawn

    def recording_spawn(self: ControlPlane, name: str, args: list[str]) -> int:
        pid = real_spawn(self, name, args)
        spawned.append(pid)
        return pid

    monkeypatch.setattr(ControlPlane, "_spawn", recording_spawn)

    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", 0))
        squatter.listen()
        picks = iter([squatter.getsockname()[1]])
        real_free_port = module.free_port
        # The first port handed out (etcd's client port) already belongs to someone else.
        monkeypatch.setattr(module, "free_port", lambda: next(picks, None) or real_free_port())
        cp = ControlPlane(name="iwg-private").start()

    try:
        cp.start_scheduler()
        workdir = cp.workdir
        assert len(spawned) == 4, "etcd should have been started twice: once on the taken port"
        assert [p.name for p in cp.processes] == ["etcd", "kube-apiserver", "kube-scheduler"]
        assert {psutil.Process(p.pid).name() for p in cp.processes} == {
            "etcd",
            "kube-apiserver",
            "kube-scheduler",
        }
        assert cp.kubectl("get", "--raw", "/readyz").stdout == "ok"
        assert (workdir / "kubeconfig").is_file()
    finally:
        cp.stop()

    survivors = [
        pid
        for pid in spawned
        if psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    ]
    assert survivors == []
    assert not workdir.exists()
