"""kiln's CUTLASS/CuTe attention kernels as opaque torch custom ops (CUDA only).

    kernels = load_attention_kernels(cache_dir, device, dtype, head_dim, block_size)
    torch.ops.kiln.write_kv_cutlass(k, v, kv_cache, layer, slot_mapping)
    torch.ops.kiln.paged_attention_cutlass(out, q, kv_cache, layer, query_start_loc,
                                           seq_lens, block_tables, scale, max_query_len, max_seq_len)

The ops have the reference ops' signatures (compiler/ops.py). Kernels are loaded once
(cuda-python, torch's primary context) and looked up per call by (device, dtype,
head_dim, block_size); launches go to torch's *current* stream, read at every call, so
CUDA-graph capture records them. Split-KV scratch is allocated once at load time, so a
captured graph sees stable pointers. Inputs the kernels cannot take (unaligned or odd
strides, mismatched dtypes, head counts that do not divide) fall back to the reference.

Switches: USE_DECODE_V2 / USE_WGMMA_PREFILL (below) pick the decode / prefill kernels; each
AttentionKernels instance can override them (`use_decode_v2`, `use_wgmma_prefill`), which is
how the GPU tests run both paths. Setting a switch to False selects the previous kernel.

Decode (max_query_len <= 1): grid = (max_splits, kv heads x head slices, sequences);
max_splits depends only on the batch size, head counts and the block-table width (all
fixed for a captured graph); the live split count of each sequence is derived on the
device from its seq_len, and the combine kernel re-derives it.
"""

from __future__ import annotations

from pathlib import Path

import torch

from compiler.kernels.loader import F32, I32, I64, PTR, KernelLibrary, Launcher
from compiler.kernels.manifest import (
    DEFAULT_CONSTANTS, attention_variant_names, dtype_tag, prefill_smem_bytes, prefill_tile,
    prefill_wgmma_smem_bytes, prefill_wgmma_tile,
)
from compiler.reference_attention import paged_attention_reference, write_kv_reference

LOG2E = 1.4426950408889634

# ---- switches: which kernel generation serves ------------------------------------------
# The defaults are the kernels verified on an H200 (2026-11-29: 78 GPU tests against the
# reference). The newer ones compile and have GPU tests of their own (run explicitly by
# tests/test_kernels_gpu.py whatever these say) but have not run on a GPU yet: turn them on
# once `tools/gpu_check.sh` passes them.
# Decode: True = paged_decode_v2 (warp-contiguous block streaming, prefetched block table,
# tunable split policy, in-kernel last-split merge, no combine launch); False = paged_decode (v1).
USE_DECODE_V2 = False
# v2 split policy (host side, graph-stable): aim for DECODE_CTAS_PER_SM * num_SMs CTAs and
# never give a split fewer than DECODE_MIN_TOKENS_PER_SPLIT tokens (also passed to the kernel,
# which derives the live split count of each sequence from its seq_len with it).
DECODE_MIN_TOKENS_PER_SPLIT = 256
DECODE_CTAS_PER_SM = 4
# Prefill: True = flash_prefill_wgmma (sm_90a warpgroup MMA, 128-row tiles, 2 warpgroups);
# False = flash_prefill (mma.sync, 64-row tiles).
USE_WGMMA_PREFILL = False
DECODE_GROUPS = (1, 2, 4, 8)
DECODE_THREADS = 128
MIN_PARTITION = DEFAULT_CONSTANTS["min_partition"]
MAX_SPLITS = 64
_WRITE_KV_TYPES = (PTR, PTR, PTR, PTR, PTR, I32, I32, I32, I32, I64, I64, I64, I64, I64)
_DECODE_TYPES = (PTR, PTR, PTR, PTR, PTR, PTR, PTR, PTR, PTR, I32, I32, I32, I32,
                 I64, I64, I64, I64, I64, F32, I32)
_DECODE_V2_TYPES = (PTR, PTR, PTR, PTR, PTR, PTR, PTR, PTR, PTR, PTR, I32, I32, I32, I32,
                    I64, I64, I64, I64, I64, F32, I32, I32)
