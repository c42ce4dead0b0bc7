"""Pure-torch paged attention: the reference every kernel is checked against.

Layouts (shared by every backend):
  q            [num_tokens, num_heads, head_dim]
  k/v cache    [num_blocks, block_size, num_kv_heads, head_dim]
  query_start_loc int32 [num_seqs + 1]   token offsets of each sequence's query chunk
  seq_lens     int32 [num_seqs]          context length *including* the chunk
  block_tables int32 [num_seqs, max_blocks_per_seq]
The causal mask is aligned bottom-right: query i of a chunk of length L in a sequence
of length S sits at position S - L + i and sees keys 0 ..= S - L + i; with a sliding
window W > 0, only the last W of those (keys > position - W, as transformers masks).
Sequences with seq_len 0 (graph padding) produce zeros.
An fp8 cache (compiler/kernels/kv_quant.py) stores x / scale and is read back as element * scale, with
the layer's k_scale / v_scale (0-d tensors; None: 1).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from compiler.kernels.kv_quant import byte_view, from_cache, to_cache


def write_kv_reference(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    """Scatter k/v rows [T, Hkv, D] into their slots (quantized for an fp8 cache).

    Slot -1 means "skip". Block 0 is the engine's null block (never handed to a
    sequence), so skipped rows are routed to slot 0 instead of filtering them out:
    that keeps the op free of host syncs and safe inside a CUDA graph.
    """
    num_blocks, block_size = k_cache.shape[0], k_cache.shape[1]
    flat_k = byte_view(k_cache.view(num_blocks * block_size, *k_cache.shape[2:]))
    flat_v = byte_view(v_cache.view(num_blocks * block_size, *v_cache.shape[2:]))
    slots = slot_mapping.long().clamp_min(0)
    flat_k.index_copy_(0, slots, byte_view(to_cache(k, k_cache.dtype, k_scale)))
    flat_v.index_copy_(0, slots, byte_view(to_cache(v, v_cache.dtype, v_scale)))


def paged_attention_reference(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    max_query_len: int,
    max_seq_len: int,
    num_decodes: int = 0,
    sliding_window: int = 0,
    softcap: float = 0.0,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Batched gather + SDPA over the paged cache; returns [num_tokens, num_heads, head_dim].
    An fp8 cache is dequantized with k_scale / v_scale (None: 1) as it is gathered.
    softcap > 0: scores become softcap * tanh(scores / softcap) before the softmax (Gemma 2).

    max_query_len / max_seq_len are host-side upper bounds (they size the padding);
    num_decodes: how many leading sequences have exactly one query token (0 = unknown).
    Nothing here syncs with the device.
    """
    num_tokens, num_heads, head_dim = q.shape
    num_seqs = seq_lens.shape[0]
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    if num_tokens == 0 or num_seqs == 0:
        return torch.zeros_like(q)
    if 0 < num_decodes < num_seqs:
        # A mixed step: padding every decode to the longest prefill chunk would multiply the
        # work, so the decodes and the chunks are attended separately.
        nd = num_decodes
        decodes = paged_attention_reference(
            q[:nd],
            k_cache,
            v_cache,
            query_start_loc[: nd + 1],
            seq_lens[:nd],
            block_tables[:nd],
            scale,
            1,
            max_seq_len,
            sliding_window=sliding_window,
            softcap=softcap,
            k_scale=k_scale,
            v_scale=v_scale,
        )
        chunks = paged_attention_reference(
            q[nd:],
            k_cache,
            v_cache,
            query_start_loc[nd:] - nd,
            seq_lens[nd:],
            block_tables[nd:],
            scale,
            max_query_len,
            max_seq_len,
            sliding_window=sliding_window,
            softcap=softcap,
            k_scale=k_scale,
            v_scale=v_scale,
        )
        return torch.cat([decodes, chunks])
    device = q.device
    max_blocks = min(block_tables.shape[1], -(-max(max_seq_len, 1) // block_size))
    ctx = max_blocks * block_size
    tables = block_tables[:, :max_blocks].reshape(-1).long().clamp_min(0)
    # Half precision on the CPU is slow and loose: compute there in float32.
    compute = torch.float32 if device.type == "cpu" else q.dtype
    # [S, ctx, Hkv, D] -> [S, Hkv, ctx, D]
    keys = _gather(k_cache, tables, compute, k_scale).view(num_seqs, ctx, num_kv_heads, head_dim).transpose(1, 2)
    values = _gather(v_cache, tables, compute, v_scale).view(num_seqs, ctx, num_kv_heads, head_dim).transpose(1, 2)
    lens = seq_lens.long()
    key_pos = torch.arange(ctx, device=device)
    # Slots past a sequence's length hold whatever an earlier owner left, NaN included, and a
    # zero weight times NaN is NaN: clear them rather than trust the mask alone.
    stale = (key_pos[None, :] >= lens[:, None])[:, None, :, None]
    keys = keys.masked_fill(stale, 0.0)
    values = values.masked_fill(stale, 0.0)
    gqa = num_heads != num_kv_heads

    if max_query_len == 1 and num_tokens == num_seqs:
        # Pure decode: one query per sequence, no padding of queries needed.
        mask = key_pos[None, :] < lens[:, None]
        if sliding_window > 0:
            mask = mask & (key_pos[None, :] >= (lens - sliding_window)[:, None])
        empty = lens == 0
        mask = mask | (empty[:, None] & (key_pos[None, :] == 0))
        out = _attend(
            q[:, :, None, :].to(compute),
            keys.to(compute),
            values.to(compute),
            attn_mask=mask[:, None, None, :],
            scale=scale,
            enable_gqa=gqa,
            softcap=softcap,
        )
        return out[:, :, 0, :].to(q.dtype).masked_fill(empty[:, None, None], 0.0)

    starts = query_start_loc[:-1].long()
    q_lens = (query_start_loc[1:] - query_start_loc[:-1]).long()
    max_q = max(max_query_len, 1)
    rows = torch.arange(max_q, device=device)
    # Token index for each padded query row; padded rows read token 0 and are dropped.
    row_valid = rows[None, :] < q_lens[:, None]  # [S, max_q]
    tok_idx = torch.where(row_valid, starts[:, None] + rows[None, :], torch.zeros_like(rows)[None, :])
    qp = q[tok_idx.reshape(-1)].reshape(num_seqs, max_q, num_heads, head_dim).transpose(1, 2)

    q_pos = (lens - q_lens)[:, None] + rows[None, :]  # absolute position of each query row
    mask = (key_pos[None, None, :] <= q_pos[:, :, None]) & (key_pos[None, None, :] < lens[:, None, None])
    mask = mask & row_valid[:, :, None]
    if sliding_window > 0:
        mask = mask & (key_pos[None, None, :] > q_pos[:, :, None] - sliding_window)
    # A row with nothing to see (padding) attends to key 0 and is zeroed afterwards.
    empty = ~mask.any(dim=-1, keepdim=True)
    mask = mask | (empty & (key_pos[None, None, :] == 0))

    out = _attend(
        qp.to(compute),
        keys.to(compute),
        values.to(compute),
        attn_mask=mask[:, None, :, :],
        scale=scale,
        enable_gqa=gqa,
        softcap=softcap,
    )
    out = out.to(q.dtype).masked_fill(empty[:, None, :, :], 0.0)
    out = out.transpose(1, 2)  # [S, max_q, H, D]
    result = torch.zeros_like(q)
    flat_valid = row_valid.reshape(-1)
    dest = torch.where(flat_valid, tok_idx.reshape(-1), torch.full_like(tok_idx.reshape(-1), num_tokens))
    padded = torch.cat([result, result.new_zeros(1, num_heads, head_dim)], dim=0)
    padded.index_copy_(0, dest, out.reshape(-1, num_heads, head_dim))
    return padded[:num_tokens]


def _gather(
    cache: torch.Tensor, tables: torch.Tensor, compute: torch.dtype, scale: torch.Tensor | None
) -> torch.Tensor:
    """The blocks `tables` names, as `compute` values (an fp8 cache dequantized)."""
    rows = byte_view(cache).index_select(0, tables)
    return from_cache(rows.view(cache.dtype), compute, scale)


def _attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    attn_mask: torch.Tensor,
    scale: float,
    enable_gqa: bool,
    softcap: float = 0.0,
) -> torch.Tensor:
    """SDPA, or with softcap > 0 the same product written out: SDPA has no score capping."""
    if softcap <= 0:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, scale=scale, enable_gqa=enable_gqa)
    if enable_gqa and k.shape[1] != q.shape[1]:
        k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
        v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    scores = softcap * torch.tanh(scores / softcap)
    scores = scores.masked_fill(~attn_mask, -float("inf"))
    return torch.matmul(scores.softmax(dim=-1), v.float()).to(q.dtype)
