"""A compiled decode attention for the CPU whose work follows the real context lengths.

The reference (compiler/reference_attention.py) gathers every sequence's blocks into a
[S, ctx, Hkv, D] tensor padded to the batch's longest context and runs SDPA over it. Here the
work items are the KV blocks the sequences actually use, a ragged list: item w is block
`col` of sequence `seq`, for w in [0, total used blocks). Each item's partial softmax (its max,
its sum of exponentials, its exp-weighted sum of values) is computed straight from the cache,
then each sequence rescales and adds its items' partials. Inductor turns both stages into
loops that read each used K and V row once, and nothing past a sequence's last block. It is
used by the torch backend on the CPU when compilation is on, built ahead of time with
AOTInductor (`CpuDecodeKernels`: no Dynamo at run time, nothing to recompile); the reference
stays the definition every implementation is tested against.
"""

from __future__ import annotations

import hashlib
import logging
import os
import tempfile
import time
from pathlib import Path

import torch

from compiler.kv_quant import layer_scales
from compiler.launch_plan import decode_rows
from compiler.reference_attention import paged_attention_reference

logger = logging.getLogger(__name__)

_FLOAT_MIN = torch.finfo(torch.float32).min


def decode_attention_math(q: torch.Tensor, kv: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor,
                          num_items: int, scale: float) -> torch.Tensor:
    """One query per sequence: q [S, Hq, D] over its paged context in kv [2, blocks, bs, Hkv, D]
    -> [S, Hq, D]. num_items is the number of blocks the sequences use plus at least one
    (decode_inputs): the items past the used blocks are empty."""
    k_cache, v_cache = kv[0], kv[1]
    num_seqs, num_heads, head_dim = q.shape
    num_blocks, block_size, num_kv_heads = k_cache.shape[0], k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    columns = block_tables.shape[1]
    lens = seq_lens.long()
    used = (lens + block_size - 1) // block_size  # [S] blocks per sequence
    # Which sequence and block each item is, as small masked sums (S x S, W x S, W x C) rather
    # than cumsum/searchsorted/gather: Inductor fuses them into the kernel and stores their
    # results, so the hot loops load one index per item instead of recomputing a chain of
    # dependent lookups per element (measured: ~20% of the kernel). O(W (S + C)) integer ops
    # against O(W bs Hq D) for the attention itself.
    s_idx = torch.arange(num_seqs, device=q.device)
    ends = torch.where(s_idx[None, :] <= s_idx[:, None], used[None, :], 0).sum(1)  # [S] inclusive cumsum
    first = ends - used  # each sequence's first item
    item = torch.arange(num_items, device=q.device)
    seq = (ends[None, :] <= item[:, None]).sum(1).clamp_max(num_seqs - 1)  # [W]
    col = (item - first[seq]).clamp(0, columns - 1)
    c = torch.arange(columns, device=q.device)
    # Clamped, so no table entry can make a read leave the cache (Inductor's own bounds checks
    # are off, see _INDUCTOR_OPTIONS); block 0 or a stale id is read and masked, never trusted.
    blocks = torch.where(c[None, :] == col[:, None], block_tables[seq].long(), 0).sum(1).clamp(0, num_blocks - 1)
    fill = torch.where(item < ends[-1], lens[seq] - col * block_size, 0)  # real slots of each item
    valid = torch.arange(block_size, device=q.device) < fill[:, None]  # [W, bs]

    # Scores laid out [W, Hkv, G, bs] so max, exp and sum run along a contiguous slot axis;
    # the scale folded into q. Slots past a sequence's length may hold anything (NaN included):
    # their scores are masked to -inf, so their weights are exactly 0, and a value is only
    # multiplied where its weight is not (0 * NaN would be NaN).
    keys = k_cache[blocks].permute(0, 2, 1, 3)[:, :, None]  # [W, Hkv, 1, bs, D]
    qg = (q.float() * scale)[seq].view(num_items, num_kv_heads, group, 1, head_dim)
    scores = (qg * keys.float()).sum(-1).masked_fill(~valid[:, None, None, :], float("-inf"))
    part_max = scores.amax(-1).clamp_min(_FLOAT_MIN)  # [W, Hkv, G]; finite for an empty item
    e = torch.exp(scores - part_max[..., None])
    part_sum = e.sum(-1)  # [W, Hkv, G]
    values = v_cache[blocks].permute(0, 2, 1, 3)[:, :, None].float()  # [W, Hkv, 1, bs, D]
    part_acc = torch.where(e[..., None] > 0, e[..., None] * values, 0.0).sum(-2)  # [W, Hkv, G, D]

    # Each sequence's items, one per block column; columns it does not use name the last item,
    # which is always empty (max FLOAT_MIN, sum 0, values 0).
    seq_items = torch.where(c < used[:, None], first[:, None] + c, num_items - 1)  # [S, C]
    item_max = part_max[seq_items]  # [S, C, Hkv, G]
    weight = torch.exp(item_max - item_max.amax(1, keepdim=True))
    denom = (weight * part_sum[seq_items]).sum(1)  # [S, Hkv, G]; 0 for a padding row (length 0)
    acc = (weight[..., None] * part_acc[seq_items]).sum(1)  # [S, Hkv, G, D]
    out = acc / denom.clamp_min(torch.finfo(torch.float32).tiny)[..., None]  # padding rows: 0 / tiny = 0
    return out.reshape(num_seqs, num_heads, head_dim).to(q.dtype)


