"""The reference backend: the `kiln::` custom ops with their pure-torch implementations."""

from __future__ import annotations

import torch

import compiler.ops  # noqa: F401  (registers torch.ops.kiln.*)
from engine.attention.base import AttentionMetadata


class TorchAttentionBackend:
    name = "torch"

    def forward(self, q, k, v, k_cache, v_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        torch.ops.kiln.write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        out = torch.empty_like(q)
        torch.ops.kiln.paged_attention(
            out, q, k_cache, v_cache, meta.query_start_loc, meta.seq_lens, meta.block_tables,
            scale, meta.max_query_len, meta.max_seq_len,
        )
        return out
