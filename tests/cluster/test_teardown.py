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
