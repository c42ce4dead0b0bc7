"""The C++ CPU attention's tiled prefill (templates/cpu_prefill_tiles.inc) against the reference:
chunks long enough to cross many key blocks of the tile (64 keys) and many cache blocks, every
GQA group size's tile of query vectors (whole register blocks, a remainder, padding lanes), the
causal diagonal, sliding windows that start mid-block, soft-capping, each cache dtype, and a
long chunk against torch's SDPA on contiguous copies."""

from __future__ import annotations

import pytest
import torch

from compiler.kernels.kv_quant import FP8_DTYPE
from tests.support.paged_attention import check_attention as _check
from tests.support.paged_attention import paged_inputs as _paged


@pytest.mark.parametrize(
    "hq,hkv,d",
    [
        (9, 3, 64),  # SmolLM2-135M: 16 rows x 3 heads = 48 query vectors, three registers
        (4, 4, 32),  # MHA: 48 rows a tile
        (8, 2, 128),  # G = 4: 24 rows, 96 vectors
        (5, 1, 96),  # G = 5: 48 rows, 240 vectors (a two-register remainder on AVX-512)
        (16, 2, 256),  # G = 8: 18 rows, 144 vectors
        (7, 7, 64),  # MHA again, with the last tile's query vectors padded
    ],
)
def test_long_chunks_every_group_size(hq, hkv, d):
    """A whole prompt, a chunk continuing a cached context (its first row mid key-block), a short
    prompt (one partial key block) and a decode in one step, on 1 and 2 threads."""
    g = torch.Generator().manual_seed(hq * 31 + d)
    lens, q_lens = [333, 700, 23, 90], [333, 201, 23, 1]
    kv, q, qsl, seq_lens, tables = _paged(g, lens, q_lens, hq, hkv, d, 16)
    before = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            _check(kv, q, qsl, seq_lens, tables, scale=d**-0.5, tol=2e-5)
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("window,softcap,bs", [(100, 0.0, 16), (37, 0.0, 8), (0, 4.0, 32), (70, 2.5, 16)])
def test_windows_and_softcap_across_key_blocks(window, softcap, bs):
    """Windows narrower and wider than a key block: rows of one tile see different first keys,
    so blocks at both ends of the tile's keys are masked."""
    g = torch.Generator().manual_seed(window + bs)
    kv, q, qsl, seq_lens, tables = _paged(g, [400, 260], [150, 260], 9, 3, 64, bs)
    _check(kv, q, qsl, seq_lens, tables, scale=0.125, window=window, softcap=softcap, tol=2e-5)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, FP8_DTYPE])
def test_half_and_fp8_caches(dtype):
    g = torch.Generator().manual_seed(5)
    kv, q, qsl, seq_lens, tables = _paged(g, [300, 129], [170, 129], 9, 3, 64, 16, dtype=dtype)
    _check(kv, q, qsl, seq_lens, tables, scale=0.125, tol=2e-4 if dtype == FP8_DTYPE else 2e-5)
    if dtype != FP8_DTYPE:
        _check(kv, q.to(dtype), qsl, seq_lens, tables, scale=0.125, tol=2e-2)  # half-precision queries


def test_a_long_chunk_matches_sdpa():
    """A 256-row chunk ending at 2,100 keys of a float16 cache (the bench's shape, smaller) equals
    torch's SDPA on contiguous float32 copies of the same keys."""
    g = torch.Generator().manual_seed(9)
    ctx, rows, hq, hkv, d = 2100, 256, 9, 3, 64
    kv, q, qsl, seq_lens, tables = _paged(g, [ctx], [rows], hq, hkv, d, 16, dtype=torch.float16, layers=1)
    out = torch.empty_like(q)
    torch.ops.kiln.paged_attention_cpu(out, q, kv, 0, qsl, seq_lens, tables, d**-0.5, rows, ctx, 0, 0, 0.0)
    ids = tables[0, : -(-ctx // 16)].long()
    k, v = (kv[0, i][ids].reshape(-1, hkv, d)[:ctx].float().transpose(0, 1) for i in (0, 1))
    k, v = (x.repeat_interleave(hq // hkv, 0) for x in (k, v))
    mask = torch.ones(rows, ctx, dtype=torch.bool).tril(ctx - rows)
    want = torch.nn.functional.scaled_dot_product_attention(q.transpose(0, 1), k, v, attn_mask=mask)
    torch.testing.assert_close(out, want.transpose(0, 1), rtol=2e-5, atol=2e-5)
