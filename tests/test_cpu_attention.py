"""The compiled CPU decode kernel agrees with the reference on random paged inputs."""

from __future__ import annotations

import pytest
import torch

import compiler.ops  # noqa: F401
from compiler.reference_attention import paged_attention_reference


@pytest.mark.parametrize("hq,hkv,bs", [(4, 4, 16), (8, 2, 8)])
def test_compiled_cpu_decode_matches_reference(hq, hkv, bs):
    g = torch.Generator().manual_seed(hq * 100 + hkv * 10 + bs)
    d, num_blocks = 32, 64
    kv = torch.randn(3, 2, num_blocks, bs, hkv, d, generator=g)  # [layers, 2, ...]: layer 1 is attended
    kc, vc = kv[1, 0], kv[1, 1]
    for lens in ([1, 7, bs, bs + 1, 3 * bs - 1], [0, 5, 2 * bs], [4 * bs]):
        s = len(lens)
        width = max(1, -(-max(lens) // bs))
        tables = torch.stack([torch.randperm(num_blocks - 1, generator=g)[:width] + 1 for _ in range(s)]).int()
        seq_lens = torch.tensor(lens, dtype=torch.int32)
        q = torch.randn(s, hq, d, generator=g)
        ref = paged_attention_reference(q, kc, vc, torch.arange(s + 1, dtype=torch.int32), seq_lens, tables,
                                        0.17, 1, max(lens))
        out = torch.full_like(q, float("nan"))
        torch.ops.kiln.paged_attention_cpu(out, q, kv, 1, torch.arange(s + 1, dtype=torch.int32), seq_lens,
                                           tables, 0.17, 1, max(lens))
        assert not out.isnan().any()
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
        assert (out[seq_lens == 0] == 0).all()


def test_mixed_step_splits_decodes_from_chunks():
    g = torch.Generator().manual_seed(7)
    bs, hq, hkv, d, num_blocks = 8, 4, 2, 32, 40
    kv = torch.randn(1, 2, num_blocks, bs, hkv, d, generator=g)
    kc, vc = kv[0, 0], kv[0, 1]
    q_lens, seq_lens = [1, 1, 1, 9, 4], [5, 17, 1, 20, 4]  # three decodes, then two chunks
    tables = torch.stack([torch.randperm(num_blocks - 1, generator=g)[:3] + 1 for _ in q_lens]).int()
    qsl = torch.tensor([0] + list(torch.tensor(q_lens).cumsum(0)), dtype=torch.int32)
    q = torch.randn(int(qsl[-1]) + 2, hq, d, generator=g)  # two unclaimed padding tokens at the end
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    ref = paged_attention_reference(q, kc, vc, qsl, lens, tables, 0.2, 9, 20)  # no split: the definition
    split = paged_attention_reference(q, kc, vc, qsl, lens, tables, 0.2, 9, 20, num_decodes=3)
    torch.testing.assert_close(split, ref, rtol=1e-5, atol=1e-5)
    out = torch.full_like(q, float("nan"))
    torch.ops.kiln.paged_attention_cpu(out, q, kv, 0, qsl, lens, tables, 0.2, 9, 20, 3)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    assert (out[-2:] == 0).all()
