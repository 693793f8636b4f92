"""`make cluster-up`: a local control plane with GPU nodes for people; it keeps running after this exits.

Writes .cluster/kubeconfig and .cluster/state.json (pids, temp dir); `make cluster-down` stops it.
"""

from __future__ import annotations

import json
import shutil
import sys
import time
from pathlib import Path

from tests.cluster.control_plane import ControlPlane, ProcessRecord, dump_state

STATE_DIR = Path(__file__).resolve().parents[2] / ".cluster"
STATE_FILE = STATE_DIR / "state.json"
KUBECONFIG = STATE_DIR / "kubeconfig"


def main() -> int:
    if STATE_FILE.exists():
        state = json.loads(STATE_FILE.read_text())
        if any(ProcessRecord(**rec).alive() for rec in state["processes"]):
            print(
                f"already running at {state['server']}; export KUBECONFIG={KUBECONFIG} (make cluster-down stops it)"
            )
            return 0
    t0 = time.monotonic()
    cp = ControlPlane(die_with_parent=False, name="iwg-local").start()
    try:
        cp.start_scheduler()
        cp.start_controller_manager()
        nodes = cp.start_gpu_nodes()
    except BaseException:
        cp.stop()
        raise
    STATE_DIR.mkdir(exist_ok=True)
    shutil.copyfile(cp.kubeconfig, KUBECONFIG)
    KUBECONFIG.chmod(0o600)
    dump_state(cp.detach(), STATE_FILE)
    print(
        f"control plane up in {time.monotonic() - t0:.1f}s at {cp.server} with GPU nodes {', '.join(nodes)}"
    )
    print(f"  export KUBECONFIG={KUBECONFIG}")
    print(f"  logs: {cp.workdir}/*.log    stop: make cluster-down")
    return 0


if __name__ == "__main__":
    sys.exit(main())
