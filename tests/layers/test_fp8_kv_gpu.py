"""The fp8 (e4m3) KV cache variants of kiln's CUTLASS kernels against the torch reference, on a GPU.

write_kv must store exactly the bytes of compiler/kernels/kv_quant.py's quantize_fp8 (x / scale, RNE,
saturated to +-448); decode and prefill read the same fp8 cache as the reference (which
dequantizes in float32) to within the kernels' bf16/fp16 tolerance. The scales are read on the
device: changing them in place changes what a captured CUDA graph computes.
Builds the fp8 variants into <repo>/build/kernels first (a cache hit when already built).
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
from compiler.kernels.kv_quant import FP8_DTYPE, quantize_fp8  # noqa: E402
from compiler.kernels.loader import missing_variants  # noqa: E402
from compiler.kernels.manifest import attention_variant_names  # noqa: E402
from compiler.kernels.reference_attention import paged_attention_reference, write_kv_reference  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
CACHE = REPO / "build" / "kernels"
DEV = torch.device("cuda")
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
SHAPES = [(128, 16), (64, 32), (128, 32), (64, 16)]
TOL = 1e-2


@pytest.fixture(scope="module", autouse=True)
def kernel_cache():
    names = {
        n
        for dt in DTYPES.values()
        for d, bs in SHAPES
        for n in attention_variant_names(dt, d, bs, kv_dtype=FP8_DTYPE).values()
    }
    missing = missing_variants(CACHE, sorted(names))
    if missing and find_nvcc() is not None:
        build_kernels(CACHE, missing, progress=False)
    return CACHE


_LOADED: dict[tuple, cutlass_ops.AttentionKernels] = {}


def kernels(dtype, d, bs, decode="v1", prefill="mma"):
    key = (dtype, d, bs, decode, prefill)
    if key not in _LOADED:
        _LOADED[key] = cutlass_ops.AttentionKernels(
            CACHE, DEV, dtype, d, bs, decode_kernel=decode, prefill_kernel=prefill, kv_dtype=FP8_DTYPE
        )
    return _LOADED[key]


def make_case(seqs, hq, hkv, d, bs, dtype, scales=(0.004, 0.006), seed=0):
    """seqs: (q_len, seq_len) pairs (seq_len 0: padding). A one-layer fp8 cache of random K/V
    quantized with `scales`, blocks randomly permuted, stale junk past each table's end."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    nblk = [-(-s // bs) for _, s in seqs]
    total = sum(nblk) + 8
    perm = (torch.randperm(total - 1, generator=g) + 1).tolist()
    width = max(max(nblk, default=1), 1) + 3
    bt = torch.randint(0, total, (len(seqs), width), generator=g, dtype=torch.int32)
    pos = 0
    for i, n in enumerate(nblk):
        bt[i, :n] = torch.tensor(perm[pos : pos + n], dtype=torch.int32)
        pos += n
    q_lens = [ql for ql, _ in seqs]
    qsl = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32)
    sc = torch.tensor([list(scales)], dtype=torch.float32)
    kc = quantize_fp8(torch.randn(total, bs, hkv, d, generator=g) * 0.5, sc[0, 0])
    vc = quantize_fp8(torch.randn(total, bs, hkv, d, generator=g), sc[0, 1])
    c = dict(
        q=torch.randn(int(qsl[-1]), hq, d, generator=g).to(dtype),
        kv_cache=torch.stack([kc, vc])[None],
        query_start_loc=qsl,
        seq_lens=torch.tensor([s for _, s in seqs], dtype=torch.int32),
        block_tables=bt,
        kv_scales=sc,
    )
    c = {k: v.to(DEV) for k, v in c.items()}
    c.update(
        max_query_len=max(q_lens, default=1), max_seq_len=max((s for _, s in seqs), default=1), scale=1.0 / math.sqrt(d)
    )
    return c


def reference(c):
    return paged_attention_reference(
        c["q"].float(),
        c["kv_cache"][0, 0],
        c["kv_cache"][0, 1],
        c["query_start_loc"],
        c["seq_lens"],
        c["block_tables"],
        c["scale"],
        c["max_query_len"],
        c["max_seq_len"],
        k_scale=c["kv_scales"][0, 0],
        v_scale=c["kv_scales"][0, 1],
    )


def run_kernel(c, k, num_decodes=0):
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
        c["max_query_len"],
        c["max_seq_len"],
        num_decodes,
        k.handle,
        c["kv_scales"],
    )
    torch.cuda.synchronize()
    return out


def check(out, ref, c, label):
    assert not torch.isnan(out).any(), f"{label}: NaN in output"
    qsl, lens = c["query_start_loc"].tolist(), c["seq_lens"].tolist()
    for i in range(len(lens)):
        a, b = qsl[i], qsl[i + 1]
        if a == b:
            continue
        if lens[i] == 0:
            assert torch.all(out[a:b] == 0), f"{label}: padding seq {i} not zero"
            continue
        o, r = out[a:b].float(), ref[a:b].float()
        err = (o - r).norm() / r.norm().clamp_min(1e-6)
        assert err < TOL, f"{label}: seq {i} (q_len {b - a}, seq_len {lens[i]}) rel err {err:.3e}"


