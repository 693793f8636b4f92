"""torch.distributed for a replica's ranks, and a tensor-parallel reference module.

Ranks rendezvous at ``MASTER_ADDR:MASTER_PORT`` (rank 0's address), gloo on CPU and nccl on CUDA. Pods of
the operator's carry a replica epoch (``IWG_REPLICA_EPOCH``: which creation of the replica they belong to); the
ranks then meet in rank 0's store under keys of that epoch only, so a rank process of an earlier creation that
comes back (a resumed SIGSTOP, a partitioned node) finds none of the new ranks' keys and they none of its: it can
take no one's place in the process group and times out alone.
`TensorParallelMLP` splits a two-layer MLP across ranks (first layer by output rows, second by input
columns, one all-reduce): the sharded result equals the unsharded one and each shard alone does not, which
the tests check. Models are sharded by transformers' own tensor-parallel loading (`iwg_worker.models.sharding`).
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from iwg_operator.api import wiring
from torch._C._distributed_c10d import PrefixStore, TCPStore


@dataclass(frozen=True, slots=True)
class Rendezvous:
    master_addr: str
    master_port: int
    rank: int
    world_size: int
    epoch: int = 0  # wiring.REPLICA_EPOCH (0: none, as under `iwg serve`: the store's keys unprefixed)

    @classmethod
    def from_env(cls, environ: dict[str, str] | None = None) -> Rendezvous:
        env = dict(os.environ if environ is None else environ)
        missing = [
            n for n in (wiring.MASTER_ADDR, wiring.TORCH_RANK, wiring.TORCH_WORLD_SIZE) if not env.get(n)
        ]
        if missing:
            raise ValueError(f"torch.distributed needs environment variables {missing}")
        return cls(
            master_addr=env[wiring.MASTER_ADDR],
            master_port=int(env.get(wiring.MASTER_PORT) or wiring.DEFAULT_MASTER_PORT),
            rank=int(env[wiring.TORCH_RANK]),
            world_size=int(env[wiring.TORCH_WORLD_SIZE]),
            epoch=int(env.get(wiring.REPLICA_EPOCH) or 0),
        )


def cuda_index(environ: dict[str, str] | None = None, device_count: int | None = None) -> int:
    """The CUDA device of this process: ``LOCAL_RANK`` (0 when unset), which must name a visible GPU."""
    env = os.environ if environ is None else environ
    count = torch.cuda.device_count() if device_count is None else device_count
    raw = env.get(wiring.LOCAL_RANK) or "0"
    try:
        index = int(raw)
    except ValueError:
        raise ValueError(f"{wiring.LOCAL_RANK} must be an integer, got {raw!r}") from None
    if not 0 <= index < count:
        raise ValueError(f"{wiring.LOCAL_RANK}={index} names no GPU: this process sees {count}")
    return index


def backend_for(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def init_distributed(rendezvous: Rendezvous, device: torch.device, timeout_s: float = 120.0) -> str:
    """Join the replica's process group (idempotent); returns the backend used."""
    if dist.is_initialized():
        return str(dist.get_backend())
    backend = backend_for(device)
    timeout = datetime.timedelta(seconds=timeout_s)
    if not rendezvous.epoch:
        dist.init_process_group(
            backend=backend,
            init_method=f"tcp://{rendezvous.master_addr}:{rendezvous.master_port}",
            rank=rendezvous.rank,
            world_size=rendezvous.world_size,
            timeout=timeout,
        )
        return backend
    # Rank 0 serves the store. It does not count connections (world_size None): a stale rank's connect must
    # not stand in for a current one; what makes the group is the keys, and every key is the epoch's.
    store = TCPStore(
        rendezvous.master_addr,
        rendezvous.master_port,
        None,
        is_master=rendezvous.rank == 0,
        timeout=timeout,
        wait_for_workers=False,
    )
    dist.init_process_group(
        backend=backend,
        store=PrefixStore(epoch_prefix(rendezvous.epoch), store),
        rank=rendezvous.rank,
        world_size=rendezvous.world_size,
        timeout=timeout,
    )
    return backend


def epoch_prefix(epoch: int) -> str:
    """The store keys of one creation of a replica."""
    return f"iwg/replica-epoch/{epoch}/"


def destroy_distributed() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


class TensorParallelMLP(torch.nn.Module):
    """``y = W2 relu(W1 x + b1) + b2`` with W1 split by rows and W2 by columns across ``world_size`` ranks."""

    def __init__(
        self,
        full_w1: torch.Tensor,
        full_b1: torch.Tensor,
        full_w2: torch.Tensor,
        full_b2: torch.Tensor,
        rank: int,
        world_size: int,
    ) -> None:
        super().__init__()
        hidden = full_w1.shape[0]
        if hidden % world_size:
            raise ValueError(f"hidden size {hidden} is not divisible by world_size {world_size}")
        shard = hidden // world_size
        rows = slice(rank * shard, (rank + 1) * shard)
        self.w1 = torch.nn.Parameter(full_w1[rows].clone(), requires_grad=False)
        self.b1 = torch.nn.Parameter(full_b1[rows].clone(), requires_grad=False)
        self.w2 = torch.nn.Parameter(full_w2[:, rows].clone(), requires_grad=False)
        self.b2 = torch.nn.Parameter(full_b2.clone(), requires_grad=False)
        self.world_size = world_size

    def forward(self, x: torch.Tensor, reduce: bool = True) -> torch.Tensor:
        """The whole MLP's output; with ``reduce=False``, this rank's shard alone (no all-reduce)."""
        partial = torch.relu(x @ self.w1.T + self.b1) @ self.w2.T
        if reduce and self.world_size > 1:
            dist.all_reduce(partial, op=dist.ReduceOp.SUM)
        return partial + self.b2


def reference_weights(seed: int, dim: int, hidden: int) -> tuple[torch.Tensor, ...]:
    generator = torch.Generator().manual_seed(seed)
    return (
        torch.randn(hidden, dim, generator=generator, dtype=torch.float64),
        torch.randn(hidden, generator=generator, dtype=torch.float64),
        torch.randn(dim, hidden, generator=generator, dtype=torch.float64),
        torch.randn(dim, generator=generator, dtype=torch.float64),
    )


def unsharded_reference(x: torch.Tensor, seed: int, hidden: int) -> torch.Tensor:
    w1, b1, w2, b2 = reference_weights(seed, x.shape[-1], hidden)
    return torch.relu(x.double() @ w1.T + b1) @ w2.T + b2
