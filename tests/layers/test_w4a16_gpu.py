"""kiln's W4A16 GEMM (templates/w4a16_gemm.cu.j2) on a GPU: against the dequantised matmul at
decode and prefill shapes, in a CUDA graph and under torch.compile, and a tiny int4 checkpoint
end to end against the tinygemm path.

Uses the cubin in <repo>/build/kernels (built there first where nvcc exists). Tolerance: the
kernel multiplies exact (q - z) by bf16 x with float32 sums and float32 group scales, so it
differs from the float32 reference only by its bf16 output rounding and summation order: 1e-2
of the output's scale.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
if torch.cuda.get_device_capability() != (9, 0):
    pytest.skip("kiln's cubins are sm_90a", allow_module_level=True)
pytest.importorskip("cuda.bindings.driver")

import compiler.kernels.ops  # noqa: E402,F401  (registers kiln::w4a16_gemm)
from compiler.kernels.build import build_kernels, find_nvcc  # noqa: E402
from compiler.kernels.loader import missing_variants  # noqa: E402
from compiler.kernels.w4a16_gemm import W4A16_VARIANT, W4A16Gemm, pack_w4a16  # noqa: E402
from engine.layers.quant import int4_packed, int_formats, w4a16  # noqa: E402
from tests.support.quant import _act_order_g_idx, _layer  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
CACHE = REPO / "build" / "kernels"
DEV = torch.device("cuda")
TOL = 1e-2


@pytest.fixture(scope="module")
def gemm() -> W4A16Gemm:
    if missing_variants(CACHE, [W4A16_VARIANT]) and find_nvcc() is not None:
        build_kernels(CACHE, [W4A16_VARIANT], progress=False)
    return W4A16Gemm(CACHE, DEV)


def _close(y: torch.Tensor, want: torch.Tensor, rel: float = TOL) -> None:
    assert not torch.isnan(y).any()
    err = (y.float() - want.float()).abs().max().item()
    assert err <= rel * want.float().abs().max().item(), err


def _weights(n: int, k: int, group: int, sym: bool, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    qweight = torch.randint(0, 256, (n, k // 2), generator=gen, dtype=torch.uint8)
    scales = (torch.rand(n, k // group, generator=gen) * 0.02 + 0.001).half().float()
    zeros = (
        torch.full_like(scales, 8, dtype=torch.uint8)
        if sym
        else torch.randint(0, 16, scales.shape, generator=gen, dtype=torch.uint8)
    )
    qweight, zeros, scales = qweight.to(DEV), zeros.to(DEV), scales.to(DEV)  # (packing on the GPU: quicker)
    return pack_w4a16(qweight, zeros, scales, group), int_formats.dequantize(qweight, zeros, scales, None, 4)


SHAPES = [  # (tokens, N, K, group, symmetric): decode (8B projections: qkv, o, gate_up, down) and prefill
    (1, 6144, 4096, 128, True),
    (1, 4096, 4096, 128, False),
    (1, 28672, 4096, 64, False),
    (1, 4096, 14336, 128, True),
    (3, 1024, 4096, 64, True),
    (8, 4096, 4096, 128, False),
    (9, 2048, 2048, 64, False),
    (16, 512, 1024, 128, True),
    (33, 4096, 4096, 128, False),
    (64, 1024, 14336, 64, False),
    (300, 1024, 2048, 128, False),
    (2048, 512, 4096, 64, True),
]


@pytest.mark.parametrize(
    "m,n,k,group,sym", SHAPES, ids=[f"m{s[0]}-n{s[1]}-k{s[2]}-g{s[3]}-{'sym' if s[4] else 'asym'}" for s in SHAPES]
)
def test_kernel_matches_dequantised_matmul(gemm, m, n, k, group, sym):
    (packed, scales, zeros), w = _weights(n, k, group, sym)
    x = torch.randn(m, k, device=DEV, dtype=torch.bfloat16)
    out = torch.full((m, n), float("nan"), device=DEV, dtype=torch.bfloat16)
    y = gemm(x, packed, scales, zeros, out=out)
    _close(y, x.float() @ w.t())
    # a strided x (a column slice of a wider buffer) and the op give the same result
    wide = torch.zeros(m, k + 64, device=DEV, dtype=torch.bfloat16)
    wide[:, 64:] = x
    assert torch.equal(torch.ops.kiln.w4a16_gemm(wide[:, 64:], packed, scales, zeros, gemm.handle), y)


@pytest.mark.parametrize(
    "out,inp,group,sym,act",
    [
        (512, 1024, 128, False, True),
        (256, 2048, 64, True, True),
        (384, 1024, -1, False, False),
        (256, 512, 32, True, False),
    ],
)
def test_layer_repack_act_order_and_per_channel(gemm, out, inp, group, sym, act):
    """engine/layers/quant/w4a16.repack on kiln's unpacked layer: act-order as a column permutation,
    per-channel scales over groups of 128; group 32 is refused (the caller falls back to tinygemm)."""
    m = _layer(out, inp, group, sym=sym, g_idx=_act_order_g_idx(inp, group) if act else None).to(DEV)
    w = m.quant.weight(m, torch.float32)
    reason = w4a16.repack(m, gemm, torch.bfloat16)
    if group == 32:
        assert "group size 32" in reason and int4_packed.repack(m, torch.bfloat16) is None
        return
    assert reason is None and (m.w4a16_perm is not None) == act and not hasattr(m, "qweight")
    assert torch.equal(m.quant.weight(m, torch.float32), w)
    x = torch.randn(5, inp, device=DEV, dtype=torch.bfloat16)
    _close(m.quant.apply(m, x), x.float() @ w.t())


def test_graph_capture_and_compile(gemm):
    """The op inside a CUDA graph (output allocated in the capture) replayed after x changes in
    place, and under torch.compile(fullgraph=True)."""
    (packed, scales, zeros), w = _weights(4096, 4096, 128, False, seed=3)
    static_x = torch.zeros(4, 4096, device=DEV, dtype=torch.bfloat16)

    def f(x):
        return torch.ops.kiln.w4a16_gemm(x, packed, scales, zeros, gemm.handle)

    f(static_x)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_y = f(static_x)
    for seed in range(2):
        x = torch.randn(4, 4096, device=DEV, dtype=torch.bfloat16, generator=torch.Generator(DEV).manual_seed(seed))
        static_x.copy_(x)
        graph.replay()
        _close(static_y, x.float() @ w.t())
    compiled = torch.compile(f, fullgraph=True)
    assert torch.equal(compiled(static_x), f(static_x))


def test_tiny_int4_checkpoint_kiln_against_tinygemm(tiny_models, make_llm, tmp_path):
    """A tiny GPTQ int4 checkpoint (group 64, asymmetric, act-order), bf16 on the GPU with decode
    CUDA graphs: int4_kernel=kiln puts every layer on kiln's kernel; its greedy tokens agree with
    the tinygemm path's (>= 90% position by position: bf16 paths of tiny random models flip on
    near-ties, see tests/layers/test_quant_formats.py) and its prompt log-probabilities are no further from
    the float32 dequantised run than tinygemm's (kiln's scales are exact, tinygemm's bf16)."""
    from tests.support.quant import _drift, _greedy
    from tests.support.quant_checkpoints import write_quantized

    quant_dir, ref_dir = write_quantized(
        tiny_models["llama"], tmp_path, "gptq", bits=4, group_size=64, sym=False, act_order=True
    )
    common = dict(device="cuda", dtype="bfloat16", enforce_eager=False, kernel_cache_dir=str(CACHE))
    kiln = make_llm(quant_dir, int4_kernel="kiln", **common)
    qkv = kiln.engine.core.model.layers[0].self_attn.qkv_proj
    assert isinstance(qkv.quant, w4a16.KilnInt4Method) and qkv.w4a16_perm is not None
    tiny = make_llm(quant_dir, int4_kernel="tinygemm", **common)
    assert tiny.engine.core.model.layers[0].self_attn.qkv_proj.quant is int4_packed.PACKED
    got, want = _greedy(kiln), _greedy(tiny)
    same = sum(a == b for g, w in zip(got, want) for a, b in zip(g, w))
    print(f"greedy kiln vs tinygemm: {same} of {sum(map(len, want))} tokens equal")
    assert same >= 0.9 * sum(map(len, want))
    ref = make_llm(ref_dir, device="cuda", dtype="float32", enforce_eager=True)
    assert _drift(kiln, ref) <= _drift(tiny, ref) + 0.01
