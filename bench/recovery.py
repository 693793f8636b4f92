"""Recovery from worker faults: detection and recovery times and failed requests, per fault.

    python -m bench.recovery [--clients 2]      (root: the node agent makes network namespaces)

The whole local stack (tests/e2e/stack.py: real control plane, the operator as its own process, the node
agent running pods as real processes, real MiniLM workers and driver). Clients send embedding requests
through the driver for the whole run. Faults, one at a time, each on a group serving in full:

- SIGKILL of a worker (restartPolicy Pod): the process dies; the kubelet and the prober see it.
- SIGSTOP of a worker: a hang the process check cannot see; only the deep health check times out.

(A replica of several ranks holds its model sharded, which MiniLM's architecture does not allow: the rebuild of
a SmolLM2 replica of worldSize 3 after SIGKILL of rank 1 is timed by tests/e2e/test_selfheal.py.)

Per fault: detected = fault until the operator deleted the pod(s); serving again = fault until the
replacement is ready and the group reports every replica ready; failed requests during the episode. The
baseline measured in the same run is a worker's cold start (group created until its first replica is ready):
recovery can hardly be faster than that, and `ratio` compares the two. The bound for a hang is
periodSeconds x failureThreshold + timeoutSeconds.
"""

from __future__ import annotations

import argparse
import signal
import sys
import time
from dataclasses import dataclass

import yaml

from tests.e2e.harness import (
    Load,
    await_replacement,
    group_manifest,
    live_ready_workers,
    signal_worker,
    wait_serving,
)
from tests.e2e.stack import LocalStack

PERIOD, THRESHOLD, TIMEOUT = 2, 2, 1
HEALTH = {
    "periodSeconds": PERIOD,
    "timeoutSeconds": TIMEOUT,
    "failureThreshold": THRESHOLD,
    "backoffSeconds": 0,
}
MODEL = "all-MiniLM-L6-v2"


@dataclass
class Row:
    fault: str
    detected_s: float
    ready_s: float
    ok: int
    failed: int


def start_group(stack: LocalStack, name: str, **spec: object) -> tuple[str, float]:
    assert stack.control_plane is not None and stack.agent is not None
    started = time.monotonic()
    manifest = group_manifest(name, **spec)
    stack.control_plane.kubectl("apply", "-n", stack.namespace, "-f", "-", input=yaml.safe_dump(manifest))
    address = wait_serving(
        stack.groups, stack.core, stack.agent, name, int(manifest["spec"]["replicas"]), 300
    )
    cold = time.monotonic() - started
    time.sleep(PERIOD * 2)  # every worker answered the prober once: supervised
    return address, cold


def episode(
    stack: LocalStack,
    name: str,
    address: str,
    replicas: int,
    fault: signal.Signals,
    label: str,
    clients: int,
    rank: int,
) -> Row:
    core, groups = stack.core, stack.groups
    load = Load(address, MODEL, clients=clients).start()
    time.sleep(2)
    workers = live_ready_workers(core, stack.namespace, name)
    replica0 = [p for p in workers if p.metadata.labels["inference.iwg.dev/replica"] == "0"]
    victim = next(p for p in replica0 if p.metadata.labels["inference.iwg.dev/rank"] == str(rank))
    victims = replica0 if len(replica0) > 1 else [victim]
    started = time.monotonic()
    signal_worker(victim, fault)
    recovery = await_replacement(core, groups, name, victims, started, replicas)
    time.sleep(2)
    load.stop()
    return Row(label, recovery.detected_s, recovery.ready_s, load.ok, len(load.failures))


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--clients", type=int, default=2)
    args = parser.parse_args()
    rows: list[Row] = []
    colds: list[float] = []
    with LocalStack(namespace="bench", log=lambda line: print(line, file=sys.stderr)) as stack:
        address, cold = start_group(stack, "single", replicas=2, health={**HEALTH, "restartPolicy": "Pod"})
        colds.append(cold)
        for fault, label in ((signal.SIGKILL, "SIGKILL worker"), (signal.SIGSTOP, "SIGSTOP worker (hang)")):
            rows.append(episode(stack, "single", address, 2, fault, label, args.clients, rank=0))
            print(f"{label}: done", file=sys.stderr)

    baseline = min(colds)
    print(
        f"\nhealth: periodSeconds={PERIOD} failureThreshold={THRESHOLD} timeoutSeconds={TIMEOUT}; "
        f"hang bound {PERIOD * THRESHOLD + TIMEOUT} s; {args.clients} clients throughout"
    )
    print(
        f"baseline: cold start of a group until its replicas serve: {baseline:.1f} s (min of {len(colds)})\n"
    )
    print(f"| {'fault':<30} | detected s | serving again s | vs cold start | requests ok | failed |")
    print(f"|{'-' * 32}|-----------:|----------------:|--------------:|------------:|-------:|")
    for row in rows:
        print(
            f"| {row.fault:<30} | {row.detected_s:10.2f} | {row.ready_s:15.2f} | {row.ready_s / baseline:12.2f}x "
            f"| {row.ok:11d} | {row.failed:6d} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
