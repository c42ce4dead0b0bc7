"""Tensor parallelism: which rank this process is, its process group, the two collectives the
sharded model needs, and how the attention heads split across ranks.

The model (engine/models/llama.py, its layers and engine/distributed/parallel_layers.py) calls `all_reduce` after
each row-parallel projection and the vocabulary-parallel embedding, and `all_gather_last_dim`
on the logits; with one rank both are no-ops, so a tp=1 model is the single-GPU model.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class TensorParallel:
    """This process's place in a tensor-parallel group. group: the torch.distributed process
    group of the ranks (None when world_size == 1: nothing to talk to)."""

    rank: int
    world_size: int
    group: object | None = None

    def __post_init__(self) -> None:
        if self.world_size < 1 or not 0 <= self.rank < self.world_size:
            raise ValueError(f"tensor_parallel_size: rank {self.rank} is not in a group of {self.world_size}")


def init_tensor_parallel(rank: int, world_size: int, init_method: str, backend: str) -> TensorParallel:
    """Join the group (torch.distributed.init_process_group): backend "gloo" on the CPU, "nccl"
    on CUDA. init_method: "tcp://host:port" or "file:///path" (every rank passes the same)."""
    if world_size == 1:
        return TensorParallel(rank=0, world_size=1, group=None)
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"tensor_parallel_size: backend must be 'gloo' (CPU) or 'nccl' (CUDA), not {backend!r}")
    if not dist.is_initialized():
        dist.init_process_group(backend=backend, init_method=init_method, rank=rank, world_size=world_size)
    return TensorParallel(rank=rank, world_size=world_size, group=dist.group.WORLD)


def all_reduce(x: torch.Tensor, tp: TensorParallel | None) -> torch.Tensor:
    """Sum x over the ranks (in place; returns x)."""
    if tp is None or tp.world_size == 1:
        return x
    dist.all_reduce(x, group=tp.group)
    return x


def all_gather_last_dim(x: torch.Tensor, tp: TensorParallel | None) -> torch.Tensor:
    """Concatenate every rank's x along the last dimension, in rank order."""
    if tp is None or tp.world_size == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(tp.world_size)]
    dist.all_gather(parts, x.contiguous(), group=tp.group)
    return torch.cat(parts, dim=-1)


# Backstop for a collective that never completes (a hung, not dead, peer). Start-up phases
# between two messages (a worker loading a large checkpoint) must fit in it.
COLLECTIVE_TIMEOUT_S = 300.0


def join_group(rank: int, world_size: int, init_method: str, backend: str) -> TensorParallel:
    """Join the process group (with the collective timeout) as this rank."""
    dist.init_process_group(
        backend,
        init_method=init_method,
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=COLLECTIVE_TIMEOUT_S),
    )
    return init_tensor_parallel(rank, world_size, init_method, backend)
