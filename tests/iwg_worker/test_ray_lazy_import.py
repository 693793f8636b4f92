"""Ray is an optional extra: nothing but `iwg_worker.executor.ray` and its actor module may import it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

PROBE = """
import importlib, pkgutil, sys
import iwg_worker, iwg_operator
skip = {"iwg_worker.executor.ray", "iwg_worker.executor.ray_actor"}
for package in (iwg_worker, iwg_operator):
    for info in pkgutil.walk_packages(package.__path__, package.__name__ + "."):
        if info.name not in skip:
            importlib.import_module(info.name)
imported = sorted(m for m in sys.modules if m == "ray" or m.startswith("ray."))
print("IMPORTED", len(imported), imported[:5])
"""


def test_no_module_but_the_ray_executor_imports_ray() -> None:
    paths = [str(REPO / "worker_image"), str(REPO / "operator")]
    done = subprocess.run(
        [sys.executable, "-c", PROBE],
        capture_output=True,
        text=True,
        timeout=300,
        env={"PYTHONPATH": ":".join(paths), "PATH": "/usr/bin:/bin", "HF_HUB_OFFLINE": "1"},
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "IMPORTED 0 []" in done.stdout, done.stdout
