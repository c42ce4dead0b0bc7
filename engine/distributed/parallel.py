"""Tensor parallelism: which rank this process is, its process group, the two collectives the
sharded model needs, and how the attention heads split across ranks.

The model (engine/models/llama.py with engine/distributed/layers.py) calls `all_reduce` after
each row-parallel projection and the vocabulary-parallel embedding, and `all_gather_last_dim`
on the logits; with one rank both are no-ops, so a tp=1 model is the single-GPU model.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from engine.models.config import ModelConfig


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


def _world(tp: TensorParallel | None) -> int:
    return 1 if tp is None else tp.world_size


def local_heads(config: ModelConfig, tp: TensorParallel | None) -> tuple[int, int]:
    """(query heads, KV heads) this rank holds. Query heads split evenly; KV heads split evenly
    when there are at least as many as ranks, else each rank holds the one KV head its query
    heads read (replicated on tensor_parallel_size / num_kv_heads ranks).
    The rank's KV cache has local_heads(config, tp)[1] heads."""
    world = _world(tp)
    heads, kv = config.num_heads, config.num_kv_heads
    if world == 1:
        return heads, kv
    if heads % world:
        raise ValueError(f"tensor_parallel_size={world} does not divide the model's {heads} attention heads")
    if kv >= world:
        if kv % world:
            raise ValueError(f"tensor_parallel_size={world} does not divide the model's {kv} KV heads")
        return heads // world, kv // world
    if world % kv:
        raise ValueError(f"tensor_parallel_size={world} is not a multiple of the model's {kv} KV heads "
                         f"(fewer KV heads than ranks are replicated, which needs a whole number of ranks per head)")
    return heads // world, 1


def first_kv_head(config: ModelConfig, tp: TensorParallel | None) -> int:
    """The model's index of this rank's first KV head (its query heads read it and the next ones)."""
    world = _world(tp)
    if world == 1:
        return 0
    _, kv_local = local_heads(config, tp)
    if config.num_kv_heads >= world:
        return tp.rank * kv_local
    return tp.rank * config.num_kv_heads // world  # replicated: world / kv ranks share each head


def vocab_rows_per_rank(config: ModelConfig, tp: TensorParallel | None) -> int:
    """Vocabulary rows per rank: the vocabulary is padded up to a multiple of the ranks (the
    padding rows embed to zero and their logits are dropped), so any vocabulary size shards."""
    world = _world(tp)
    return -(-config.vocab_size // world)


def check_shardable(config: ModelConfig, tp: TensorParallel | None) -> None:
    """Refuse a model whose heads or MLP widths do not split over the ranks."""
    world = _world(tp)
    if world == 1:
        return
    local_heads(config, tp)
    widths = {}
    if len(config.sparse_layers) < config.num_layers:  # some layers have the dense MLP
        widths["intermediate_size"] = config.intermediate_size
    if config.is_moe:
        widths["moe_intermediate_size"] = config.moe_intermediate_size
        if config.shared_expert_intermediate_size:
            widths["shared_expert_intermediate_size"] = config.shared_expert_intermediate_size
    for name, width in widths.items():
        if width % world:
            raise ValueError(f"tensor_parallel_size={world} does not divide the model's {name} ({width})")
