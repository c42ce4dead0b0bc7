"""compiler/kernels/launch_plan.py: how a paged-attention call becomes launches (pure Python, any machine)."""

from __future__ import annotations

import pytest

from compiler.kernels.launch_plan import (
    GRID_Z_MAX,
    Launch,
    chunk_ranges,
    ctas_per_sm_from_resources,
    decode_rows,
    plan_attention_launches,
    plan_decode_splits,
    wave_efficiency,
)

H200_SMS = 132


# ---- rows between the decode and the prefill kernel ------------------------------------------


@pytest.mark.parametrize(
    "num_seqs,max_q,num_decodes,expected",
    [
        (8, 1, 0, [Launch("decode", 0, 8, True)]),  # a decode step: everything, whatever num_decodes says
        (8, 1, 3, [Launch("decode", 0, 8, True)]),
        (8, 40, 0, [Launch("prefill", 0, 8, True)]),  # unknown decodes: all through the prefill kernel
        (8, 40, 3, [Launch("decode", 0, 3), Launch("prefill", 3, 5, True)]),
        (8, 40, 8, [Launch("decode", 0, 8, True)]),
        (8, 40, 99, [Launch("decode", 0, 8, True)]),  # never more decode rows than sequences
        (0, 1, 0, []),
    ],
)
def test_mixed_step_split(num_seqs, max_q, num_decodes, expected):
    assert list(plan_attention_launches(num_seqs, max_q, num_decodes)) == expected


def test_decode_rows_matches_the_plan():
    for b in range(0, 6):
        for q in (1, 2, 17):
            for nd in range(0, 8):
                plan = plan_attention_launches(b, q, nd)
                assert sum(x.num_seqs for x in plan if x.kind == "decode") == decode_rows(b, q, nd)
                assert sum(x.num_seqs for x in plan) == b


# ---- the grid's z limit ------------------------------------------------------------------------


def test_chunks_cover_every_sequence_once():
    assert chunk_ranges(0, 0) == []
    assert chunk_ranges(5, 3, limit=2) == [(5, 2), (7, 1)]
    for start, count, limit in [(0, GRID_Z_MAX, GRID_Z_MAX), (3, 131_072, GRID_Z_MAX), (0, 10, 3)]:
        pieces = chunk_ranges(start, count, limit)
        assert all(1 <= n <= limit for _, n in pieces)
        covered = [s + i for s, n in pieces for i in range(n)]
        assert covered == list(range(start, start + count))
    with pytest.raises(ValueError):
        chunk_ranges(0, 4, limit=0)


def test_launches_over_the_grid_limit_are_chunked_and_only_the_last_zeroes_the_tail():
    # the memory profile with chunked prefill off: one sequence per budget token (max_model_len 131,072)
    plan = plan_attention_launches(131_072, 1, 0)
    assert [(x.seq_start, x.num_seqs) for x in plan] == [(0, 65_535), (65_535, 65_535), (131_070, 2)]
    assert all(x.num_seqs <= GRID_Z_MAX for x in plan)
    assert [x.zero_tail for x in plan] == [False, False, True]
    mixed = plan_attention_launches(70_000, 9, 66_000)
    assert [(x.kind, x.seq_start, x.num_seqs) for x in mixed] == [
        ("decode", 0, 65_535),
        ("decode", 65_535, 465),
        ("prefill", 66_000, 4_000),
    ]
    assert [x.zero_tail for x in mixed] == [False, False, True]


# ---- occupancy ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "registers,threads,smem,expected",
    [
        (168, 128, 8320, 3),  # decode GQA-4 (ptxas: 168 registers) -> 3 CTAs per SM, as the review found
        (255, 128, 16640, 2),  # decode GQA-8 (255 registers) -> 2
        (128, 128, 4160, 4),
        (126, 128, 2080, 4),
        (32, 128, 0, 16),  # thread-limited: 2048 threads per SM
        (16, 32, 0, 32),  # CTA-limited: 32 per SM
        (64, 256, 100_000, 2),  # shared-memory-limited: 228 KiB per SM
    ],
)
def test_ctas_per_sm_from_ptxas_resources(registers, threads, smem, expected):
    assert ctas_per_sm_from_resources(registers, threads, smem) == expected


