"""kiln's CUTLASS/CuTe attention kernels, loaded and launched (CUDA only).

    kernels = AttentionKernels(cache_dir, device, dtype, head_dim, block_size,
                               decode_kernel="v1", prefill_kernel="mma")
    torch.ops.kiln.write_kv_cutlass(k, v, kv_cache, layer, slot_mapping, kernels.handle)
    torch.ops.kiln.paged_attention_cutlass(out, q, kv_cache, layer, query_start_loc, seq_lens,
        block_tables, scale, max_query_len, max_seq_len, num_decodes, kernels.handle)

With `kv_dtype=torch.float8_e4m3fn` (an fp8 KV cache) the fp8 variants are loaded: write_kv
quantizes, the attention kernels convert the bytes in registers; both ops then take the cache's
per-layer scales (`kv_scales`, float32 [layers, 2]; None: 1), read by the kernels on the device.

The ops are registered by compiler/kernels/ops.py (with every other kiln:: op). Whoever creates an
AttentionKernels owns it (the cutlass attention backend does): it holds the loaded kernel
generation its settings chose (decode v1 or v2, prefill mma.sync or wgmma), the split-KV
scratch and the occupancy figures. Custom ops take only tensors and plain values, so the op
reaches its kernels through `handle`, an int looked up in a table of weak references: the
table keeps nothing alive, and two engines in one process with different kernel settings each
use their own kernels.

Launches go to torch's *current* stream, read at every call, so CUDA-graph capture records
them. Scratch is allocated once at load time, so a captured graph sees stable pointers.

One call becomes launches by compiler/kernels/launch_plan.py: the leading one-token sequences
(num_decodes) take the decode kernel, the rest the prefill kernel; more than 65,535 sequences
are cut into chunks (the grid's z limit). Decode grid = (max_splits, kv heads x head slices,
sequences); max_splits depends only on the batch, the head counts and the block-table width
(all fixed for a captured graph) and is sized to whole waves of the GPU from the kernel's
measured occupancy; the live split count of each sequence is derived on the device from its seq_len.

Inputs the kernels cannot take (unaligned or odd strides, mismatched dtypes, head counts that do
not divide) run the reference with a logged warning in eager mode, and raise inside CUDA-graph
capture, where the reference would attend over max_model_len positions per sequence.

The launches' argument type tables and tuples, the split constants and the input checks are
compiler/kernels/cutlass_launch_args.py's; this module holds the loaded kernels and their state.
"""

from __future__ import annotations

import itertools
import logging
import weakref
from pathlib import Path

import torch

from compiler.kernels.cutlass_launch_args import (
    COMBINE_TYPES,
    DECODE_GROUPS,
    DECODE_THREADS,
    DECODE_TYPES,
    DECODE_V2_TYPES,
    LOG2E,
    MAX_SPLITS,
    PREFILL_TYPES,
    SCALES_TYPES,
    V1_MIN_TOKENS_PER_SPLIT,
    V2_MIN_TOKENS_PER_SPLIT,
    WRITE_KV_TYPES,
    DecodePlan,
    as_block_table,
    as_i32,
    cache_ok,
    combine_args,
    decode_args,
    prefill_args,
    scale_pair,
    sequence_pointers,
    vec_ok,
)
from compiler.kernels.kv_quant import is_fp8
from compiler.kernels.launch_plan import ctas_per_sm_from_resources, plan_attention_launches, plan_decode_splits
from compiler.kernels.loader import KernelLibrary, Launcher, max_active_ctas_per_sm
from compiler.kernels.manifest import (
    DECODE_KERNELS,
    PREFILL_KERNELS,
    attention_variant_names,
    prefill_smem_bytes,
    prefill_tile,
    prefill_wgmma_smem_bytes,
    prefill_wgmma_tile,
)
from compiler.kernels.reference_attention import paged_attention_reference, write_kv_reference

logger = logging.getLogger(__name__)


_live_kernels: "weakref.WeakValueDictionary[int, AttentionKernels]" = weakref.WeakValueDictionary()
_handles = itertools.count(1)


