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


def _decode(kv, layer, q, lens, tables, scale=0.2):
    s = q.shape[0]
    out = torch.full_like(q, float("nan"))
    torch.ops.kiln.paged_attention_cpu(out, q, kv, layer, torch.arange(s + 1, dtype=torch.int32),
                                       torch.tensor(lens, dtype=torch.int32), tables, scale, 1, max(max(lens), 1))
    ref = paged_attention_reference(q, kv[layer, 0], kv[layer, 1], torch.arange(s + 1, dtype=torch.int32),
                                    torch.tensor(lens, dtype=torch.int32), tables, scale, 1, max(max(lens), 1))
    return out, ref


def test_ragged_decode_ignores_stale_slots_and_blocks():
    """Slots past a sequence's length and table entries past its last block may hold anything
    (here NaN and a block full of NaN): the kernel never lets them into the result."""
    g = torch.Generator().manual_seed(3)
    bs, hq, hkv, d, num_blocks = 8, 4, 2, 32, 30
    kv = torch.randn(2, 2, num_blocks, bs, hkv, d, generator=g)
    kv[:, :, 29] = float("nan")  # a stale block named past the sequences' lengths
    lens = [3, 8, 9, 17, 0, 1]
    width = 4
    tables = torch.full((len(lens), width), 29, dtype=torch.int32)
    nxt = 1
    for row, n in enumerate(lens):
        for c in range(-(-n // bs)):
            tables[row, c] = nxt
            nxt += 1
        if n % bs:  # the rest of the last block: stale
            kv[:, :, tables[row, n // bs], n % bs:] = float("nan")
    q = torch.randn(len(lens), hq, d, generator=g)
    for layer in (0, 1):
        out, ref = _decode(kv, layer, q, lens, tables)
        assert not out.isnan().any()
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
        assert (out[4] == 0).all()


def test_ragged_decode_compiles_once_for_all_shapes():
    """Batch size, block columns and the item count are symbolic: one graph serves every step,
    also when they happen to be equal to each other (no duck sizing) and on either layer."""
    from compiler.capture import compile_count

    g = torch.Generator().manual_seed(5)
    bs, hq, hkv, d, num_blocks = 16, 4, 2, 32, 200
    kv = torch.randn(2, 2, num_blocks, bs, hkv, d, generator=g)

    def step(lens, layer):
        width = max(1, -(-max(max(lens), 1) // bs))
        tables = torch.randint(1, num_blocks, (len(lens), width), generator=g, dtype=torch.int32)
        q = torch.randn(len(lens), hq, d, generator=g)
        out, ref = _decode(kv, layer, q, lens, tables)
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)

    step([1], 0)  # tiny shapes first, as in the engine's start-up warm-up: compiles if not yet compiled
    step([1, 1, 1], 0)
    before = compile_count()
    cases = [[5], [0, 0], [16, 16], [17, 33], [32, 1, 1], [48] * 3, [100, 7, 250, 3],
             [int(x) for x in torch.randint(0, 400, (37,), generator=g)], [1] * 64]
    for i, lens in enumerate(cases):
        step(lens, i % 2)
    assert compile_count() == before, "the decode kernel recompiled for a new shape"
