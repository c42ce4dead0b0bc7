"""A compiled decode attention for the CPU: the gather through the block table fused into
the two reductions, so no padded copy of the context is ever materialised.

The reference (compiler/reference_attention.py) gathers every sequence's blocks into a
padded [S, ctx, Hkv, D] tensor and runs SDPA over it: three passes over the context. Under
Inductor, the expression below becomes loops that read each K and V row once, straight from
the cache. It is used by the torch backend on the CPU when compilation is on; the reference
stays the definition every implementation is tested against.
"""

from __future__ import annotations

import functools

import torch


def decode_attention_math(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                          block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """One query per sequence: q [S, Hq, D] over its paged context -> [S, Hq, D]."""
    num_seqs, num_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    ctx = block_tables.shape[1] * block_size
    pos = torch.arange(ctx, device=q.device)
    blocks = block_tables.long()[:, pos // block_size].clamp_min(0)  # [S, ctx]
    offsets = pos % block_size
    lens = seq_lens.long()
    valid = pos[None, :] < lens[:, None]  # [S, ctx]
    # Scores laid out [S, Hkv, G, ctx] so max, exp and sum run along a contiguous ctx (full
    # vectors, not a 4-lane masked tail over the heads); scale folded into q; the normalisation
    # applied once per output row instead of per position inside the P@V reduction.
    # Stale slots past a sequence's length may hold anything (NaN included): read them as 0.
    keep = valid[:, None, None, :, None]
    # [S, Hkv, 1, ctx, D] views of the cache, gathered lazily (fused into the reductions)
    keys = torch.where(keep, k_cache[blocks, offsets].float().permute(0, 2, 1, 3)[:, :, None], 0.0)
    values = torch.where(keep, v_cache[blocks, offsets].float().permute(0, 2, 1, 3)[:, :, None], 0.0)
    qg = (q.float() * scale).view(num_seqs, num_kv_heads, group, 1, head_dim)
    scores = (qg * keys).sum(-1)  # [S, Hkv, G, ctx]
    scores = scores.masked_fill(~valid[:, None, None, :], float("-inf"))
    m = scores.amax(-1, keepdim=True).clamp_min(torch.finfo(torch.float32).min)
    e = torch.exp(scores - m)  # [S, Hkv, G, ctx]
    denom = e.sum(-1)  # [S, Hkv, G]
    acc = (e[..., None] * values).sum(-2)  # [S, Hkv, G, D]
    out = acc / denom.clamp_min(torch.finfo(torch.float32).tiny)[..., None]
    out = torch.where((lens == 0)[:, None, None, None], torch.zeros_like(out), out)  # padding rows
    return out.reshape(num_seqs, num_heads, head_dim).to(q.dtype)


@functools.cache
def _compiled():
    return torch.compile(decode_attention_math, backend="inductor", fullgraph=True, dynamic=True)


def compiled_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                              block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """decode_attention_math under Inductor, compiled once per process for every batch and
    context size: the cache's block shape is static; its block count (so a persistent compile
    cache is hit whatever the pool size), the batch and the block columns are symbolic and
    never tied to each other by a coincidence of sizes at trace time (no duck sizing), and
    neither batch nor columns is ever 1 (decode_inputs pads). The model's start-up warm-up
    reaches this through the same path as serving, so serving never compiles it again."""
    for cache in (k_cache, v_cache):
        for dim in (1, 2, 3):
            torch._dynamo.mark_static(cache, dim)
    with torch.fx.experimental._config.patch(use_duck_shape=False):
        return _compiled()(q, k_cache, v_cache, block_tables, seq_lens, scale)


def decode_inputs(q: torch.Tensor, seq_lens: torch.Tensor, block_tables: torch.Tensor,
                  max_seq_len: int, block_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The kernel's inputs for decode rows: at least two rows and two block columns (Dynamo
    specialises size 1), only the columns max_seq_len can reach, int64 indices."""
    columns = min(block_tables.shape[1], max(2, -(-max_seq_len // block_size)))
    lens = seq_lens.to(torch.int64)
    tables = block_tables[:, :columns].to(torch.int64)
    if q.shape[0] == 1:  # a padding row: length 0, output 0
        q = torch.cat([q, torch.zeros_like(q)])
        lens = torch.cat([lens, torch.zeros_like(lens)])
        tables = torch.cat([tables, tables])
    return q, lens, tables
