"""How many bytes of memory the KV cache takes on the CPU: kv_cache_memory_gb when set, else a
share of the memory free once the weights are loaded (engine/core/kv/kv_sizing.py: cpu_kv_budget)."""

from __future__ import annotations

import logging

import torch

from engine.config.settings import EngineSettings
from engine.core.kv import kv_sizing
from engine.models.config import ModelConfig

logger = logging.getLogger(__name__)


def cpu_kv_bytes(
    settings: EngineSettings,
    cfg: ModelConfig,
    per_block: int,
    max_model_len: int,
    token_budget: int,
    dtype: torch.dtype,
) -> float:
    """The budget in bytes, logged with the blocks and tokens it holds and why."""
    s = settings
    if s.kv_cache_memory_gb is not None:
        budget, why = s.kv_cache_memory_gb * kv_sizing.GIB, "kv_cache_memory_gb"
    else:
        blocks_per_seq = -(-max_model_len // s.block_size)
        needed = (s.max_num_seqs * blocks_per_seq + 1) * per_block
        free = kv_sizing.read_free_memory()
        if free is None:
            budget, why = kv_sizing.CPU_KV_FLOOR, "the floor: this system does not say how much memory is free"
        else:
            width = (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim
            activations = kv_sizing.activation_bytes(
                token_budget,
                s.max_num_seqs,
                cfg.hidden_size,
                cfg.intermediate_size or cfg.hidden_size,
                width,
                cfg.vocab_size,
                torch.finfo(dtype).bits // 8,
            )
            budget, why = kv_sizing.cpu_kv_budget(free.bytes, activations, needed, s.tensor_parallel_size)
            why += f" ({free.source}); set kv_cache_memory_gb to choose"
    blocks = int(budget // per_block)
    logger.info(
        "KV cache on the CPU: %.2f GiB, %d blocks = %d tokens: %s",
        budget / kv_sizing.GIB,
        blocks,
        max(blocks - 1, 0) * s.block_size,
        why,
    )
    return budget
