"""Paged attention inputs with the cache's blocks scattered at random, and the CPU kernel checked
against the reference on them (tests/compiler/test_cpu_attention.py, test_cpu_prefill_tiles.py)."""

from __future__ import annotations

import torch

import compiler.kernels.ops  # noqa: F401  (registers torch.ops.kiln.paged_attention_cpu)
from compiler.kernels.kv_quant import FP8_DTYPE, quantize_fp8
from compiler.kernels.reference_attention import paged_attention_reference


def paged_inputs(g, lens, q_lens, hq, hkv, d, bs, dtype=torch.float32, layers=2, spare=3):
    """A cache with every sequence's blocks scattered at random, stale slots past each length set
    to NaN (or 448 for fp8, which has no NaN to spare), and a query per new token."""
    width = max(1, max(-(-n // bs) for n in lens))
    num_blocks = sum(-(-n // bs) for n in lens) + spare + 1
    kv = torch.randn(layers, 2, num_blocks, bs, hkv, d, generator=g)
    order = (torch.randperm(num_blocks - 1, generator=g) + 1).tolist()
    tables = torch.zeros(len(lens), width, dtype=torch.int32)
    for row, n in enumerate(lens):
        for c in range(-(-n // bs)):
            tables[row, c] = order.pop()
        if n % bs:
            kv[:, :, tables[row, n // bs], n % bs :] = float("nan")
        tables[row, -(-n // bs) :] = order[0]  # columns past the last block name a stale block
    kv[:, :, order[0]] = float("nan")
    if dtype == FP8_DTYPE:
        kv = quantize_fp8(kv.nan_to_num(nan=448.0) * 8, None)
    else:
        kv = kv.to(dtype)
    qsl = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32)
    q = torch.randn(int(qsl[-1]), hq, d, generator=g)
    return kv, q, qsl, torch.tensor(lens, dtype=torch.int32), tables


def check_attention(
    kv, q, qsl, lens, tables, layer=1, scale=0.2, window=0, softcap=0.0, scales=None, num_decodes=0, tol=1e-5
):
    max_q = max(1, int((qsl[1:] - qsl[:-1]).max())) if len(lens) else 1
    max_len = max(1, int(lens.max())) if len(lens) else 1
    out = torch.full_like(q, float("nan"))
    torch.ops.kiln.paged_attention_cpu(
        out, q, kv, layer, qsl, lens, tables, scale, max_q, max_len, num_decodes, window, softcap, kv_scales=scales
    )
    k_scale, v_scale = (None, None) if scales is None else (scales[layer, 0], scales[layer, 1])
    ref = paged_attention_reference(
        q,
        kv[layer, 0],
        kv[layer, 1],
        qsl,
        lens,
        tables,
        scale,
        max_q,
        max_len,
        sliding_window=window,
        softcap=softcap,
        k_scale=k_scale,
        v_scale=v_scale,
    )
    assert not out.isnan().any()
    torch.testing.assert_close(out.float(), ref.float(), rtol=tol, atol=tol)
    return out
