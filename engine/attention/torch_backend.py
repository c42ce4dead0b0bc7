"""The reference backend: the `kiln::` custom ops with their pure-torch implementations."""

from __future__ import annotations

import torch

import compiler.ops  # noqa: F401  (registers torch.ops.kiln.*)
from compiler.cpu_attention import paged_attention_cpu_impl
from compiler.reference_attention import write_kv_reference
from engine.attention.base import AttentionMetadata


class TorchAttentionBackend:
    """compiled_cpu_decode (CPU with compilation on): decodes go through the compiled fused
    kernel of compiler/cpu_attention.py instead of the gather + SDPA reference."""

    name = "torch"

    def __init__(self, compiled_cpu_decode: bool = False) -> None:
        self.compiled_cpu_decode = compiled_cpu_decode

    def forward(self, q, k, v, kv_cache, layer: int, meta: AttentionMetadata, scale: float,
                sliding_window: int = 0, softcap: float = 0.0) -> torch.Tensor:
        # The compiled CPU decode kernel attends the whole context, uncapped: windowed and
        # softcapped models take the reference.
        fused_cpu = self.compiled_cpu_decode and not sliding_window and not softcap
        if fused_cpu and not torch.compiler.is_compiling():
            # Eager forward on the CPU: the ops' implementations called directly; the custom-op
            # dispatch costs more than batch-1 attention itself (~0.1 ms a call, two per layer).
            write_kv_reference(k, v, kv_cache[layer, 0], kv_cache[layer, 1], meta.slot_mapping)
            out = torch.empty_like(q)
            paged_attention_cpu_impl(out, q, kv_cache, layer, meta.query_start_loc, meta.seq_lens,
                                     meta.block_tables, scale, meta.max_query_len, meta.max_seq_len, meta.num_decodes)
            return out
        torch.ops.kiln.write_kv(k, v, kv_cache, layer, meta.slot_mapping)
        out = torch.empty_like(q)
        op = torch.ops.kiln.paged_attention_cpu if fused_cpu else torch.ops.kiln.paged_attention
        window = () if fused_cpu else (sliding_window, softcap)
        op(out, q, kv_cache, layer, meta.query_start_loc, meta.seq_lens, meta.block_tables,
           scale, meta.max_query_len, meta.max_seq_len, meta.num_decodes, *window)
        return out
