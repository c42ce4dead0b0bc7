"""Every `kiln::` custom op, registered here and nowhere else.

The engine imports this module through `engine.layers.attention` (whatever the attention backend),
so every op it calls exists in any process: the reference ops (`write_kv`, `paged_attention`,
CPU and CUDA), the C++ CPU attention (`paged_attention_cpu`), `copy_blocks`, `moe_experts`,
`moe_experts_int4` (int4 experts in torch's packed CPU layout),
and the CUTLASS kernels' ops (`write_kv_cutlass`, `paged_attention_cutlass`; CUDA only, they
launch the kernels a compiler.kernels.cutlass_ops.AttentionKernels holds, named by its handle).
`w4a16_gemm`: kiln's int4-weight GEMM (CUDA only; a compiler.kernels.w4a16_gemm.W4A16Gemm, named by its handle).
Registering needs no GPU and no cuda-python: the kernels are loaded when a backend is built.

`kv_scales` (float32 [layers, 2], optional): an fp8 cache's per-layer K/V scales
(compiler/kernels/kv_quant.py); None reads and writes an fp8 cache with scale 1.

Dynamo never traces into them: under `torch.compile` they appear as single nodes
(their fake implementations give shapes only), and under CUDA-graph capture their
launches are recorded like any other kernel.

Every op takes the whole KV cache [layers, 2, blocks, block_size, kv_heads, head_dim]
and a layer index, never per-layer views: per-layer views are separate graph inputs
aliasing one storage, and AOTAutograd's handling of mutated aliased inputs
("synthetic bases") rebuilds them with wrong sizes on torch 2.11 (and costs Python
work per call on every version). One cache input has no aliases.
"""

from __future__ import annotations

import torch

from compiler.kernels import moe
from compiler.kernels.cpu_attention import paged_attention_cpu_impl
from compiler.kernels.cutlass_ops import kernels_by_handle
from compiler.kernels.kv_quant import byte_view, calibrate_kv_scales, layer_scales
from compiler.kernels.reference_attention import paged_attention_reference, write_kv_reference
from compiler.kernels.w4a16_gemm import w4a16_by_handle


@torch.library.custom_op("kiln::write_kv", mutates_args=("kv_cache",))
def write_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: torch.Tensor,
    layer: int,
    slot_mapping: torch.Tensor,
    kv_scales: torch.Tensor | None = None,
) -> None:
    write_kv_reference(k, v, kv_cache[layer, 0], kv_cache[layer, 1], slot_mapping, *layer_scales(kv_scales, layer))


@write_kv.register_fake
def _(k, v, kv_cache, layer, slot_mapping, kv_scales=None) -> None:
    return None


@torch.library.custom_op("kiln::calibrate_kv_scales", mutates_args=("kv_scales", "calibrated"))
def calibrate_kv_scales_op(
    k: torch.Tensor,
    v: torch.Tensor,
    slot_mapping: torch.Tensor,
    kv_scales: torch.Tensor,
    calibrated: torch.Tensor,
    layer: int,
) -> None:
    """An fp8 cache's scales from the first rows a layer writes (compiler/kernels/kv_quant.py)."""
    calibrate_kv_scales(k, v, slot_mapping, kv_scales, calibrated, layer)


@calibrate_kv_scales_op.register_fake
def _(k, v, slot_mapping, kv_scales, calibrated, layer) -> None:
    return None


@torch.library.custom_op("kiln::paged_attention", mutates_args=("out",))
def paged_attention(
    out: torch.Tensor,
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    layer: int,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    max_query_len: int,
    max_seq_len: int,
    num_decodes: int = 0,
    sliding_window: int = 0,
    softcap: float = 0.0,
    kv_scales: torch.Tensor | None = None,
) -> None:
    out.copy_(
        paged_attention_reference(
            q,
            kv_cache[layer, 0],
            kv_cache[layer, 1],
            query_start_loc,
            seq_lens,
            block_tables,
            scale,
            max_query_len,
            max_seq_len,
            num_decodes,
            sliding_window,
            softcap,
            *layer_scales(kv_scales, layer),
        )
    )


@paged_attention.register_fake
def _(
    out,
    q,
    kv_cache,
    layer,
    query_start_loc,
    seq_lens,
    block_tables,
    scale,
    max_query_len,
    max_seq_len,
    num_decodes=0,
    sliding_window=0,
    softcap=0.0,
    kv_scales=None,
) -> None:
    return None


@torch.library.custom_op("kiln::paged_attention_cpu", mutates_args=("out",), device_types="cpu")
def paged_attention_cpu(
    out: torch.Tensor,
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    layer: int,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    max_query_len: int,
    max_seq_len: int,
    num_decodes: int = 0,
    sliding_window: int = 0,
    softcap: float = 0.0,
    kv_scales: torch.Tensor | None = None,
) -> None:
    """kiln::paged_attention for the CPU with compilation on: the C++ kernel of
    compiler/kernels/cpu_attention.py (the same arguments as kiln::paged_attention)."""
    paged_attention_cpu_impl(
        out,
        q,
        kv_cache,
        layer,
        query_start_loc,
        seq_lens,
        block_tables,
        scale,
        max_query_len,
        max_seq_len,
        num_decodes,
        kv_scales,
        sliding_window,
        softcap,
    )


