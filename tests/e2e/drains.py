"""`kubectl drain` of each node in turn under load, seen as a client in the cluster sees it (the real nodes'
tests: tests/realnodes/test_day2.py, tests/realnodes/test_drain_sharded.py)."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

from iwg_operator.labels import REPLICA
from kubernetes import client

from tests.e2e.harness import Load, driver_pods, pod_ready, worker_pods

# A drain evicts one replica, waits for its new pods to load and be Ready (the budget allows no more), then
# evicts the other. Under the whole suite's load a worldSize-3 SmolLM2 replica took 80 s to load on the other
# node, and kubectl's drain of the second node ran past 150 s (CI of 4d94f6e); without the integer minAvailable
# no drain ever finishes, whatever the timeout.
DRAIN_TIMEOUT_S = 300
SETTLE_S = 2.0  # load kept on the group before each drain and after the group serves again


class ReadySampler:
    """Counts, every 0.2 s until stopped, the worker replicas whose every rank is Ready and not terminating:
    the fewest seen."""

    def __init__(self, core: client.CoreV1Api, namespace: str, name: str, world_size: int) -> None:
        self.core, self.namespace, self.name, self.world_size = core, namespace, name, world_size
        self.fewest: int | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(0.2):
            ranks = Counter(
                p.metadata.labels[REPLICA]
                for p in worker_pods(self.core, self.namespace, self.name)
                if p.metadata.deletion_timestamp is None and pod_ready(p)
            )
            whole = sum(1 for count in ranks.values() if count == self.world_size)
            self.fewest = whole if self.fewest is None else min(self.fewest, whole)

    def __enter__(self) -> ReadySampler:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join(timeout=10)


def load_seconds(serving_timeout: float) -> float:
    """How long a drain test's load may run before it stops by itself: past both drains at their slowest (in
    CI the first drain of the worldSize-3 group outlasted the load's default 300 s, and the second drain then
    counted no answer)."""
    return 2 * (SETTLE_S * 2 + DRAIN_TIMEOUT_S + 30 + serving_timeout) + 60


def drain_each_node(
    nodes: list[str],
    control_plane: Any,
    core: client.CoreV1Api,
    workspace: str,
    name: str,
    load: Load,
    serving_again: Callable[[], object],
    diagnose: Callable[[], str],
    world_size: int = 1,
) -> list[dict[str, Any]]:
    """`kubectl drain` of each of the two `nodes` in turn while `load` runs (stopped here), each uncordoned
    once `serving_again` returns (the group serves again on the other node): what each drain did (rc, pods
    evicted, time, nodes after, requests answered and failed during it, the fewest whole replicas Ready).
    On failure the message ends with what `diagnose` says."""
    drains: list[dict[str, Any]] = []
    try:
        for node, other in zip(nodes, reversed(nodes), strict=True):
            time.sleep(SETTLE_S)
            # A load that ended by itself (its max_seconds) would count no answer and no failure: say so.
            assert load.running(), f"the load ended before the drain of {node}: max_seconds too short"
            drain: dict[str, Any] = {"node": node, "failed": len(load.failures), "answered": load.ok}
            started = time.monotonic()
            with ReadySampler(core, workspace, name, world_size) as sampler:
                try:
                    done = control_plane.kubectl(
                        "drain", node, "--ignore-daemonsets", "--delete-emptydir-data",
                        f"--timeout={DRAIN_TIMEOUT_S}s", check=False, timeout=DRAIN_TIMEOUT_S + 30,
                    )  # fmt: skip
                    output, drain["rc"] = done.stdout + done.stderr, done.returncode
                except subprocess.TimeoutExpired as error:  # kubectl did not keep its own --timeout
                    output, drain["rc"] = str(error.stderr or ""), None
                drain["took"] = time.monotonic() - started
                # Counted in the whole output: each refusal by the budget adds a "will retry" line, and the
                # tail kept for the message can lose the first evictions (it did once: 2 of 4 counted).
                drain["evicted"] = output.count(" evicted")
                drain["output"] = output[-2000:]
                assert drain["rc"] == 0, drain
                serving_again()
            drain["fewest_ready"] = sampler.fewest
            pods = [*worker_pods(core, workspace, name), *driver_pods(core, workspace, name)]
            drain["nodes"] = sorted({p.spec.node_name for p in pods if p.metadata.deletion_timestamp is None})
            drain["serving_after"] = time.monotonic() - started
            time.sleep(SETTLE_S)
            control_plane.kubectl("uncordon", node)
            drain["failed"] = len(load.failures) - drain["failed"]
            drain["answered"] = load.ok - drain["answered"]
            drains.append(drain)
            assert drain["nodes"] == [other], drain
    except Exception as error:  # an API error or timeout too: what the operator and the workers said
        raise AssertionError(f"{error}\n{diagnose()}") from None
    finally:
        load.stop()
        for node in nodes:
            control_plane.kubectl("uncordon", node, check=False)
    for drain in drains:
        print(
            f"{name}: drain of {drain['node']}: {drain['evicted']} pods evicted, kubectl done in "
            f"{drain['took']:.1f} s, serving on {drain['nodes']} after {drain['serving_after']:.1f} s; "
            f"{drain['answered']} answered, {drain['failed']} failed; fewest whole replicas Ready "
            f"{drain['fewest_ready']}",
            file=sys.__stderr__,  # the operator's KopfRunner holds sys.stdout and sys.stderr while it runs
        )
    return drains
