"""How a model's shape splits over tensor-parallel ranks: the KV heads and vocabulary rows each rank
holds (its query and KV heads: the attention layer's `local_heads`, engine/layers/attention/layer.py),
and the check that a model's widths divide over the ranks."""

from __future__ import annotations

from engine.distributed.parallel import TensorParallel
from engine.layers.attention.layer import local_heads
from engine.models.config import ModelConfig


def _world(tp: TensorParallel | None) -> int:
    return 1 if tp is None else tp.world_size


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


def kv_heads_of(config: ModelConfig, tp: TensorParallel | None) -> int:
    """KV heads of this rank's cache."""
    return local_heads(config, tp)[1]