# ---- split-KV sizing to whole waves --------------------------------------------------------------

# (batch, context, q heads, kv heads, registers of the decode variant, min tokens per split,
#  expected splits, expected waves of 132 SMs x occupancy)
SPLIT_CASES = [
    (1, 32768, 32, 8, 168, 128, 49, 0.99),  # the review's case: the 12-CTAs/SM plan gave 1.29 waves
    (1, 32768, 32, 4, 255, 128, 64, 0.97),  # GQA-8, 2 CTAs/SM: the 64-split cap, just under one wave
    (3, 32000, 32, 8, 168, 128, 16, 0.97),
    (4, 2048, 32, 8, 168, 64, 12, 0.97),
    (16, 2048, 32, 8, 168, 128, 3, 0.97),
    (64, 2048, 32, 8, 168, 128, 3, 3.88),  # the 8B decode bench point: 4 waves, the last 88% full
    (64, 32768, 32, 8, 168, 128, 10, 12.93),
    (64, 2048, 32, 4, 255, 128, 1, 0.97),
    (256, 32768, 64, 8, 255, 64, 5, 38.79),  # 70B-style GQA-8
    (16, 4096, 32, 32, 126, 64, 1, 0.97),  # MHA (GQA-1), 4 CTAs/SM
    (1, 2048, 32, 8, 168, 64, 32, 0.65),  # too short to fill the GPU: every split it may have
    # 2048 CTAs at one split already make 5.17 waves; 100-token splits would cost more in overhead
    (256, 300, 32, 8, 168, 128, 1, 5.17),
]


@pytest.mark.parametrize("batch,ctx,hq,hkv,regs,min_tok,expected,waves", SPLIT_CASES)
def test_split_plan_gives_whole_waves(batch, ctx, hq, hkv, regs, min_tok, expected, waves):
    cps = ctas_per_sm_from_resources(regs, 128)
    work = batch * hkv  # (sequence, kv head) pairs; every group here fits one CTA
    cap = min(64, -(-ctx // min_tok))
    splits = plan_decode_splits(work, ctx, cps, H200_SMS, min_tok, 64)
    assert splits == expected
    ctas, wave = work * splits, cps * H200_SMS
    assert ctas / wave == pytest.approx(waves, abs=0.01)
    if work * cap <= wave:
        # less than one wave even at the cap: all of it runs at once, so take every split allowed
        assert splits == cap
    elif work * 1 <= wave:
        # the GPU can be filled: whole waves, under 5% of the launched slots idle
        assert wave_efficiency(ctas, cps, H200_SMS) >= 0.95, (splits, ctas, wave)
    else:
        # more than a wave at one split already: the tail wave is at least 85% full
        assert wave_efficiency(ctas, cps, H200_SMS) >= 0.85, (splits, ctas, wave)


def test_split_plan_fixes_the_reviewed_case():
    """B=1, 32k context, GQA-4 at 3 CTAs/SM: the old plan (12 CTAs/SM assumed) launched 512 CTAs
    = 1.29 waves of 396; the occupancy plan stays within one wave."""
    splits = plan_decode_splits(8, 32768, 3, H200_SMS, 128, 64)
    assert 8 * splits <= 3 * H200_SMS
    assert wave_efficiency(8 * splits, 3, H200_SMS) > 0.95


def test_split_plan_respects_the_cap_and_tiny_inputs():
    assert plan_decode_splits(0, 1000, 3, 132, 128, 64) == 1
    assert plan_decode_splits(4, 1, 3, 132, 128, 64) == 1  # one token: one split
    assert plan_decode_splits(1, 1 << 20, 3, 132, 64, 5) == 5  # never above max_splits
    # more occupancy -> at least as many CTAs per wave are used
    a = plan_decode_splits(8, 32768, 2, 132, 128, 64)
    b = plan_decode_splits(8, 32768, 4, 132, 128, 64)
    assert 8 * a <= 2 * 132 and 8 * b <= 4 * 132 and b >= a