_COMBINE_TYPES = (PTR, PTR, PTR, PTR, PTR, I32, I32, I32, I64, I64)
_PREFILL_TYPES = (PTR, PTR, PTR, PTR, PTR, PTR, PTR, I32, I32, I32, I64, I64, I64, I64, I64, F32, I32)

_REGISTRY: dict[tuple, "AttentionKernels"] = {}


def _key(device: torch.device, dtype: torch.dtype, head_dim: int, block_size: int) -> tuple:
    return (device.index if device.index is not None else torch.cuda.current_device(), dtype, head_dim, block_size)


def _vec_ok(t: torch.Tensor) -> bool:
    """16-byte vector access possible along the last dim of every row."""
    if t.stride(-1) != 1 or t.data_ptr() % 16:
        return False
    return all(s % 8 == 0 for s in t.stride()[:-1])


def _cache_ok(c: torch.Tensor, head_dim: int) -> bool:
    nkv = c.shape[2]
    return (c.dim() == 4 and c.stride(3) == 1 and c.stride(2) == head_dim and c.stride(1) == nkv * head_dim
            and c.stride(0) % 8 == 0 and c.data_ptr() % 16 == 0)


def _i32(t: torch.Tensor) -> torch.Tensor:
    if t.dtype != torch.int32:
        t = t.to(torch.int32)
    return t if t.is_contiguous() else t.contiguous()


