"""vLLM's CPU worker for one rank of a sharded replica (``world_size > 1`` on CPU), given to vLLM through its
``worker_cls`` option.

vLLM's CPU backend all-reduces through a shared-memory segment named after ``VLLM_DIST_IDENT``, which its CPU
worker derives from the distributed init method: ``env://`` for every ``external_launcher`` rank, so every
replica's ranks name the same segments. That assumes the ranks share one host's ``/dev/shm``. iwg's ranks are
pods, each with its own ``/dev/shm`` (possibly on other nodes); and on one machine two replicas, or a replica
restarted after a SIGKILL left its segments behind, would collide on the name (EEXIST, seen here). Giving each
rank's process a name of its own makes vLLM see that the ranks do not share the segment, and it all-reduces
through torch.distributed (gloo) instead, which works across pods and nodes. The process group itself is the
one the worker set up before (the init method is not used to make it).
"""

from __future__ import annotations

import os
import socket

from vllm.v1.worker.cpu_worker import CPUWorker


class ReplicaRankCPUWorker(CPUWorker):
    def init_device(self) -> None:
        self.distributed_init_method = f"env://iwg-{socket.gethostname()}-{os.getpid()}"
        super().init_device()  # type: ignore[no-untyped-call]  # vLLM leaves it untyped
