"""kiln's CUTLASS/CuTe attention kernels against the torch reference, on a GPU.

Builds the kernels it needs into <repo>/build/kernels first (a cache hit when already
built; where nvcc is absent the cubins must have been built there beforehand with
`python -m compiler.kernels.cli --cache-dir build/kernels`).
Every output is NaN-poisoned before the kernel runs; the reference runs in float32.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
pytest.importorskip("cuda.bindings.driver")

from compiler.kernels import cutlass_ops  # noqa: E402
from compiler.kernels.build import build_kernels, find_nvcc  # noqa: E402
from compiler.kernels.loader import missing_variants  # noqa: E402
from compiler.kernels.manifest import attention_variant_names  # noqa: E402
from compiler.kernels.reference_attention import paged_attention_reference  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
CACHE = REPO / "build" / "kernels"
DEV = torch.device("cuda")
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
TOL = 1e-2


@pytest.fixture(scope="module", autouse=True)
def kernel_cache():
    names = []
    for dt in DTYPES.values():
        for d in (64, 128):
            for bs in (16, 32):
                names += attention_variant_names(dt, d, bs).values()
    missing = missing_variants(CACHE, sorted(set(names)))  # a cache hit needs no nvcc (and no build race
    if missing and find_nvcc() is not None:  # between pytest-xdist workers)
        build_kernels(CACHE, missing, progress=False)
    return CACHE


_LOADED: dict[tuple, cutlass_ops.AttentionKernels] = {}


def kernels(dtype, d, bs, decode=None, min_tokens=None, ctas_per_sm=None, prefill=None):
    """AttentionKernels of one generation (decode "v1"/"v2", prefill "mma"/"wgmma"; None: the
    settings' defaults), loaded once per module; min_tokens/ctas_per_sm override the split policy."""
    key = (dtype, d, bs, decode or "v1", prefill or "mma")
    k = _LOADED.get(key)
    if k is None:
        k = _LOADED[key] = cutlass_ops.AttentionKernels(
            CACHE, DEV, dtype, d, bs, decode_kernel=key[3], prefill_kernel=key[4]
        )
    k.decode_min_tokens = min_tokens
    k.decode_ctas_per_sm = ctas_per_sm
    return k


DECODE_PATHS = ["v1", "v2"]
PREFILL_PATHS = ["mma", "wgmma"]


# ---- inputs -----------------------------------------------------------------------------


def make_case(seqs, hq, hkv, d, bs, dtype, *, extra_cols=3, tail_tokens=0, seed=0):
    """seqs: list of (q_len, seq_len); seq_len 0 = padding row. Blocks randomly permuted."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    nblk_per = [-(-s // bs) for _, s in seqs]
    total_blocks = sum(nblk_per) + 8
    perm = (torch.randperm(total_blocks - 1, generator=g) + 1).tolist()  # block 0 = null block
    width = max(max(nblk_per, default=1), 1) + extra_cols
    bt = torch.randint(0, total_blocks, (len(seqs), width), generator=g, dtype=torch.int32)  # stale junk
    pos = 0
    for i, n in enumerate(nblk_per):
        bt[i, :n] = torch.tensor(perm[pos : pos + n], dtype=torch.int32)
        pos += n
    q_lens = [ql for ql, _ in seqs]
    qsl = torch.tensor([0] + list(torch.tensor(q_lens).cumsum(0).tolist()), dtype=torch.int32)
    T = int(qsl[-1]) + tail_tokens
    kc = (torch.randn(total_blocks, bs, hkv, d, generator=g) * 0.5).to(dtype)
    vc = torch.randn(total_blocks, bs, hkv, d, generator=g).to(dtype)
    q = torch.randn(T, hq, d, generator=g).to(dtype)
    lens = torch.tensor([s for _, s in seqs], dtype=torch.int32)
    c = dict(q=q, kv_cache=torch.stack([kc, vc])[None], query_start_loc=qsl, seq_lens=lens, block_tables=bt)
    c = {k: v.to(DEV) for k, v in c.items()}
    c["k_cache"], c["v_cache"] = c["kv_cache"][0, 0], c["kv_cache"][0, 1]  # views of the one-layer cache
    c["max_query_len"] = max(q_lens, default=1)
    c["max_seq_len"] = max((s for _, s in seqs), default=1)
    c["scale"] = 1.0 / math.sqrt(d)
    return c


def reference(c):
    return paged_attention_reference(
        c["q"].float(),
        c["k_cache"].float(),
        c["v_cache"].float(),
        c["query_start_loc"],
        c["seq_lens"],
        c["block_tables"],
        c["scale"],
        c["max_query_len"],
        c["max_seq_len"],
    )


def run_kernel(c, k, max_query_len=None, num_decodes=0):
    out = torch.full_like(c["q"], float("nan"))
    torch.ops.kiln.paged_attention_cutlass(
        out,
        c["q"],
        c["kv_cache"],
        0,
        c["query_start_loc"],
        c["seq_lens"],
        c["block_tables"],
        c["scale"],
        c["max_query_len"] if max_query_len is None else max_query_len,
        c["max_seq_len"],
        num_decodes,
        k.handle,
    )
    torch.cuda.synchronize()
    return out


def check(out, ref, c, label):
    """Per-sequence relative error (so one wrong sequence in a big batch cannot hide)."""
    assert not torch.isnan(out).any(), (
        f"{label}: NaN in output at rows {torch.isnan(out).any(-1).any(-1).nonzero().flatten()[:10].tolist()}"
    )
    qsl = c["query_start_loc"].tolist()
    lens = c["seq_lens"].tolist()
    o, r = out.float(), ref.float()
    for i in range(len(lens)):
        a, b = qsl[i], qsl[i + 1]
        if a == b:
            continue
        if lens[i] == 0:
            assert torch.all(o[a:b] == 0), f"{label}: padding seq {i} not zero"
            continue
        err = (o[a:b] - r[a:b]).norm() / r[a:b].norm().clamp_min(1e-6)
        assert err < TOL, (
            f"{label}: seq {i} (q_len {b - a}, seq_len {lens[i]}) rel err {err:.3e}; "
            f"worst head {(o[a:b] - r[a:b]).abs().amax(dim=(0, 2)).argmax().item()}"
        )
    if qsl[-1] < out.shape[0]:
        assert torch.all(o[qsl[-1] :] == 0), f"{label}: unclaimed tail tokens not zero"


# ---- write_kv ---------------------------------------------------------------------------


@pytest.mark.parametrize("dt", ["bf16", "fp16"])
@pytest.mark.parametrize("d,bs", [(128, 16), (64, 32)])
def test_write_kv_exact(dt, d, bs):
    dtype = DTYPES[dt]
    kk = kernels(dtype, d, bs)
    hkv, T, nblocks = 4, 203, 40
    g = torch.Generator(device="cpu").manual_seed(1)
    qkv = torch.randn(T, (8 + 2 * hkv) * d, generator=g).to(dtype).to(DEV)  # k/v are strided views
    k = qkv[:, 8 * d : (8 + hkv) * d].view(T, hkv, d)
    v = qkv[:, (8 + hkv) * d :].view(T, hkv, d)
    slots = torch.randperm(nblocks * bs - bs, generator=g)[:T] + bs  # never the null block
    slots[::7] = -1
    slots = slots.to(DEV)
    big = torch.randn(2, 2, nblocks, bs, hkv, d, generator=g).to(dtype).to(DEV)  # [layers, 2, ...]
    kc, vc = big[1, 0], big[1, 1]
    exp_k, exp_v = kc.clone().view(-1, hkv, d), vc.clone().view(-1, hkv, d)
    keep = slots >= 0
    exp_k[slots[keep]] = k[keep]
    exp_v[slots[keep]] = v[keep]
    other = big[0].clone()
    torch.ops.kiln.write_kv_cutlass(k, v, big, 1, slots, kk.handle)
    torch.cuda.synchronize()
    assert torch.equal(kc.reshape(-1, hkv, d), exp_k), "K cache differs from the expected scatter"
    assert torch.equal(vc.reshape(-1, hkv, d), exp_v), "V cache differs from the expected scatter"
    assert torch.equal(big[0], other), "write_kv touched another layer"


# ---- decode -----------------------------------------------------------------------------

DECODE_LENS = [1, 15, 16, 17, 31, 32, 33, 127, 128, 129, 300, 511, 512, 513, 1000, 2048, 4097, 0]


@pytest.mark.parametrize("path", DECODE_PATHS)
@pytest.mark.parametrize("dt", ["bf16", "fp16"])
@pytest.mark.parametrize("d,bs", [(128, 16), (64, 32), (128, 32), (64, 16)])
@pytest.mark.parametrize("hq,hkv", [(32, 8), (8, 8), (16, 2), (12, 2), (32, 2)])
def test_decode_matches_reference(dt, d, bs, hq, hkv, path):
    dtype = DTYPES[dt]
    kk = kernels(dtype, d, bs, decode=path)
    c = make_case([(1, s) for s in DECODE_LENS], hq, hkv, d, bs, dtype, seed=hq + d + bs)
    check(run_kernel(c, kk), reference(c), c, f"decode[{path}] {dt} D{d} bs{bs} {hq}/{hkv}")


@pytest.mark.parametrize("path", DECODE_PATHS)
@pytest.mark.parametrize("batch,ctx", [(1, 32768), (3, 32000), (64, 2048), (256, 300)])
def test_decode_split_regimes(batch, ctx, path):
    dtype, d, bs = torch.bfloat16, 128, 16
    kk = kernels(dtype, d, bs, decode=path)
    g = torch.Generator().manual_seed(batch)
    lens = [max(1, ctx - int(x)) for x in torch.randint(0, max(ctx // 3, 1), (batch,), generator=g)]
    c = make_case([(1, s) for s in lens], 32, 8, d, bs, dtype, seed=batch)
    check(run_kernel(c, kk), reference(c), c, f"decode[{path}] B{batch} ctx{ctx}")


# v2's split policy is a run-time parameter: every setting the bench sweeps must be correct,
# including extreme ones (many tiny splits -> the in-kernel last-split merge does all the work).
@pytest.mark.parametrize(
    "min_tokens,ctas_per_sm", [(16, 64), (64, 16), (128, 12), (256, 4), (512, 2), (1024, 1), (4096, 8)]
)
@pytest.mark.parametrize("d,bs,hq,hkv", [(128, 16, 32, 8), (64, 32, 16, 2), (128, 32, 8, 8), (64, 16, 32, 2)])
def test_decode_v2_split_policies(min_tokens, ctas_per_sm, d, bs, hq, hkv):
    dtype = torch.bfloat16
    kk = kernels(dtype, d, bs, decode="v2", min_tokens=min_tokens, ctas_per_sm=ctas_per_sm)
    try:
        c = make_case([(1, s) for s in DECODE_LENS + [3000, 8191]], hq, hkv, d, bs, dtype, seed=min_tokens + d)
        ref = reference(c)
        for rep in range(2):  # the second launch relies on the merge tickets having been reset to 0
            check(run_kernel(c, kk), ref, c, f"decode[v2 min_tok={min_tokens} cps={ctas_per_sm}] rep {rep}")
        assert int(kk.counters.abs().sum()) == 0, "merge tickets not reset"
    finally:
        kernels(dtype, d, bs, decode="v2")  # back to the default split policy


@pytest.mark.parametrize("path", DECODE_PATHS)
def test_decode_padding_and_unclaimed_tokens(path):
    dtype, d, bs = torch.float16, 128, 16
    kk = kernels(dtype, d, bs, decode=path)
    c = make_case([(1, 40), (1, 0), (0, 0), (1, 700), (1, 0)], 8, 2, d, bs, dtype, tail_tokens=3, seed=5)
    check(run_kernel(c, kk), reference(c), c, f"decode[{path}] padding")


# ---- prefill ----------------------------------------------------------------------------

PREFILL_SEQS = [
    (1, 1),
    (5, 5),
    (16, 16),
    (17, 17),
    (64, 64),
    (65, 65),
    (127, 127),
    (200, 200),
    (37, 100),
    (64, 1000),
    (1, 50),
    (130, 163),
    (1, 17),
    (0, 0),
    (1, 0),
    (3, 33),
]


@pytest.mark.parametrize("path", PREFILL_PATHS)
@pytest.mark.parametrize("dt", ["bf16", "fp16"])
@pytest.mark.parametrize("d,bs", [(128, 16), (64, 32), (128, 32), (64, 16)])
@pytest.mark.parametrize("hq,hkv", [(8, 8), (16, 4), (16, 2)])
def test_prefill_matches_reference(dt, d, bs, hq, hkv, path):
    dtype = DTYPES[dt]
    kk = kernels(dtype, d, bs, prefill=path)
    c = make_case(PREFILL_SEQS, hq, hkv, d, bs, dtype, tail_tokens=2, seed=hq * 7 + d + bs)
    check(run_kernel(c, kk), reference(c), c, f"prefill[{path}] {dt} D{d} bs{bs} {hq}/{hkv}")


@pytest.mark.parametrize("path", PREFILL_PATHS)
def test_prefill_long_context_chunk(path):
    dtype, d, bs = torch.bfloat16, 128, 16
    kk = kernels(dtype, d, bs, prefill=path)
    c = make_case([(256, 32768), (300, 300), (1, 5000)], 8, 2, d, bs, dtype, seed=11)
    check(run_kernel(c, kk), reference(c), c, f"prefill[{path}] 32k")


@pytest.mark.parametrize("path", PREFILL_PATHS)
def test_prefill_full_tiles_and_gqa(path):
    """Whole 128-row tiles, several key tiles, 4:1 GQA, fp16 and bf16."""
    for dt, d in (("bf16", 128), ("fp16", 64)):
        dtype = DTYPES[dt]
        kk = kernels(dtype, d, 16, prefill=path)
        c = make_case([(512, 512), (256, 1024), (129, 129), (384, 700)], 16, 4, d, 16, dtype, seed=21)
        check(run_kernel(c, kk), reference(c), c, f"prefill[{path}] tiles {dt} D{d}")


@pytest.mark.parametrize("path", PREFILL_PATHS)
def test_dispatch_mixed_batch_uses_prefill_and_matches(path):
    dtype, d, bs = torch.bfloat16, 64, 16
    kk = kernels(dtype, d, bs, prefill=path)
    c = make_case([(1, 90), (40, 40), (1, 1), (1, 2000)], 8, 4, d, bs, dtype, seed=3)
    check(run_kernel(c, kk), reference(c), c, f"mixed[{path}]")


@pytest.mark.parametrize("decode,prefill", [("v1", "mma"), ("v2", "wgmma"), ("v2", "mma")])
def test_mixed_step_decode_rows_take_the_decode_kernel(decode, prefill):
    """num_decodes leading one-token rows go to the decode kernel, the rest to the prefill kernel
    (two launches, the tail zeroed once); the result equals the reference either way."""
    dtype, d, bs = torch.bfloat16, 128, 16
    kk = kernels(dtype, d, bs, decode=decode, prefill=prefill)
    seqs = [(1, 2000), (1, 1), (1, 4097), (1, 300), (37, 100), (64, 64), (1, 20), (5, 5)]
    c = make_case(seqs, 32, 8, d, bs, dtype, tail_tokens=3, seed=31)
    ref = reference(c)
    for nd in (0, 2, 4):  # num_decodes never over-claims: rows after it take the prefill kernel
        check(run_kernel(c, kk, num_decodes=nd), ref, c, f"mixed[{decode}/{prefill}] num_decodes={nd}")


@pytest.mark.parametrize("path", DECODE_PATHS)
def test_strided_block_table_is_read_in_place(path):
    """The runner passes a column slice of its wider block-table buffer: no copy, same result."""
    dtype, d, bs = torch.bfloat16, 64, 16
    kk = kernels(dtype, d, bs, decode=path)
    for max_q in (1, 40):
        seqs = [(1, 700), (1, 33), (1, 129)] if max_q == 1 else [(1, 700), (40, 40), (1, 129)]
        c = make_case(seqs, 16, 4, d, bs, dtype, seed=41)
        bt = c["block_tables"]
        wide = torch.full((bt.shape[0], bt.shape[1] + 13), 7, dtype=torch.int32, device=DEV)
        wide[:, : bt.shape[1]] = bt
        c["block_tables"] = wide[:, : bt.shape[1]]
        assert not c["block_tables"].is_contiguous()
        check(run_kernel(c, kk, num_decodes=1), reference(c), c, f"strided table [{path}] max_q={max_q}")


@pytest.mark.parametrize("path", DECODE_PATHS)
def test_more_sequences_than_the_grid_holds(path):
    """Over 65,535 sequences in one call: the launches are chunked (the grid's z limit)."""
    dtype, d, bs, B = torch.bfloat16, 64, 16, 66_000
    kk = kernels(dtype, d, bs, decode=path)
    g = torch.Generator(device="cpu").manual_seed(5)
    lens = torch.randint(1, 40, (B,), generator=g, dtype=torch.int32)
    nblk = (lens + bs - 1) // bs
    starts = torch.cumsum(nblk, 0) - nblk + 1
    bt = (starts[:, None] + torch.arange(3)[None, :]).to(torch.int32)
    total = int(starts[-1] + 3)
    kv = torch.randn(1, 2, total, bs, 4, d, generator=g).to(dtype)
    c = dict(
        q=torch.randn(B, 4, d, generator=g).to(dtype),
        kv_cache=kv,
        query_start_loc=torch.arange(B + 1, dtype=torch.int32),
        seq_lens=lens,
        block_tables=bt,
    )
    c = {k: v.to(DEV) for k, v in c.items()}
    c.update(
        k_cache=c["kv_cache"][0, 0],
        v_cache=c["kv_cache"][0, 1],
        max_query_len=1,
        max_seq_len=39,
        scale=1 / math.sqrt(d),
    )
    out = run_kernel(c, kk)
    ref = reference(c)
    err = (out.float() - ref.float()).norm() / ref.float().norm()
    assert not torch.isnan(out).any() and err < TOL, f"chunked decode [{path}]: rel err {err:.3e}"


def test_declined_inputs_raise_inside_graph_capture():
    """Inputs the kernels cannot take run the reference eagerly, but raise inside CUDA-graph capture."""
    dtype, d, bs = torch.bfloat16, 64, 16
    kk = kernels(dtype, d, bs)
    c = make_case([(1, 40), (1, 70)], 8, 2, d, bs, dtype, seed=2)
    c["q"] = c["q"].float()  # wrong dtype: declined
    out = torch.empty_like(c["q"])
    args = (
        out,
        c["q"],
        c["kv_cache"],
        0,
        c["query_start_loc"],
        c["seq_lens"],
        c["block_tables"],
        c["scale"],
        1,
        70,
        0,
        kk.handle,
    )
    torch.ops.kiln.paged_attention_cutlass(*args)  # eager: the reference, with a warning
    graph = torch.cuda.CUDAGraph()
    with pytest.raises(RuntimeError, match="captured CUDA graph"):
        with torch.cuda.graph(graph):
            torch.ops.kiln.paged_attention_cutlass(*args)


# ---- CUDA graph + torch.compile ------------------------------------------------------------


@pytest.mark.parametrize("path", DECODE_PATHS)
def test_cuda_graph_replay_after_in_place_updates(path):
    dtype, d, bs, hq, hkv, B = torch.bfloat16, 128, 16, 8, 2, 6
    kk = kernels(dtype, d, bs, decode=path)
    width, nblocks = 256, 1600
    g = torch.Generator().manual_seed(7)
    kv = torch.randn(1, 2, nblocks, bs, hkv, d, generator=g).to(dtype).to(DEV)
    kc, vc = kv[0, 0], kv[0, 1]
    q = torch.zeros(B, hq, d, dtype=dtype, device=DEV)
    k = torch.zeros(B, hkv, d, dtype=dtype, device=DEV)
    v = torch.zeros(B, hkv, d, dtype=dtype, device=DEV)
    slots = torch.full((B,), -1, dtype=torch.int64, device=DEV)
    qsl = torch.arange(B + 1, dtype=torch.int32, device=DEV)
    lens = torch.zeros(B, dtype=torch.int32, device=DEV)
    bt = torch.zeros(B, width, dtype=torch.int32, device=DEV)
    out = torch.zeros(B, hq, d, dtype=dtype, device=DEV)
    scale = 1.0 / math.sqrt(d)

    def step():
        torch.ops.kiln.write_kv_cutlass(k, v, kv, 0, slots, kk.handle)
        torch.ops.kiln.paged_attention_cutlass(out, q, kv, 0, qsl, lens, bt, scale, 1, 64, 0, kk.handle)

    def set_inputs(new_lens, seed):
        gg = torch.Generator().manual_seed(seed)
        perm = torch.randperm(nblocks - 1, generator=gg) + 1
        tab = torch.zeros(B, width, dtype=torch.int32)
        for i in range(B):  # disjoint rows: no two sequences share a block
            tab[i] = perm[i * width : (i + 1) * width]
        sl = []
        for i, L in enumerate(new_lens):
            sl.append(-1 if L == 0 else int(tab[i, (L - 1) // bs]) * bs + (L - 1) % bs)
        bt.copy_(tab)
        lens.copy_(torch.tensor(new_lens, dtype=torch.int32))
        slots.copy_(torch.tensor(sl))
        q.copy_(torch.randn(B, hq, d, generator=gg).to(dtype))
        k.copy_(torch.randn(B, hkv, d, generator=gg).to(dtype))
        v.copy_(torch.randn(B, hkv, d, generator=gg).to(dtype))

    def verify(label):
        torch.cuda.synchronize()
        flat_k = kc.view(-1, hkv, d)
        for i, s in enumerate(slots.tolist()):
            if s >= 0:
                assert torch.equal(flat_k[s], k[i]), f"{label}: write_kv missed seq {i}"
        c = dict(
            q=q,
            k_cache=kc,
            v_cache=vc,
            query_start_loc=qsl,
            seq_lens=lens,
            block_tables=bt,
            max_query_len=1,
            max_seq_len=int(lens.max()),
            scale=scale,
        )
        check(out.clone(), reference(c), c, label)

    set_inputs([16, 100, 1, 0, 37, 64], seed=1)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        step()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for n, new in enumerate(
        [
            [16, 100, 1, 0, 37, 64],  # as captured
            [17, 101, 2, 5, 38, 65],  # grow: 16->17 crosses a block boundary
            [3000, 4000, 129, 0, 2048, 4095],  # one split -> many splits
            [1, 1, 1, 1, 1, 1],
        ]
    ):
        set_inputs(new, seed=10 + n)
        out.fill_(float("nan"))
        graph.replay()
        verify(f"graph replay [{path}] {n} lens={new}")


@pytest.mark.parametrize("path", DECODE_PATHS)
def test_ops_inside_torch_compile_fullgraph(path):
    dtype, d, bs = torch.float16, 64, 16
    kk = kernels(dtype, d, bs, decode=path)
    c = make_case([(1, 70), (1, 300), (1, 5)], 8, 2, d, bs, dtype, seed=4)
    T = c["q"].shape[0]
    k = torch.randn(T, 2, d, device=DEV).to(dtype)
    v = torch.randn(T, 2, d, device=DEV).to(dtype)
    bt = c["block_tables"]
    slots = torch.tensor(
        [int(bt[i, (L - 1) // bs]) * bs + (L - 1) % bs for i, L in enumerate([70, 300, 5])], device=DEV
    )

    def f(q, k, v, kv, slots, qsl, lens, bt):
        torch.ops.kiln.write_kv_cutlass(k, v, kv, 0, slots, kk.handle)
        out = torch.empty_like(q)
        torch.ops.kiln.paged_attention_cutlass(out, q, kv, 0, qsl, lens, bt, c["scale"], 1, 300, 0, kk.handle)
        return out * 2.0

    kc_ref, vc_ref = c["k_cache"].clone(), c["v_cache"].clone()
    compiled = torch.compile(f, fullgraph=True)
    got = compiled(c["q"], k, v, c["kv_cache"], slots, c["query_start_loc"], c["seq_lens"], bt)
    torch.cuda.synchronize()
    kc_ref.view(-1, 2, d)[slots] = k
    vc_ref.view(-1, 2, d)[slots] = v
    assert torch.equal(c["k_cache"], kc_ref) and torch.equal(c["v_cache"], vc_ref)
    check(got / 2.0, reference(c), c, "torch.compile")


def test_backend_forward():
    from engine.layers.attention.base import AttentionMetadata, BackendSpec
    from engine.layers.attention.selector import get_attention_backend

    dtype, d, bs = torch.bfloat16, 128, 16
    backend = get_attention_backend("cutlass", BackendSpec(DEV, dtype, d, bs, CACHE))
    c = make_case([(20, 20), (1, 33)], 8, 2, d, bs, dtype, seed=9)
    T = c["q"].shape[0]
    k = torch.randn(T, 2, d, device=DEV).to(dtype)
    v = torch.randn(T, 2, d, device=DEV).to(dtype)
    bt = c["block_tables"]
    pos = list(range(20)) + [32]
    seq = [0] * 20 + [1]
    slots = torch.tensor([int(bt[s, p // bs]) * bs + p % bs for s, p in zip(seq, pos)], device=DEV)
    meta = AttentionMetadata(slots, c["query_start_loc"], c["seq_lens"], bt, 20, 33)
    out = backend.forward(c["q"], k, v, c["kv_cache"], 0, meta, c["scale"])
    torch.cuda.synchronize()
    check(out, reference(c), c, "backend forward")
