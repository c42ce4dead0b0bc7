"""A compiled decode attention for the CPU whose work follows the real context lengths.

The reference (compiler/reference_attention.py) gathers every sequence's blocks into a
[S, ctx, Hkv, D] tensor padded to the batch's longest context and runs SDPA over it. Here the
work items are the KV blocks the sequences actually use, a ragged list: item w is block
`col` of sequence `seq`, for w in [0, total used blocks). Each item's partial softmax (its max,
its sum of exponentials, its exp-weighted sum of values) is computed straight from the cache,
then each sequence rescales and adds its items' partials. Inductor turns both stages into
loops that read each used K and V row once, and nothing past a sequence's last block. It is
used by the torch backend on the CPU when compilation is on; the reference stays the
definition every implementation is tested against.
"""

from __future__ import annotations

import functools

import torch
import torch.fx.experimental._config as _fx_config

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


# Parallelise every loop whatever sizes the first (warm-up) trace saw: its tiny size hints
# would otherwise make Inductor run the softmax and combine loops on one thread. No bounds
# check per indirect load: every index is clamped into range above.
_INDUCTOR_OPTIONS = {"cpp.min_chunk_size": 1, "assert_indirect_indexing": False}


@functools.cache
def _compiled():
    return torch.compile(decode_attention_math, backend="inductor", fullgraph=True, dynamic=True,
                         options=_INDUCTOR_OPTIONS)


def compiled_decode_attention(q: torch.Tensor, kv: torch.Tensor, block_tables: torch.Tensor,
                              seq_lens: torch.Tensor, num_items: int, scale: float) -> torch.Tensor:
    """decode_attention_math under Inductor, compiled once per process for every batch and
    context size: the cache's block shape and the head shape are static; the cache's block count
    (so a persistent compile cache is hit whatever the pool size), the batch, the block columns
    and the item count are symbolic and never tied to each other by a coincidence of sizes at
    trace time (no duck sizing), and none is ever 1 (decode_inputs pads). The model's start-up
    warm-up reaches this through the same path as serving, so serving never compiles it again."""
    for dim in (0, 2, 3, 4):
        torch._dynamo.mark_static(kv, dim)
    for dim in (1, 2):
        torch._dynamo.mark_static(q, dim)
    # Set and restored by hand: config.patch() builds a context class per call, and this runs
    # once per layer per step.
    duck = _fx_config.use_duck_shape
    _fx_config.use_duck_shape = False
    try:
        return _compiled()(q, kv, block_tables, seq_lens, num_items, scale)
    finally:
        _fx_config.use_duck_shape = duck


def decode_inputs(q: torch.Tensor, seq_lens: torch.Tensor, block_tables: torch.Tensor, max_seq_len: int,
                  block_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """The kernel's inputs for decode rows (CPU tensors): (q, block_tables, seq_lens, num_items).
    At least two rows and two block columns (Dynamo specialises size 1), only the columns
    max_seq_len can reach; num_items counts the used blocks plus one empty item (at least two).
    The only host work is that count, in plain Python: a few dozen ints, once per layer."""
    needed = -(-max_seq_len // block_size)
    if needed > block_tables.shape[1]:
        raise ValueError(f"max_seq_len {max_seq_len} needs {needed} block-table columns, the table has "
                         f"{block_tables.shape[1]}")
    lens = seq_lens.tolist()
    if max(lens, default=0) > max_seq_len:
        raise ValueError(f"a decode's seq_len {max(lens)} exceeds max_seq_len {max_seq_len}")
    num_items = max(sum((n + block_size - 1) // block_size for n in lens) + 1, 2)
    tables = block_tables[:, :max(2, needed)]
    if tables.shape[1] < 2:  # a one-column table: a second column is never read
        tables = torch.cat([tables, tables], 1)
    if q.shape[0] == 1:  # a padding row: length 0, output 0
        q = torch.cat([q, torch.zeros_like(q)])
        seq_lens = torch.cat([seq_lens, torch.zeros_like(seq_lens)])
        tables = torch.cat([tables, tables])
    return q, tables, seq_lens, num_items