class AttentionKernels:
    """Loaded kernels + scratch for one (device, dtype, head_dim, block_size)."""

    def __init__(self, cache_dir, device, dtype: torch.dtype, head_dim: int, block_size: int,
                 scratch_floats: int = 1 << 22):
        self.device = torch.device(device)
        if self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.dtype, self.head_dim, self.block_size = dtype, head_dim, block_size
        self.names = attention_variant_names(dtype, head_dim, block_size)
        self.lib = KernelLibrary(cache_dir, list(self.names.values())).load(self.device)
        ctx = self.lib.context
        n = self.names
        self.write_kv_l = Launcher(self.lib.function(n["write_kv"]), 256, 0, _WRITE_KV_TYPES, n["write_kv"], ctx)
        self.decode_l = {
            g: Launcher(self.lib.function(n["paged_decode"], f"g{g}"), DECODE_THREADS, 0, _DECODE_TYPES,
                        f"{n['paged_decode']}_g{g}", ctx)
            for g in DECODE_GROUPS
        }
        self.decode_v2_l = {
            g: Launcher(self.lib.function(n["paged_decode_v2"], f"g{g}"), DECODE_THREADS, 0, _DECODE_V2_TYPES,
                        f"{n['paged_decode_v2']}_g{g}", ctx)
            for g in DECODE_GROUPS
        }
        self.combine_l = Launcher(self.lib.function(n["paged_decode"], "combine"), head_dim, 0, _COMBINE_TYPES,
                                  f"{n['paged_decode']}_combine", ctx)
        tile = prefill_tile(head_dim)
        self.block_m = tile["block_m"]
        smem = prefill_smem_bytes(head_dim)
        self.prefill_l = Launcher(self.lib.function(n["flash_prefill"], None, smem), self.block_m // 16 * 32, smem,
                                  _PREFILL_TYPES, n["flash_prefill"], ctx)
        wt = prefill_wgmma_tile(head_dim)
        self.block_m_wgmma = 64 * wt["wg_warpgroups"]
        smem = prefill_wgmma_smem_bytes(head_dim)
        try:
            self.prefill_wgmma_l = Launcher(self.lib.function(n["flash_prefill_wgmma"], None, smem),
                                            128 * wt["wg_warpgroups"], smem, _PREFILL_TYPES,
                                            n["flash_prefill_wgmma"], ctx)
        except Exception as e:  # noqa: BLE001 - keep the mma.sync prefill usable
            import warnings

            warnings.warn(f"kiln: wgmma prefill unavailable ({e}); using the mma.sync prefill")
            self.prefill_wgmma_l = None
        self.use_wgmma_prefill: bool | None = None  # None: follow USE_WGMMA_PREFILL
        props = torch.cuda.get_device_properties(self.device)
        self.num_sms = props.multi_processor_count
        self.target_ctas = self.num_sms * 12
        self.scratch_floats = scratch_floats
        self.part_out = torch.empty(scratch_floats, dtype=torch.float32, device=self.device)
        self.part_lse = torch.empty(max(scratch_floats // 64, 1), dtype=torch.float32, device=self.device)
        self._split_cache: dict[tuple, tuple] = {}
        # v2: per-(sequence, kv head slice) tickets of the last-split merge; all zero between launches.
        self.counters = torch.zeros(max(scratch_floats // 64, 1), dtype=torch.int32, device=self.device)
        # None: follow the module-level switches at each call (tests/bench may set these per instance).
        self.use_decode_v2: bool | None = None
        self.decode_min_tokens: int | None = None
        self.decode_ctas_per_sm: int | None = None

    # ---- write_kv ---------------------------------------------------------------------
    def write_kv(self, k, v, k_cache, v_cache, slot_mapping) -> None:
        T = k.shape[0]
        if T == 0:
            return
        D = self.head_dim
        if not (k.dtype == v.dtype == k_cache.dtype == v_cache.dtype == self.dtype and k.dim() == 3
                and _vec_ok(k) and _vec_ok(v) and _cache_ok(k_cache, D) and _cache_ok(v_cache, D)
                and k_cache.stride(0) == v_cache.stride(0) and k.shape[1:] == v.shape[1:]
                and k.shape[1] == k_cache.shape[2] and k.shape[2] == D):
            write_kv_reference(k, v, k_cache, v_cache, slot_mapping)
            return
        slots = slot_mapping
        if slots.dtype != torch.int64 or not slots.is_contiguous():
            slots = slots.to(torch.int64).contiguous()
        hkv = k.shape[1]
        total = T * hkv * (D // 8)
        grid = min((total + 255) // 256, self.num_sms * 16)
        self.write_kv_l(
            (grid, 1, 1), torch.cuda.current_stream(k.device).cuda_stream,
            (k.data_ptr(), v.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), slots.data_ptr(),
             T, hkv, D, self.block_size, k.stride(0), k.stride(1), v.stride(0), v.stride(1), k_cache.stride(0)),
        )

    # ---- attention --------------------------------------------------------------------
    def _split_plan(self, num_seqs: int, num_heads: int, num_kv_heads: int, max_blocks: int,
                    target_ctas: int, min_tokens: int) -> tuple[int, int, int]:
        """(G, head slices, max_splits): aim for `target_ctas` CTAs, never a split of fewer than
        `min_tokens` tokens, and no more splits than the scratch holds. Host-only and
        graph-stable: batch, heads, table width and constants only."""
        group = num_heads // num_kv_heads
        g = next((x for x in DECODE_GROUPS if x >= group), DECODE_GROUPS[-1])
        slices = -(-group // g)
        ctas = num_seqs * num_kv_heads * slices
        splits = max(1, -(-target_ctas // ctas))
        splits = min(splits, MAX_SPLITS, max(1, -(-max_blocks * self.block_size // min_tokens)))
        rows = num_seqs * num_heads
        splits = max(1, min(splits, self.scratch_floats // (rows * self.head_dim), self.part_lse.numel() // rows))
        return g, slices, splits

    def decode_plan(self, num_seqs: int, num_heads: int, num_kv_heads: int, max_blocks: int) -> tuple[int, int, int]:
        """(G, head slices, max_splits) for a v1 decode launch."""
        key = (num_seqs, num_heads, num_kv_heads, max_blocks)
        plan = self._split_cache.get(key)
        if plan is None:
            plan = self._split_plan(num_seqs, num_heads, num_kv_heads, max_blocks, self.target_ctas, MIN_PARTITION)
            self._split_cache[key] = plan
        return plan

    def decode_v2_plan(self, num_seqs: int, num_heads: int, num_kv_heads: int,
                       max_blocks: int) -> tuple[int, int, int, int]:
        """(G, head slices, max_splits, min tokens per split) for a v2 decode launch."""
        min_tok = int(self.decode_min_tokens or DECODE_MIN_TOKENS_PER_SPLIT)
        cps = int(self.decode_ctas_per_sm or DECODE_CTAS_PER_SM)
        key = ("v2", num_seqs, num_heads, num_kv_heads, max_blocks, min_tok, cps)
        plan = self._split_cache.get(key)
        if plan is None:
            g, slices, splits = self._split_plan(num_seqs, num_heads, num_kv_heads, max_blocks,
                                                 self.num_sms * cps, min_tok)
            if num_seqs * num_kv_heads * slices > self.counters.numel():
                splits = 1  # more (sequence, head slice) pairs than merge counters
            plan = (g, slices, splits, min_tok)
            self._split_cache[key] = plan
        return plan

    def decode_v2_enabled(self) -> bool:
        return USE_DECODE_V2 if self.use_decode_v2 is None else bool(self.use_decode_v2)

    def supports(self, out, q, k_cache, v_cache) -> bool:
        D = self.head_dim
        return (q.dim() == 3 and q.shape[2] == D and out.shape == q.shape
                and q.dtype == out.dtype == k_cache.dtype == v_cache.dtype == self.dtype
                and q.shape[1] % k_cache.shape[2] == 0 and _vec_ok(q) and _vec_ok(out)
                and _cache_ok(k_cache, D) and _cache_ok(v_cache, D) and k_cache.stride(0) == v_cache.stride(0)
                and k_cache.shape[1] == self.block_size)

    def attention(self, out, q, k_cache, v_cache, query_start_loc, seq_lens, block_tables, scale: float,
                  max_query_len: int, max_seq_len: int) -> None:
        T, Hq, D = q.shape
        B = seq_lens.shape[0]
        if T == 0:
            return
        if B == 0:
            out.zero_()
            return
        if not self.supports(out, q, k_cache, v_cache):
            out.copy_(paged_attention_reference(q, k_cache, v_cache, query_start_loc, seq_lens, block_tables,
                                                scale, max_query_len, max_seq_len))
            return
        qsl = _i32(query_start_loc)
        lens = _i32(seq_lens)
        bt = _i32(block_tables)
        hkv = k_cache.shape[2]
        max_blocks = bt.shape[1]
        stream = torch.cuda.current_stream(q.device).cuda_stream
        scale_log2 = float(scale) * LOG2E
        if max_query_len <= 1 and self.decode_v2_enabled():
            g, slices, splits, min_tok = self.decode_v2_plan(B, Hq, hkv, max_blocks)
            self.decode_v2_l[g](
                (splits, hkv * slices, B), stream,
                (out.data_ptr(), q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), qsl.data_ptr(),
                 lens.data_ptr(), bt.data_ptr(), self.part_out.data_ptr(), self.part_lse.data_ptr(),
                 self.counters.data_ptr(), Hq, hkv, Hq // hkv, max_blocks, q.stride(0), q.stride(1),
                 out.stride(0), out.stride(1), k_cache.stride(0), scale_log2, T, min_tok),
            )
        elif max_query_len <= 1:
            g, slices, splits = self.decode_plan(B, Hq, hkv, max_blocks)
            self.decode_l[g](
                (splits, hkv * slices, B), stream,
                (out.data_ptr(), q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), qsl.data_ptr(),
                 lens.data_ptr(), bt.data_ptr(), self.part_out.data_ptr(), self.part_lse.data_ptr(),
                 Hq, hkv, Hq // hkv, max_blocks, q.stride(0), q.stride(1), out.stride(0), out.stride(1),
                 k_cache.stride(0), scale_log2, T),
            )
            if splits > 1:
                self.combine_l(
                    (Hq, B, 1), stream,
                    (out.data_ptr(), qsl.data_ptr(), lens.data_ptr(), self.part_out.data_ptr(),
                     self.part_lse.data_ptr(), Hq, max_blocks, splits, out.stride(0), out.stride(1)),
                )
        else:
            wg = USE_WGMMA_PREFILL if self.use_wgmma_prefill is None else bool(self.use_wgmma_prefill)
            wg = wg and self.prefill_wgmma_l is not None
            launcher, bm = (self.prefill_wgmma_l, self.block_m_wgmma) if wg else (self.prefill_l, self.block_m)
            mtiles = -(-max_query_len // bm)
            launcher(
                (mtiles, Hq, B), stream,
                (out.data_ptr(), q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), qsl.data_ptr(),
                 lens.data_ptr(), bt.data_ptr(), Hq, hkv, max_blocks, q.stride(0), q.stride(1),
                 out.stride(0), out.stride(1), k_cache.stride(0), scale_log2, T),
            )


def load_attention_kernels(cache_dir, device, dtype: torch.dtype, head_dim: int, block_size: int,
                           scratch_floats: int = 1 << 22) -> AttentionKernels:
    """Load (once) and register the kernels the ops use for this shape; returns them."""
    device = torch.device(device)
    key = _key(device, dtype, head_dim, block_size)
    k = _REGISTRY.get(key)
    if k is None:
        k = AttentionKernels(Path(cache_dir), device, dtype, head_dim, block_size, scratch_floats)
        _REGISTRY[key] = k
    return k


def loaded_kernels(device: torch.device, dtype: torch.dtype, head_dim: int, block_size: int) -> AttentionKernels:
    k = _REGISTRY.get(_key(device, dtype, head_dim, block_size))
    if k is None:
        raise RuntimeError(
            f"kiln cutlass kernels for {dtype_tag(dtype)} head_dim={head_dim} block_size={block_size} on {device} "
            "are not loaded: call compiler.cutlass_ops.load_attention_kernels(...) (the cutlass backend does) first"
        )
    return k


def _kernels_for(kv_cache: torch.Tensor) -> AttentionKernels:
    """kv_cache: [layers, 2, blocks, block_size, kv_heads, head_dim]."""
    return loaded_kernels(kv_cache.device, kv_cache.dtype, kv_cache.shape[5], kv_cache.shape[3])


@torch.library.custom_op("kiln::write_kv_cutlass", mutates_args=("kv_cache",), device_types="cuda")
def write_kv_cutlass(
    k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, layer: int, slot_mapping: torch.Tensor,
) -> None:
    _kernels_for(kv_cache).write_kv(k, v, kv_cache[layer, 0], kv_cache[layer, 1], slot_mapping)


@write_kv_cutlass.register_fake
def _(k, v, kv_cache, layer, slot_mapping) -> None:
    return None


@torch.library.custom_op("kiln::paged_attention_cutlass", mutates_args=("out",), device_types="cuda")
def paged_attention_cutlass(
    out: torch.Tensor, q: torch.Tensor, kv_cache: torch.Tensor, layer: int,
    query_start_loc: torch.Tensor, seq_lens: torch.Tensor, block_tables: torch.Tensor,
    scale: float, max_query_len: int, max_seq_len: int,
) -> None:
    _kernels_for(kv_cache).attention(out, q, kv_cache[layer, 0], kv_cache[layer, 1], query_start_loc, seq_lens,
                                     block_tables, scale, max_query_len, max_seq_len)


@paged_attention_cutlass.register_fake
def _(out, q, kv_cache, layer, query_start_loc, seq_lens, block_tables, scale, max_query_len, max_seq_len) -> None:
    return None


def required_variants(dtype: torch.dtype, head_dim: int, block_size: int) -> list[str]:
    return list(attention_variant_names(dtype, head_dim, block_size).values())


__all__ = ["AttentionKernels", "load_attention_kernels", "loaded_kernels", "required_variants",
           "write_kv_cutlass", "paged_attention_cutlass"]