# Parallelise every loop whatever sizes the trace saw: small size hints would otherwise make
# Inductor run the softmax and combine loops on one thread. No bounds check per indirect load:
# every index is clamped into range above. Threads read at run time (omp_get_max_threads), not
# baked in, so one build serves every cpu_threads setting.
_INDUCTOR_OPTIONS = {"cpp.min_chunk_size": 1, "assert_indirect_indexing": False, "cpp.dynamic_threads": True}


class _DecodeAttention(torch.nn.Module):
    """What is exported: the item count travels as the length of an empty tensor (export keeps
    tensor sizes symbolic; a plain int would be baked in), q arrives scaled and in float32."""

    def forward(self, q, kv, block_tables, seq_lens, items):
        return decode_attention_math(q, kv, block_tables, seq_lens, items.shape[0], 1.0)


class CpuDecodeKernels:
    """decode_attention_math compiled ahead of time (torch.export + AOTInductor) into one shared
    library per cache layout (KV heads, query group, head dim, block size, KV dtype).

    Batch, block-table width, item count and the pool's block count are symbolic, so neither
    max_model_len nor the pool size nor the thread count changes the build. Builds are kept in
    `cache_dir` under a key of everything that changes the code (this module's kernel source,
    the Inductor options, torch's version, the CPU's vector ISA, the layout), so a warm start
    loads a library in milliseconds and never runs Dynamo or Inductor: the engine's start-up
    warm-up loads (or, on a first start, builds) the one its model needs; `builds` counts the
    builds of this process (tests check that serving adds none).
    """

    def __init__(self) -> None:
        self.cache_dir: Path | None = None
        self.loaded: dict[tuple, object] = {}
        self.builds = 0
        self.build_seconds = 0.0

    def configure(self, cache_dir: Path) -> None:
        self.cache_dir = Path(cache_dir)

    @staticmethod
    def layout(q: torch.Tensor, kv: torch.Tensor) -> tuple:
        num_heads, head_dim = q.shape[1], q.shape[2]
        num_kv_heads, block_size = kv.shape[3], kv.shape[2]
        return num_kv_heads, num_heads // num_kv_heads, head_dim, block_size, str(kv.dtype).removeprefix("torch.")

    @staticmethod
    def key(layout: tuple) -> str:
        import inspect

        parts = [inspect.getsource(decode_attention_math), inspect.getsource(_DecodeAttention),
                 inspect.getsource(CpuDecodeKernels._build),
                 repr(sorted(_INDUCTOR_OPTIONS.items())), torch.__version__,
                 torch.backends.cpu.get_cpu_capability(), repr(layout)]
        return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:20]

    def runner(self, q: torch.Tensor, kv: torch.Tensor):
        directory = self.cache_dir or Path(tempfile.gettempdir()) / f"kiln-cpu-attention-{os.getuid()}"
        where = (directory, self.layout(q, kv))  # each cache directory gets its own build
        found = self.loaded.get(where)
        if found is None:
            found = self.loaded[where] = self._load_or_build(*where)
        return found

    def _load_or_build(self, directory: Path, layout: tuple):
        path = directory / "cpu-attention" / f"{self.key(layout)}.pt2"
        if not path.is_file():
            t0 = time.perf_counter()
            logger.info("compiling the CPU decode attention for %s (first start only, cached in %s)",
                        _describe(layout), path.parent)
            self._build(layout, path)
            self.builds += 1
            self.build_seconds += time.perf_counter() - t0
            logger.info("compiled the CPU decode attention in %.1fs", time.perf_counter() - t0)
        return torch._C._aoti.AOTIModelPackageLoader(str(path), "model", False, 1, -1)

    @staticmethod
    def _build(layout: tuple, path: Path) -> None:
        num_kv_heads, group, head_dim, block_size, dtype = layout
        kv = torch.zeros(2, 3, block_size, num_kv_heads, head_dim, dtype=getattr(torch, dtype))
        q = torch.zeros(2, num_kv_heads * group, head_dim)
        tables = torch.ones(2, 2, dtype=torch.int32)
        lens = torch.zeros(2, dtype=torch.int32)
        # Traced at size 2 (export specialises sizes 0 and 1), valid from 1 up: one decode row and a
        # one-column table need no padding.
        seqs, cols = torch.export.Dim("seqs", min=1), torch.export.Dim("cols", min=1)
        items, blocks = torch.export.Dim("items", min=2), torch.export.Dim("blocks", min=2)
        with torch.no_grad():
            program = torch.export.export(_DecodeAttention(), (q, kv, tables, lens, torch.empty(2, 0)), dynamic_shapes={
                "q": {0: seqs}, "kv": {1: blocks}, "block_tables": {0: seqs, 1: cols}, "seq_lens": {0: seqs},
                "items": {0: items}})
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.stem}.{os.getpid()}.tmp.pt2")
        from torch._inductor import aoti_compile_and_package

        aoti_compile_and_package(program, package_path=str(tmp), inductor_configs=dict(_INDUCTOR_OPTIONS))
        os.replace(tmp, path)  # atomic: a concurrent start sees a whole file or none


