"""Stopping a control plane leaves no process and no file behind."""

from __future__ import annotations

import psutil
import pytest

from tests.cluster.control_plane import ControlPlane

pytestmark = pytest.mark.cluster


def test_stop_kills_every_process_and_removes_its_files() -> None:
    cp = ControlPlane(name="iwg-private").start()
    try:
        cp.start_scheduler()
        pids = cp.pids
        workdir = cp.workdir
        names = {psutil.Process(pid).name() for pid in pids}
        assert names == {"etcd", "kube-apiserver", "kube-scheduler"}
        assert (workdir / "kubeconfig").is_file()
    finally:
        cp.stop()

    survivors = [
        pid for pid in pids if psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    ]
    assert survivors == []
    assert not workdir.exists()


def test_a_port_taken_before_bind_is_retried_on_another(monkeypatch: pytest.MonkeyPatch) -> None:
    import socket

    from tests.cluster import control_plane as module

    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", 0))
        squatter.listen()
        taken = squatter.getsockname()[1]
        picks = iter([taken])
        real_free_port = module.free_port
        # The first port handed out (etcd's client port) is already someone else's.
        monkeypatch.setattr(module, "free_port", lambda: next(picks, None) or real_free_port())

        cp = ControlPlane(name="iwg-retry").start()
        try:
            assert [p.name for p in cp.processes] == ["etcd", "kube-apiserver"]
            assert all(p.alive() for p in cp.processes)
            assert cp.kubectl("get", "--raw", "/readyz").stdout == "ok"
        finally:
            cp.stop()