def kernels_by_handle(handle: int) -> "AttentionKernels":
    """The AttentionKernels an op's `handle` names; raises if its owner has let it go."""
    k = _live_kernels.get(int(handle))
    if k is None:
        raise RuntimeError(
            f"kiln cutlass kernels #{handle} are not loaded (their backend was released); "
            "create an AttentionKernels (the cutlass attention backend does) and pass its handle"
        )
    return k


class AttentionKernels:
    """One kernel generation loaded for one (device, dtype, head_dim, block_size), with its scratch."""

    kv_dtype: torch.dtype | None = None  # the cache's element type (None: dtype)
    kv_fp8 = False

    def __init__(
        self,
        cache_dir,
        device,
        dtype: torch.dtype,
        head_dim: int,
        block_size: int,
        *,
        decode_kernel: str = "v1",
        prefill_kernel: str = "mma",
        scratch_floats: int = 1 << 22,
        kv_dtype: torch.dtype | None = None,
    ):
        self.device = torch.device(device)
        if self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.dtype, self.head_dim, self.block_size = dtype, head_dim, block_size
        self.decode_kernel, self.prefill_kernel = decode_kernel, prefill_kernel
        self.kv_dtype = kv_dtype if kv_dtype is not None else dtype
        self.kv_fp8 = is_fp8(self.kv_dtype)
        self.names = attention_variant_names(
            dtype, head_dim, block_size, decode_kernel, prefill_kernel, self.kv_dtype if self.kv_fp8 else None
        )
        self.lib = KernelLibrary(Path(cache_dir), list(self.names.values())).load(self.device)
        ctx = self.lib.context
        n = self.names
        extra = SCALES_TYPES if self.kv_fp8 else ()
        self.write_kv_l = Launcher(self.lib.function(n["write_kv"]), 256, 0, WRITE_KV_TYPES + extra, n["write_kv"], ctx)
        decode = DECODE_KERNELS[decode_kernel]
        types = (DECODE_V2_TYPES if decode_kernel == "v2" else DECODE_TYPES) + extra
        self.decode_l = {
            g: Launcher(self.lib.function(n[decode], f"g{g}"), DECODE_THREADS, 0, types, f"{n[decode]}_g{g}", ctx)
            for g in DECODE_GROUPS
        }
        self.combine_l = None
        if decode_kernel == "v1":
            self.combine_l = Launcher(
                self.lib.function(n[decode], "combine"), head_dim, 0, COMBINE_TYPES, f"{n[decode]}_combine", ctx
            )
        prefill = PREFILL_KERNELS[prefill_kernel]
        if prefill_kernel == "wgmma":
            wt = prefill_wgmma_tile(head_dim)
            self.block_m, threads, smem = (
                64 * wt["wg_warpgroups"],
                128 * wt["wg_warpgroups"],
                prefill_wgmma_smem_bytes(head_dim),
            )
        else:
            self.block_m = prefill_tile(head_dim)["block_m"]
            threads, smem = self.block_m // 16 * 32, prefill_smem_bytes(head_dim)
        self.prefill_l = Launcher(
            self.lib.function(n[prefill], None, smem), threads, smem, PREFILL_TYPES + extra, n[prefill], ctx
        )
        self._init_state(
            torch.cuda.get_device_properties(self.device).multi_processor_count,
            {g: self._ctas_per_sm(n[decode], g) for g in DECODE_GROUPS},
            scratch_floats,
        )

    def _init_state(self, num_sms: int, occupancy: dict[int, int], scratch_floats: int) -> None:
        """Scratch, plan cache and handle: everything past the kernels themselves."""
        self.num_sms = num_sms
        self.occupancy = occupancy
        self.scratch_floats = scratch_floats
        self.part_out = torch.empty(scratch_floats, dtype=torch.float32, device=self.device)
        self.part_lse = torch.empty(max(scratch_floats // 64, 1), dtype=torch.float32, device=self.device)
        # v2: per-(sequence, kv head slice) tickets of the last-split merge; all zero between launches.
        self.counters = torch.zeros(max(scratch_floats // 64, 1), dtype=torch.int32, device=self.device)
        # An fp8 cache's scales when the caller passes none: 1 (allocated once: graph-stable).
        self.unit_scales = torch.ones(2, dtype=torch.float32, device=self.device)
        self._plans: dict[tuple, DecodePlan] = {}
        self._warned: set[str] = set()
        # Split-policy overrides for benchmark sweeps (None: the occupancy query / the default).
        self.decode_min_tokens: int | None = None
        self.decode_ctas_per_sm: int | None = None
        self.handle = next(_handles)
        _live_kernels[self.handle] = self

    def _ctas_per_sm(self, variant: str, g: int) -> int:
        """Resident decode CTAs per SM: the driver's occupancy answer, else ptxas's registers."""
        fn = self.lib.function(variant, f"g{g}")
        try:
            return max(1, max_active_ctas_per_sm(fn, DECODE_THREADS, 0))
        except Exception:  # noqa: BLE001 - an old driver binding: derive it from the build's report
            res = self.lib.resources(variant).get(f"kiln_{variant}_g{g}")
            if res is None:
                return 1
            return max(1, ctas_per_sm_from_resources(res.registers, DECODE_THREADS, res.shared_bytes))

    @staticmethod
    def _stream(device) -> int:
        """torch's current stream, read at every call (so graph capture records the launches)."""
        return torch.cuda.current_stream(device).cuda_stream

    # ---- inputs the kernels cannot take --------------------------------------------------
    def _decline(self, what: str, reason: str) -> None:
        """Raise inside CUDA-graph capture; otherwise warn once and let the caller run the reference."""
        if torch.cuda.is_current_stream_capturing():
            raise RuntimeError(
                f"kiln cutlass {what}: the kernels cannot take these inputs ({reason}), and inside a captured "
                "CUDA graph the reference would attend over max_model_len positions per sequence; fix the "
                "inputs, or run with attention_backend=torch or enforce_eager"
            )
        if reason not in self._warned:
            self._warned.add(reason)
            logger.warning("kiln cutlass %s: inputs the kernels cannot take (%s): running the reference", what, reason)

    def _scales_arg(self, kv_scales: torch.Tensor | None) -> tuple:
        """The fp8 variants' last argument: the layer's {k_scale, v_scale} (float32, contiguous)."""
        if not self.kv_fp8:
            return ()
        s = self.unit_scales if kv_scales is None else kv_scales
        if s.dtype != torch.float32 or s.numel() != 2 or not s.is_contiguous() or s.device != self.device:
            raise ValueError(
                f"kiln cutlass: kv_scales must be one layer's 2 float32 scales on {self.device}, "
                f"got {s.dtype} {tuple(s.shape)} on {s.device}"
            )
        return (s.data_ptr(),)

    def write_kv_unsupported(self, k, v, k_cache, v_cache) -> str | None:
        D = self.head_dim
        kv = self.kv_dtype or self.dtype
        if not (k.dtype == v.dtype == self.dtype and k_cache.dtype == v_cache.dtype == kv):
            return f"dtypes {k.dtype}/{k_cache.dtype}, kernels built for {self.dtype} with a {kv} cache"
        if not (k.dim() == 3 and k.shape[1:] == v.shape[1:] and k.shape[1] == k_cache.shape[2] and k.shape[2] == D):
            return f"k/v shapes {tuple(k.shape)}/{tuple(v.shape)} against the cache {tuple(k_cache.shape)}"
        if not (
            vec_ok(k)
            and vec_ok(v)
            and cache_ok(k_cache, D)
            and cache_ok(v_cache, D)
            and k_cache.stride(0) == v_cache.stride(0)
        ):
            return "k/v or cache strides or alignment not 16-byte vectorisable"
        return None

    def attention_unsupported(self, out, q, k_cache, v_cache) -> str | None:
        D = self.head_dim
        kv = self.kv_dtype or self.dtype
        if not (q.dtype == out.dtype == self.dtype and k_cache.dtype == v_cache.dtype == kv):
            return f"dtypes {q.dtype}/{k_cache.dtype}, kernels built for {self.dtype} with a {kv} cache"
        if not (q.dim() == 3 and q.shape[2] == D and out.shape == q.shape and k_cache.shape[1] == self.block_size):
            return (
                f"q shape {tuple(q.shape)} / cache {tuple(k_cache.shape)} against head_dim {D}, block {self.block_size}"
            )
        if q.shape[1] % k_cache.shape[2]:
            return f"{q.shape[1]} query heads do not divide into {k_cache.shape[2]} kv heads"
        if not (
            vec_ok(q)
            and vec_ok(out)
            and cache_ok(k_cache, D)
            and cache_ok(v_cache, D)
            and k_cache.stride(0) == v_cache.stride(0)
        ):
            return "q/out or cache strides or alignment not 16-byte vectorisable"
        return None

    # ---- write_kv ---------------------------------------------------------------------
    def write_kv(self, k, v, k_cache, v_cache, slot_mapping, kv_scales: torch.Tensor | None = None) -> None:
        """kv_scales: this layer's {k_scale, v_scale} (an fp8 cache; None: 1)."""
        T = k.shape[0]
        if T == 0:
            return
        reason = self.write_kv_unsupported(k, v, k_cache, v_cache)
        if reason is not None:
            self._decline("write_kv", reason)
            write_kv_reference(k, v, k_cache, v_cache, slot_mapping, *scale_pair(kv_scales))
            return
        D = self.head_dim
        slots = slot_mapping
        if slots.dtype != torch.int64 or not slots.is_contiguous():
            slots = slots.to(torch.int64).contiguous()
        hkv = k.shape[1]
        total = T * hkv * (D // 8)
        grid = min((total + 255) // 256, self.num_sms * 16)
        self.write_kv_l(
            (grid, 1, 1),
            self._stream(k.device),
            (
                k.data_ptr(),
                v.data_ptr(),
                k_cache.data_ptr(),
                v_cache.data_ptr(),
                slots.data_ptr(),
                T,
                hkv,
                D,
                self.block_size,
                k.stride(0),
                k.stride(1),
                v.stride(0),
                v.stride(1),
                k_cache.stride(0),
                *self._scales_arg(kv_scales),
            ),
        )

    # ---- split-KV plan ------------------------------------------------------------------
    def decode_plan(self, num_seqs: int, num_heads: int, num_kv_heads: int, max_blocks: int) -> DecodePlan:
        """The split plan of one decode launch. Host-only and graph-stable: batch, heads, table
        width and the kernel's occupancy only (never the live sequence lengths)."""
        v2 = self.decode_kernel == "v2"
        min_tok = self.decode_min_tokens or (V2_MIN_TOKENS_PER_SPLIT if v2 else V1_MIN_TOKENS_PER_SPLIT)
        key = (num_seqs, num_heads, num_kv_heads, max_blocks, min_tok, self.decode_ctas_per_sm)
        plan = self._plans.get(key)
        if plan is None:
            group = num_heads // num_kv_heads
            g = next((x for x in DECODE_GROUPS if x >= group), DECODE_GROUPS[-1])
            slices = -(-group // g)
            work = num_seqs * num_kv_heads * slices
            rows = num_seqs * num_heads
            # no more splits than the partial-result scratch holds (v2: merge tickets too)
            cap = min(MAX_SPLITS, self.scratch_floats // (rows * self.head_dim), self.part_lse.numel() // rows)
            if v2 and work > self.counters.numel():
                cap = 1
            cps = self.decode_ctas_per_sm or self.occupancy[g]
            splits = plan_decode_splits(work, max_blocks * self.block_size, cps, self.num_sms, min_tok, max(cap, 1))
            plan = DecodePlan(g, slices, splits, min_tok)
            self._plans[key] = plan
        return plan

    # ---- attention --------------------------------------------------------------------
    def attention(
        self,
        out,
        q,
        k_cache,
        v_cache,
        query_start_loc,
        seq_lens,
        block_tables,
        scale: float,
        max_query_len: int,
        max_seq_len: int,
        num_decodes: int = 0,
        kv_scales: torch.Tensor | None = None,
    ) -> None:
        """kv_scales: this layer's {k_scale, v_scale} (an fp8 cache; None: 1)."""
        T, Hq, D = q.shape
        B = seq_lens.shape[0]
        if T == 0:
            return
        if B == 0:
            out.zero_()
            return
        reason = self.attention_unsupported(out, q, k_cache, v_cache)
        if reason is not None:
            self._decline("paged attention", reason)
            out.copy_(
                paged_attention_reference(
                    q,
                    k_cache,
                    v_cache,
                    query_start_loc,
                    seq_lens,
                    block_tables,
                    scale,
                    max_query_len,
                    max_seq_len,
                    num_decodes,
                    k_scale=scale_pair(kv_scales)[0],
                    v_scale=scale_pair(kv_scales)[1],
                )
            )
            return
        qsl, lens, bt = as_i32(query_start_loc), as_i32(seq_lens), as_block_table(block_tables)
        stream = self._stream(q.device)
        common = dict(
            out=out,
            q=q,
            k_cache=k_cache,
            v_cache=v_cache,
            qsl=qsl,
            lens=lens,
            bt=bt,
            stream=stream,
            scale_log2=float(scale) * LOG2E,
            num_tokens=T,
            scales=self._scales_arg(kv_scales),
        )
        for launch in plan_attention_launches(B, int(max_query_len), int(num_decodes)):
            if launch.kind == "decode":
                self._launch_decode(launch.seq_start, launch.num_seqs, launch.zero_tail, **common)
            else:
                self._launch_prefill(launch.seq_start, launch.num_seqs, launch.zero_tail, max_query_len, **common)

    def _launch_decode(
        self, start, n, zero_tail, *, out, q, k_cache, v_cache, qsl, lens, bt, stream, scale_log2, num_tokens, scales
    ):
        Hq, hkv, max_blocks = q.shape[1], k_cache.shape[2], bt.shape[1]
        plan = self.decode_plan(n, Hq, hkv, max_blocks)
        ptrs = sequence_pointers(start, out, q, k_cache, v_cache, qsl, lens, bt)
        ntok = num_tokens if zero_tail else 0  # only the call's last launch zeroes the padding rows
        scratch = (self.part_out.data_ptr(), self.part_lse.data_ptr())
        counters = self.counters.data_ptr() if self.decode_kernel == "v2" else None
        args = decode_args(ptrs, scratch, counters, plan, q, out, k_cache, bt, scale_log2, ntok, scales)
        self.decode_l[plan.group]((plan.splits, hkv * plan.slices, n), stream, args)
        if counters is None and plan.splits > 1:  # v1 merges the splits in a second launch
            self.combine_l((Hq, n, 1), stream, combine_args(out, ptrs, scratch, Hq, max_blocks, plan.splits))

    def _launch_prefill(
        self,
        start,
        n,
        zero_tail,
        max_query_len,
        *,
        out,
        q,
        k_cache,
        v_cache,
        qsl,
        lens,
        bt,
        stream,
        scale_log2,
        num_tokens,
        scales,
    ):
        ptrs = sequence_pointers(start, out, q, k_cache, v_cache, qsl, lens, bt)
        args = prefill_args(ptrs, q, out, k_cache, bt, scale_log2, num_tokens if zero_tail else 0, scales)
        self.prefill_l((-(-max_query_len // self.block_m), q.shape[1], n), stream, args)


def required_variants(
    dtype: torch.dtype,
    head_dim: int,
    block_size: int,
    decode_kernel: str | None = None,
    prefill_kernel: str | None = None,
    kv_dtype: torch.dtype | None = None,
) -> list[str]:
    return list(attention_variant_names(dtype, head_dim, block_size, decode_kernel, prefill_kernel, kv_dtype).values())


__all__ = ["AttentionKernels", "DecodePlan", "kernels_by_handle", "required_variants"]
