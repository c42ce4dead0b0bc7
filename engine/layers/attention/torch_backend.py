"""The reference backend: the `kiln::` custom ops with their pure-torch implementations."""

from __future__ import annotations

import torch

import compiler.kernels.ops  # noqa: F401  (registers torch.ops.kiln.*)
from compiler.kernels.cpu_attention import paged_attention_cpu_impl, write_kv_cpu_impl
from engine.layers.attention.base import AttentionMetadata
from engine.layers.kv_cache import KVScales


class TorchAttentionBackend:
    """compiled_cpu_decode (CPU with compilation on): attention (decodes and prefill chunks,
    windowed and soft-capped too) goes through the C++ kernel of compiler/kernels/cpu_attention.py
    instead of the gather + SDPA reference; enforce_eager keeps the reference.
    kv_scales: an fp8 cache's scales (use_kv_scales); None reads an fp8 cache with scale 1."""

    name = "torch"

    def __init__(self, compiled_cpu_decode: bool = False) -> None:
        self.compiled_cpu_decode = compiled_cpu_decode
        self.kv_scales: KVScales | None = None

    def use_kv_scales(self, kv_scales: KVScales | None) -> None:
        self.kv_scales = kv_scales

    @property
    def plain_cpu_kernels(self) -> bool:
        """Whether an eager forward's attention is exactly kiln_cpu.write_kv + kiln_cpu.paged_attention
        with no KV scales: what the CPU decoder stack (engine/models/cpu_stack.py) calls itself."""
        return self.compiled_cpu_decode and self.kv_scales is None

    def forward(
        self,
        q,
        k,
        v,
        kv_cache,
        layer: int,
        meta: AttentionMetadata,
        scale: float,
        sliding_window: int = 0,
        softcap: float = 0.0,
    ) -> torch.Tensor:
        fused_cpu = self.compiled_cpu_decode
        eager = fused_cpu and not torch.compiler.is_compiling()
        scales = None if self.kv_scales is None else self.kv_scales.before_write(k, v, layer, meta.slot_mapping, eager)
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        if eager:
            # Eager forward on the CPU: the ops' implementations called directly; the custom-op
            # dispatch costs more than batch-1 attention itself (~0.1 ms a call, two per layer).
            # Both C++ ops read strided q/k/v rows (no copies), and q's padding rows past k's
            # (the model's row bucket) are claimed by no sequence: the kernel writes them as zeros.
            write_kv_cpu_impl(k, v, kv_cache, layer, meta.slot_mapping, scales)
            paged_attention_cpu_impl(
                out,
                q,
                kv_cache,
                layer,
                meta.query_start_loc,
                meta.seq_lens,
                meta.block_tables,
                scale,
                meta.max_query_len,
                meta.max_seq_len,
                meta.num_decodes,
                scales,
                sliding_window,
                softcap,
            )
            return out
        result, tokens = out, k.shape[0]
        if q.shape[0] != tokens:  # padding rows (an eager CPU forward's row bucket): zeros
            out[tokens:].zero_()
            q, out = q[:tokens], out[:tokens]
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        torch.ops.kiln.write_kv(k, v, kv_cache, layer, meta.slot_mapping, scales)
        op = torch.ops.kiln.paged_attention_cpu if fused_cpu else torch.ops.kiln.paged_attention
        op(
            out,
            q,
            kv_cache,
            layer,
            meta.query_start_loc,
            meta.seq_lens,
            meta.block_tables,
            scale,
            meta.max_query_len,
            meta.max_seq_len,
            meta.num_decodes,
            sliding_window,
            softcap,
            kv_scales=scales,
        )
        return result