@paged_attention_cpu.register_fake
def _(
    out,
    q,
    kv_cache,
    layer,
    query_start_loc,
    seq_lens,
    block_tables,
    scale,
    max_query_len,
    max_seq_len,
    num_decodes=0,
    sliding_window=0,
    softcap=0.0,
    kv_scales=None,
) -> None:
    return None


@torch.library.custom_op("kiln::copy_blocks", mutates_args=("cache",))
def copy_blocks(cache: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> None:
    """Copy whole blocks within one cache tensor laid out [layers, 2, num_blocks, ...] (an fp8
    cache as its bytes)."""
    raw = byte_view(cache)
    raw[:, :, dst.long()] = raw[:, :, src.long()]


@copy_blocks.register_fake
def _(cache, src, dst) -> None:
    return None


@torch.library.custom_op("kiln::moe_experts", mutates_args=())
def moe_experts(
    x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, activation: str
) -> torch.Tensor:
    """The routed experts of a mixture-of-experts FFN (compiler/kernels/moe.py)."""
    return moe.moe_experts_forward(x, weights, ids, w13, w2, activation)


@moe_experts.register_fake
def _(x, weights, ids, w13, w2, activation):
    return torch.empty_like(x)


@torch.library.custom_op("kiln::moe_experts_int4", mutates_args=(), device_types="cpu")
def moe_experts_int4(
    x: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    w13_packed: torch.Tensor,
    w13_sz: torch.Tensor,
    w2_packed: torch.Tensor,
    w2_sz: torch.Tensor,
    w13_perm: torch.Tensor | None,
    w2_perm: torch.Tensor | None,
    group13: int,
    group2: int,
    activation: str,
) -> torch.Tensor:
    """Routed int4 experts in torch's packed CPU layout (compiler/kernels/moe.py; it reads the routing
    on the host, hence opaque)."""
    return moe.moe_experts_int4_cpu(
        x, weights, ids, w13_packed, w13_sz, w2_packed, w2_sz, w13_perm, w2_perm, group13, group2, activation
    )


@moe_experts_int4.register_fake
def _(x, weights, ids, w13_packed, w13_sz, w2_packed, w2_sz, w13_perm, w2_perm, group13, group2, activation):
    return torch.empty_like(x)


@torch.library.custom_op("kiln::write_kv_cutlass", mutates_args=("kv_cache",), device_types="cuda")
def write_kv_cutlass(
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: torch.Tensor,
    layer: int,
    slot_mapping: torch.Tensor,
    kernels: int,
    kv_scales: torch.Tensor | None = None,
) -> None:
    """kiln::write_kv on the CUTLASS kernels `kernels` (an AttentionKernels handle)."""
    kernels_by_handle(kernels).write_kv(
        k, v, kv_cache[layer, 0], kv_cache[layer, 1], slot_mapping, None if kv_scales is None else kv_scales[layer]
    )


@write_kv_cutlass.register_fake
def _(k, v, kv_cache, layer, slot_mapping, kernels, kv_scales=None) -> None:
    return None


@torch.library.custom_op("kiln::paged_attention_cutlass", mutates_args=("out",), device_types="cuda")
def paged_attention_cutlass(
    out: torch.Tensor,
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    layer: int,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    max_query_len: int,
    max_seq_len: int,
    num_decodes: int,
    kernels: int,
    kv_scales: torch.Tensor | None = None,
) -> None:
    """kiln::paged_attention (no window, no cap) on the CUTLASS kernels `kernels`: the leading
    num_decodes one-token sequences take the decode kernel, the rest the prefill kernel."""
    kernels_by_handle(kernels).attention(
        out,
        q,
        kv_cache[layer, 0],
        kv_cache[layer, 1],
        query_start_loc,
        seq_lens,
        block_tables,
        scale,
        max_query_len,
        max_seq_len,
        num_decodes,
        None if kv_scales is None else kv_scales[layer],
    )


@paged_attention_cutlass.register_fake
def _(
    out,
    q,
    kv_cache,
    layer,
    query_start_loc,
    seq_lens,
    block_tables,
    scale,
    max_query_len,
    max_seq_len,
    num_decodes,
    kernels,
    kv_scales=None,
) -> None:
    return None


@torch.library.custom_op("kiln::w4a16_gemm", mutates_args=(), device_types="cuda")
def w4a16_gemm(
    x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, gemm: int
) -> torch.Tensor:
    """y = x @ W^T on kiln's int4 GEMM `gemm` (a w4a16_gemm.W4A16Gemm handle), W in its layout."""
    return w4a16_by_handle(gemm)(x, packed, scales, zeros)


@w4a16_gemm.register_fake
def _(x, packed, scales, zeros, gemm):
    return x.new_empty(x.shape[0], scales.shape[1])
