"""The ranks' rendezvous, fenced by the replica's epoch, in real processes over real torch.distributed (gloo on
loopback): a rank process of an earlier creation of the replica — its old pod's container restarted on a node cut
off from the API server, a process resumed after SIGSTOP — meets the new ranks' rank 0 (same address: the pod
name is reused) and must not take the place of the rank that replaced it, nor ever join its collective."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import pytest
from iwg_operator.api import wiring

pytestmark = pytest.mark.timeout(300)

# One rank: init the process group from the environment as a worker does, all-reduce its incarnation (so the sum
# says who was in the group), print it, and leave as a worker does (os._exit: the interpreter's teardown of a
# gloo group whose peer already left aborted now and then, "terminate called without an active exception").
RANK = """
import os, sys, torch, torch.distributed as dist
from iwg_worker import distributed
distributed.init_distributed(distributed.Rendezvous.from_env(), torch.device("cpu"), float(sys.argv[1]))
value = torch.tensor([int(sys.argv[2])], dtype=torch.int64)
dist.all_reduce(value)
print("sum", int(value.item()), flush=True)
os._exit(0)
"""

STALE_TIMEOUT_S = 20.0  # the stale rank's own rendezvous timeout: it gives up alone
JOIN_TIMEOUT_S = 120.0  # the current ranks'


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_rank(port: int, rank: int, epoch: int, incarnation: int, timeout_s: float) -> subprocess.Popen[str]:
    env = {
        **os.environ,
        wiring.MASTER_ADDR: "127.0.0.1",
        wiring.MASTER_PORT: str(port),
        wiring.TORCH_RANK: str(rank),
        wiring.TORCH_WORLD_SIZE: "2",
        wiring.REPLICA_EPOCH: str(epoch),
        "GLOO_SOCKET_IFNAME": "lo",
        "OMP_NUM_THREADS": "1",
    }
    return subprocess.Popen(
        [sys.executable, "-c", RANK, str(timeout_s), str(incarnation)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def finish(process: subprocess.Popen[str], timeout: float) -> tuple[int, str, str]:
    out, err = process.communicate(timeout=timeout)
    return process.returncode, out, err


def test_a_rank_of_an_earlier_replica_creation_never_joins_the_new_ranks() -> None:
    """The new replica (epoch 2) has its rank 0 up; the old rank 1 (epoch 1) comes back first and connects to it.
    Nothing forms with it, however long it waits; the new rank 1 then arrives and the group is rank 0 and the new
    rank 1 (the sum of their incarnations); the old one gives up alone. With the epoch removed (every rank's 0,
    the store's keys unprefixed), the old rank 1 and the new rank 0 made the group at once."""
    port = free_port()
    old_epoch, new_epoch = 1_000, 2_000
    rank0 = start_rank(port, 0, new_epoch, incarnation=200, timeout_s=JOIN_TIMEOUT_S)
    stale = start_rank(port, 1, old_epoch, incarnation=101, timeout_s=STALE_TIMEOUT_S)
    processes = [rank0, stale]
    try:
        # Long enough for two processes that import torch and meet: unfenced, they made a group in about 3 s
        # alone and 8 s beside the suite's lanes.
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            assert rank0.poll() is None and stale.poll() is None, "a rank ended: " + str(
                [finish(p, 5) for p in processes if p.poll() is not None]
            )
            time.sleep(0.5)
        # The old process is stopped a while and resumed (SIGSTOP, SIGCONT): still nothing.
        stale.send_signal(signal.SIGSTOP)
        fresh = start_rank(port, 1, new_epoch, incarnation=201, timeout_s=JOIN_TIMEOUT_S)
        processes.append(fresh)
        time.sleep(1)
        stale.send_signal(signal.SIGCONT)
        code, out, err = finish(rank0, JOIN_TIMEOUT_S + 30)
        assert code == 0 and "sum 401" in out, (out, err[-2000:])  # rank 0 and the new rank 1
        code, out, err = finish(fresh, 30)
        assert code == 0 and "sum 401" in out, (out, err[-2000:])
        code, out, err = finish(stale, STALE_TIMEOUT_S + 60)
        assert code != 0 and "sum" not in out, (out, err[-2000:])  # it gave up, alone
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
                process.wait()