def _describe(layout: tuple) -> str:
    num_kv_heads, group, head_dim, block_size, dtype = layout
    return f"{num_kv_heads} KV heads x {group} queries, head dim {head_dim}, block {block_size}, {dtype}"


KERNELS = CpuDecodeKernels()


def compiled_decode_attention(q: torch.Tensor, kv: torch.Tensor, block_tables: torch.Tensor,
                              seq_lens: torch.Tensor, num_items: int, scale: float,
                              k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None) -> torch.Tensor:
    """decode_attention_math through the ahead-of-time build for this cache layout (inputs from
    decode_inputs). The scales are applied here, so one build serves every model of the layout:
    an fp8 cache's k_scale is folded into q and its v_scale into the output (the kernel reads
    the raw elements; softmax(q.(s k)) (s' v) = s' softmax((s q).k) v)."""
    if not kv.is_contiguous():  # the build assumes a whole layer of a contiguous cache
        raise ValueError("compiled_decode_attention: kv must be contiguous (one layer of the KV cache)")
    runner = KERNELS.runner(q, kv)
    qs = q.float() * scale
    if k_scale is not None:
        qs = qs * k_scale
    inputs = [qs, kv, block_tables.to(torch.int32).contiguous(),
              seq_lens.to(torch.int32).contiguous(), torch.empty(num_items, 0)]
    out = runner.boxed_run(inputs)[0]
    if v_scale is not None:
        out = out * v_scale
    return out.to(q.dtype)


def decode_inputs(q: torch.Tensor, seq_lens: torch.Tensor, block_tables: torch.Tensor, max_seq_len: int,
                  block_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """The kernel's inputs for decode rows (CPU tensors): (q, block_tables, seq_lens, num_items).
    Only the block-table columns max_seq_len can reach (at least one); num_items counts the used
    blocks plus one empty item (at least two). Any row count from one up (the build is valid from
    one row and one column: no padding). The only host work is that count, in plain Python: a
    few dozen ints, once per layer."""
    needed = -(-max_seq_len // block_size)
    if needed > block_tables.shape[1]:
        raise ValueError(f"max_seq_len {max_seq_len} needs {needed} block-table columns, the table has "
                         f"{block_tables.shape[1]}")
    lens = seq_lens.tolist()
    if max(lens, default=0) > max_seq_len:
        raise ValueError(f"a decode's seq_len {max(lens)} exceeds max_seq_len {max_seq_len}")
    num_items = max(sum((n + block_size - 1) // block_size for n in lens) + 1, 2)
    tables = block_tables[:, :max(1, needed)]
    return q, tables, seq_lens, num_items


def paged_attention_cpu_impl(out: torch.Tensor, q: torch.Tensor, kv_cache: torch.Tensor, layer: int,
                             query_start_loc: torch.Tensor, seq_lens: torch.Tensor, block_tables: torch.Tensor,
                             scale: float, max_query_len: int, max_seq_len: int, num_decodes: int = 0,
                             kv_scales: torch.Tensor | None = None) -> None:
    """kiln::paged_attention_cpu's implementation (compiler/ops.py), callable without the custom-op
    dispatch from an eager forward: the decodes (the leading one-token sequences) go through the
    compiled kernel, prefill chunks through the reference. Only the block-table columns that
    max_seq_len can reach are read (the runner's table is as wide as max_model_len allows).
    kv_scales: an fp8 cache's per-layer scales (compiler/kv_quant.py)."""
    num_tokens, num_seqs = q.shape[0], seq_lens.shape[0]
    nd = decode_rows(num_seqs, max_query_len, num_decodes)  # the same split as the CUDA kernels'
    kv = kv_cache[layer]  # [2, blocks, block_size, kv_heads, head_dim]: one view, not two
    k_scale, v_scale = layer_scales(kv_scales, layer)
    if nd > 0:
        dq, tables, lens, num_items = decode_inputs(q[:nd], seq_lens[:nd], block_tables[:nd], max_seq_len,
                                                    kv.shape[2])
        out[:nd] = compiled_decode_attention(dq, kv, tables, lens, num_items, scale, k_scale, v_scale)
    if num_tokens > nd:
        out[nd:] = paged_attention_reference(
            q[nd:], kv[0], kv[1], query_start_loc[nd:] - nd, seq_lens[nd:], block_tables[nd:],
            scale, max_query_len, max_seq_len, k_scale=k_scale, v_scale=v_scale)
