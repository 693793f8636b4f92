"""`make cluster-down`: stops what `make cluster-up` started (by the pids it recorded) and removes its files."""

from __future__ import annotations

import json
import sys

from tests.cluster.control_plane import stop_detached
from tests.cluster.up import KUBECONFIG, STATE_FILE


def main() -> int:
    if not STATE_FILE.exists():
        print("no local control plane recorded (.cluster/state.json); nothing to stop")
        return 0
    state = json.loads(STATE_FILE.read_text())
    stop_detached(state)
    STATE_FILE.unlink()
    KUBECONFIG.unlink(missing_ok=True)
    print(f"stopped {len(state['processes'])} processes and removed {state['workdir']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
