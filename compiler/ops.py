"""kiln's attention ops as opaque `torch.library` custom ops.

Dynamo never traces into them: under `torch.compile` they appear as single nodes
(their fake implementations give shapes only), and under CUDA-graph capture their
launches are recorded like any other kernel. The default implementations here are
the pure-torch reference (CPU and CUDA); the CUTLASS backend registers its own ops
(`kiln::*_cutlass`) with the same signatures.

Every op takes the whole KV cache [layers, 2, blocks, block_size, kv_heads, head_dim]
and a layer index, never per-layer views: per-layer views are separate graph inputs
aliasing one storage, and AOTAutograd's handling of mutated aliased inputs
("synthetic bases") rebuilds them with wrong sizes on torch 2.11 (and costs Python
work per call on every version). One cache input has no aliases.
"""

from __future__ import annotations

import torch

from compiler.cpu_attention import paged_attention_cpu_impl
from compiler.reference_attention import paged_attention_reference, write_kv_reference


@torch.library.custom_op("kiln::write_kv", mutates_args=("kv_cache",))
def write_kv(
    k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, layer: int, slot_mapping: torch.Tensor,
) -> None:
    write_kv_reference(k, v, kv_cache[layer, 0], kv_cache[layer, 1], slot_mapping)


@write_kv.register_fake
def _(k, v, kv_cache, layer, slot_mapping) -> None:
    return None


@torch.library.custom_op("kiln::paged_attention", mutates_args=("out",))
def paged_attention(
    out: torch.Tensor, q: torch.Tensor, kv_cache: torch.Tensor, layer: int,
    query_start_loc: torch.Tensor, seq_lens: torch.Tensor, block_tables: torch.Tensor,
    scale: float, max_query_len: int, max_seq_len: int, num_decodes: int = 0, sliding_window: int = 0,
    softcap: float = 0.0,
) -> None:
    out.copy_(paged_attention_reference(
        q, kv_cache[layer, 0], kv_cache[layer, 1], query_start_loc, seq_lens, block_tables,
        scale, max_query_len, max_seq_len, num_decodes, sliding_window, softcap,
    ))


@paged_attention.register_fake
def _(out, q, kv_cache, layer, query_start_loc, seq_lens, block_tables, scale,
      max_query_len, max_seq_len, num_decodes=0, sliding_window=0, softcap=0.0) -> None:
    return None


@torch.library.custom_op("kiln::paged_attention_cpu", mutates_args=("out",), device_types="cpu")
def paged_attention_cpu(
    out: torch.Tensor, q: torch.Tensor, kv_cache: torch.Tensor, layer: int,
    query_start_loc: torch.Tensor, seq_lens: torch.Tensor, block_tables: torch.Tensor,
    scale: float, max_query_len: int, max_seq_len: int, num_decodes: int = 0,
) -> None:
    """kiln::paged_attention for the CPU with compilation on (compiler/cpu_attention.py)."""
    paged_attention_cpu_impl(out, q, kv_cache, layer, query_start_loc, seq_lens, block_tables, scale,
                             max_query_len, max_seq_len, num_decodes)


@paged_attention_cpu.register_fake
def _(out, q, kv_cache, layer, query_start_loc, seq_lens, block_tables, scale,
      max_query_len, max_seq_len, num_decodes=0) -> None:
    return None


@torch.library.custom_op("kiln::copy_blocks", mutates_args=("cache",))
def copy_blocks(cache: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> None:
    """Copy whole blocks within one cache tensor laid out [layers, 2, num_blocks, ...]."""
    cache[:, :, dst.long()] = cache[:, :, src.long()]


@copy_blocks.register_fake
def _(cache, src, dst) -> None:
    return None
