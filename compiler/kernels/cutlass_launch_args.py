"""The plumbing of compiler/kernels/cutlass_ops.py's launches: the kernels' argument type tables,
the decode split constants and plan, the input checks (what the kernels can take) and the
per-sequence pointers of a launch. Plain functions and constants: AttentionKernels holds the state."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from compiler.kernels.loader import F32, I32, I64, PTR
from compiler.kernels.manifest import DEFAULT_CONSTANTS

LOG2E = 1.4426950408889634
DECODE_GROUPS = (1, 2, 4, 8)
DECODE_THREADS = 128
# v1 derives each sequence's split count in the kernel with its compile-time MIN_PART.
V1_MIN_TOKENS_PER_SPLIT = DEFAULT_CONSTANTS["min_partition"]
# v2 takes the smallest split as an argument: small enough that a batch of one fills the GPU.
V2_MIN_TOKENS_PER_SPLIT = 64
MAX_SPLITS = 64
WRITE_KV_TYPES = (PTR, PTR, PTR, PTR, PTR, I32, I32, I32, I32, I64, I64, I64, I64, I64)
# The argument type tables follow decode_args / prefill_args below: pointers, then int32 sizes, int64
# strides (q, q head, out, out head, cache block), the log2 scale, the token count, the table's row stride.
_STRIDES = (I64,) * 5
DECODE_TYPES = ((PTR,) * 9) + ((I32,) * 4) + _STRIDES + (F32, I32, I32)  # (7 sequence pointers + 2 scratch)
DECODE_V2_TYPES = ((PTR,) * 10) + ((I32,) * 4) + _STRIDES + (F32, I32, I32, I32)  # (+ counters, min_tokens)
COMBINE_TYPES = (PTR, PTR, PTR, PTR, PTR, I32, I32, I32, I64, I64)
PREFILL_TYPES = ((PTR,) * 7) + ((I32,) * 3) + _STRIDES + (F32, I32, I32)
# The fp8 KV variants take one more argument, last: the layer's {k_scale, v_scale} (float32).
SCALES_TYPES = (PTR,)


def vec_ok(t: torch.Tensor) -> bool:
    """16-byte vector access possible along the last dim of every row."""
    if t.stride(-1) != 1 or t.data_ptr() % 16:
        return False
    return all(s % 8 == 0 for s in t.stride()[:-1])


def cache_ok(c: torch.Tensor, head_dim: int) -> bool:
    nkv = c.shape[2]
    return (
        c.dim() == 4
        and c.stride(3) == 1
        and c.stride(2) == head_dim
        and c.stride(1) == nkv * head_dim
        and c.stride(0) % 8 == 0
        and c.data_ptr() % 16 == 0
    )


def as_i32(t: torch.Tensor) -> torch.Tensor:
    if t.dtype != torch.int32:
        t = t.to(torch.int32)
    return t if t.is_contiguous() else t.contiguous()


def as_block_table(t: torch.Tensor) -> torch.Tensor:
    """The block table as the kernels read it: int32 rows of unit column stride, any row stride
    (the runner passes a column slice of its wider buffer; no copy is made for it)."""
    if t.dtype != torch.int32:
        t = t.to(torch.int32)
    if t.dim() != 2 or t.stride(1) != 1 or (t.shape[0] > 1 and t.stride(0) < t.shape[1]):
        t = t.contiguous()
    return t


@dataclass(frozen=True)
class DecodePlan:
    group: int  # packed query heads per CTA (the g<G> entry point)
    slices: int  # CTAs per kv head along its query heads
    splits: int  # max splits per (sequence, slice): the grid's x
    min_tokens: int  # smallest split (v2 passes it to the kernel)


def sequence_pointers(start, out, q, k_cache, v_cache, qsl, lens, bt):
    """Pointers of a launch over sequences [start, ...): the per-sequence arrays are offset, the
    token arrays are not (query_start_loc holds absolute token offsets)."""
    return (
        out.data_ptr(),
        q.data_ptr(),
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        qsl.data_ptr() + 4 * start,
        lens.data_ptr() + 4 * start,
        bt.data_ptr() + 4 * start * bt.stride(0),
    )


def decode_args(ptrs, scratch, counters, plan: DecodePlan, q, out, k_cache, bt, scale_log2, ntok, scales) -> tuple:
    """A decode launch's arguments (DECODE_TYPES; DECODE_V2_TYPES when `counters`, v2's merge tickets,
    is given: v2 also takes the plan's smallest split)."""
    Hq, hkv, max_blocks = q.shape[1], k_cache.shape[2], bt.shape[1]
    strides = (q.stride(0), q.stride(1), out.stride(0), out.stride(1), k_cache.stride(0))
    head = (*ptrs, *scratch)
    shape = (Hq, hkv, Hq // hkv, max_blocks, *strides, scale_log2, ntok)
    if counters is not None:
        return (*head, counters, *shape, plan.min_tokens, bt.stride(0), *scales)
    return (*head, *shape, bt.stride(0), *scales)


def combine_args(out, ptrs, scratch, num_heads: int, max_blocks: int, splits: int) -> tuple:
    """v1's split merge (COMBINE_TYPES): the output, the launch's query_start_loc and seq_lens, the scratch."""
    return (out.data_ptr(), ptrs[4], ptrs[5], *scratch, num_heads, max_blocks, splits, out.stride(0), out.stride(1))


def prefill_args(ptrs, q, out, k_cache, bt, scale_log2, ntok, scales) -> tuple:
    """A prefill launch's arguments (PREFILL_TYPES)."""
    strides = (q.stride(0), q.stride(1), out.stride(0), out.stride(1), k_cache.stride(0))
    return (*ptrs, q.shape[1], k_cache.shape[2], bt.shape[1], *strides, scale_log2, ntok, bt.stride(0), *scales)


def scale_pair(kv_scales: torch.Tensor | None) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """One layer's {k_scale, v_scale} as two 0-d tensors for the reference (None: scale 1)."""
    return (None, None) if kv_scales is None else (kv_scales[0], kv_scales[1])