@pytest.mark.parametrize("dt", ["bf16", "fp16"])
@pytest.mark.parametrize("d,bs", [(128, 16), (64, 32)])
def test_write_kv_fp8_bytes_equal_the_reference(dt, d, bs):
    dtype = DTYPES[dt]
    kk = kernels(dtype, d, bs)
    hkv, T, nblocks = 4, 203, 40
    g = torch.Generator(device="cpu").manual_seed(1)
    qkv = (torch.randn(T, (8 + 2 * hkv) * d, generator=g) * 3).to(dtype).to(DEV)  # k/v are strided views
    qkv[5, 8 * d] = 1e4  # saturates
    k = qkv[:, 8 * d : (8 + hkv) * d].view(T, hkv, d)
    v = qkv[:, (8 + hkv) * d :].view(T, hkv, d)
    slots = (torch.randperm(nblocks * bs - bs, generator=g)[:T] + bs).to(DEV)
    slots[::7] = -1
    cache = torch.zeros(2, 2, nblocks, bs, hkv, d, dtype=FP8_DTYPE, device=DEV)
    scales = torch.tensor([[1.0, 1.0], [0.01, 0.03]], device=DEV)
    expected = cache.clone()
    write_kv_reference(k, v, expected[1, 0], expected[1, 1], slots, scales[1, 0], scales[1, 1])
    torch.ops.kiln.write_kv_cutlass(k, v, cache, 1, slots, kk.handle, scales)
    torch.cuda.synchronize()
    assert torch.equal(cache.view(torch.uint8), expected.view(torch.uint8))
    assert cache[1, 0].float().abs().max() == 448.0


DECODE_LENS = [1, 15, 16, 17, 127, 128, 129, 511, 513, 2048, 4097, 0]


@pytest.mark.parametrize("path", ["v1", "v2"])
@pytest.mark.parametrize("dt", ["bf16", "fp16"])
@pytest.mark.parametrize("d,bs", SHAPES)
@pytest.mark.parametrize("hq,hkv", [(32, 8), (8, 8), (12, 2), (32, 2)])
def test_fp8_decode_matches_reference(dt, d, bs, hq, hkv, path):
    c = make_case([(1, s) for s in DECODE_LENS], hq, hkv, d, bs, DTYPES[dt])
    check(run_kernel(c, kernels(DTYPES[dt], d, bs, decode=path)), reference(c), c, f"fp8 decode {path}")


@pytest.mark.parametrize("path", ["mma", "wgmma"])
@pytest.mark.parametrize("dt", ["bf16", "fp16"])
@pytest.mark.parametrize("d,bs", SHAPES)
@pytest.mark.parametrize("hq,hkv", [(8, 8), (32, 8), (12, 2)])
def test_fp8_prefill_matches_reference(dt, d, bs, hq, hkv, path):
    seqs = [(1, 1), (17, 17), (64, 64), (100, 300), (130, 130), (5, 700), (0, 0), (64, 1000)]
    c = make_case(seqs, hq, hkv, d, bs, DTYPES[dt], seed=3)
    check(run_kernel(c, kernels(DTYPES[dt], d, bs, prefill=path)), reference(c), c, f"fp8 prefill {path}")


def test_fp8_mixed_batch_dispatch():
    c = make_case([(1, 300), (1, 17), (40, 90), (7, 7)], 16, 4, 128, 16, torch.bfloat16, seed=5)
    check(run_kernel(c, kernels(torch.bfloat16, 128, 16), num_decodes=2), reference(c), c, "fp8 mixed")


@pytest.mark.parametrize("path", ["v1", "v2"])
def test_scales_are_read_on_the_device_in_graph_replay(path):
    """A captured decode follows the scales tensor: changed in place after capture, the replay
    reads the new values (what calibration relies on)."""
    c = make_case([(1, 200), (1, 33)], 16, 4, 128, 16, torch.bfloat16, seed=7)
    kk = kernels(torch.bfloat16, 128, 16, decode=path)
    out = torch.zeros_like(c["q"])
    run = lambda: torch.ops.kiln.paged_attention_cutlass(  # noqa: E731
        out,
        c["q"],
        c["kv_cache"],
        0,
        c["query_start_loc"],
        c["seq_lens"],
        c["block_tables"],
        c["scale"],
        1,
        c["max_seq_len"],
        2,
        kk.handle,
        c["kv_scales"],
    )
    run()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    c["kv_scales"].copy_(torch.tensor([[0.02, 0.5]], device=DEV))
    graph.replay()
    torch.cuda.synchronize()
    check(out, reference(c), c, "fp8 decode after a scale change")
