"""kiln's W4A16 GEMM on the CPU: the load-time layout (compiler/kernels/w4a16_gemm.py: pack_w4a16), read
back exactly as templates/w4a16_gemm.cu.j2 reads it, and the int4 kernel choice
(engine/layers/quant/w4a16.py). The kernel itself runs in tests/layers/test_w4a16_gpu.py."""

from __future__ import annotations

import pytest
import torch

from compiler.kernels.w4a16_gemm import pack_w4a16, unpack_w4a16, w4a16_unsupported
from engine.layers.quant import int_formats
from engine.layers.quant.w4a16 import choose_int4_kernel, kernel_group, loader_int4_kernel


def _int4(out: int, inp: int, group: int, sym: bool, seed: int = 0):
    """Random kiln-layout int4 buffers: qweight uint8 [out, inp / 2], zeros uint8, scales float32."""
    gen = torch.Generator().manual_seed(seed)
    groups = inp // group
    qweight = torch.randint(0, 256, (out, inp // 2), generator=gen, dtype=torch.uint8)
    scales = (torch.rand(out, groups, generator=gen) * 0.02 + 0.001).half().float()
    zeros = (
        torch.full((out, groups), 8, dtype=torch.uint8)
        if sym
        else torch.randint(0, 17, (out, groups), generator=gen, dtype=torch.uint8)
    )  # (GPTQ v1 zeros reach 16)
    return qweight, zeros, scales


def _bf16_bits(v: torch.Tensor) -> torch.Tensor:
    """int32 values holding 16-bit patterns -> those bf16 values."""
    return v.to(torch.int16).view(torch.bfloat16)  # (bit patterns < 0x8000 here: no sign wrap)


def _kernel_fragments(packed: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor):
    """The kernel's A fragments, built from the buffers with the kernel's own indexing and arithmetic.

    Returns a [N, K / 64, 4 steps, 16 slots] tensor of the dequantised q - z (bf16 values, as the
    MMA sees them), a [K / 64, 4, 16] map of each slot's physical column in its chunk, and the
    per-(row, chunk) scale. Lane l = 4 g + t reads words w[0..3] (16 bytes); for step s it takes
    word s // 2 (row g) and 2 + s // 2 (row g + 8), nibble pair p = 2 (s % 2) into slots 2t, 2t+1
    (register a0 / a1) and p + 1 into slots 2t + 8, 2t + 9 (a2 / a3): value ((w >> 4p) & 0x000F000F)
    | 0x43004300 as bf16x2, minus bf16x2 (0x4300 + z)."""
    nt, chunks = packed.shape[:2]
    n = 16 * nt
    groups = scales.shape[0]
    cpg = chunks // groups
    words = packed.view(nt, chunks, 32, 4, 4).to(torch.int64)
    words = words[..., 0] | words[..., 1] << 8 | words[..., 2] << 16 | words[..., 3] << 24  # [nt, ch, lane, 4]
    frag = torch.zeros(n, chunks, 4, 16, dtype=torch.bfloat16)
    col = torch.zeros(4, 16, dtype=torch.long)
    zero_of = (0x4300 + zeros.to(torch.int64)).t()  # [N, groups] (kernel: (0x4300 + z) * 0x10001)
    rows = torch.arange(16 * nt).view(nt, 2, 8)  # [nt, half, g]
    for s in range(4):
        for lane in range(32):
            g, t = divmod(lane, 4)
            for half in range(2):
                w = words[:, :, lane, 2 * half + s // 2]  # [nt, ch]
                r = rows[:, half, g]  # [nt]
                z = zero_of[r][:, torch.arange(chunks) // cpg]  # [nt, ch]
                for reg, p in ((0, 2 * (s % 2)), (1, 2 * (s % 2) + 1)):
                    pair = ((w >> (4 * p)) & 0x000F000F) | 0x43004300
                    for j in range(2):  # .x (low 16 bits): slot 2t (+8), .y: slot 2t + 1 (+8)
                        slot = 2 * t + 8 * reg + j
                        v = _bf16_bits((pair >> (16 * j)) & 0xFFFF) - _bf16_bits(z)
                        frag[r, :, s, slot] = v
    for s in range(4):  # the column each slot reads from x: thread t's b0 = x[16t + 4s + {0,1}], b1 = +{2,3}
        for t in range(4):
            for reg in range(2):
                for j in range(2):
                    col[s, 2 * t + 8 * reg + j] = 16 * t + 4 * s + 2 * reg + j
    scale = scales.t()[:, torch.arange(chunks) // cpg]  # [N, ch]
    return frag, col, scale


@pytest.mark.parametrize(
    "out,inp,group,sym", [(32, 256, 64, False), (48, 512, 128, True), (16, 384, 128, False), (32, 256, 256, False)]
)
def test_layout_read_as_the_kernel_reads_it_is_the_dequantised_weight(out, inp, group, sym):
    """Bit for bit: (q - z) from the kernel's nibble/zero arithmetic, placed at the column its MMA
    slot stands for, times its group's scale (float32) == int_formats.dequantize."""
    qweight, zeros, scales = _int4(out, inp, group, sym)
    packed, scales_t, zeros_t = pack_w4a16(qweight, zeros, scales, group)
    assert packed.shape == (out // 16, inp // 64, 32, 16) and scales_t.shape == zeros_t.shape == (inp // group, out)
    frag, col, scale = _kernel_fragments(packed, scales_t, zeros_t)
    w = torch.empty(out, inp)
    for ch in range(inp // 64):
        for s in range(4):
            w[:, 64 * ch + col[s]] = frag[:, ch, s].float() * scale[:, ch : ch + 1]
    want = int_formats.dequantize(qweight, zeros, scales, None, 4)
    assert torch.equal(w, want)
    assert torch.equal(unpack_w4a16(packed, scales_t, zeros_t), want)
    assert sorted(col.flatten().tolist()) == list(range(64))  # each column read once per chunk


def test_gemm_through_the_mma_fragments_matches_the_dequantised_matmul():
    """The kernel's arithmetic, emulated: per 64-column chunk and MMA step, A (fragments) @ B (x at the
    slots' columns) summed per group in float32, then times the group's scale; against x @ W^T."""
    out, inp, group = 32, 512, 128
    qweight, zeros, scales = _int4(out, inp, group, sym=False, seed=4)
    packed, scales_t, zeros_t = pack_w4a16(qweight, zeros, scales, group)
    frag, col, scale = _kernel_fragments(packed, scales_t, zeros_t)
    x = torch.randn(11, inp, generator=torch.Generator().manual_seed(5)).bfloat16()
    cpg = group // 64
    y = torch.zeros(11, out)
    for gi in range(inp // group):
        acc = torch.zeros(11, out)
        for ch in range(gi * cpg, (gi + 1) * cpg):
            for s in range(4):
                b = x[:, 64 * ch + col[s]].float()  # [tokens, 16 slots]
                acc += b @ frag[:, ch, s].float().t()
        y += acc * scale[:, gi * cpg]
    want = x.float() @ int_formats.dequantize(qweight, zeros, scales, None, 4).t()
    assert (y - want).abs().max() <= 1e-4 * want.abs().max()


def test_pack_refuses_what_the_kernel_cannot_take():
    qweight, zeros, scales = _int4(32, 256, 64, sym=True)
    assert w4a16_unsupported(32, 256, 64) is None
    assert "group size 32" in w4a16_unsupported(32, 256, 32)
    assert "multiple of 16" in w4a16_unsupported(24, 256, 64)
    assert "group size 128 with 320" in w4a16_unsupported(32, 320, 128)
    with pytest.raises(ValueError, match="group size 32"):
        pack_w4a16(qweight, torch.zeros(32, 8, dtype=torch.uint8), torch.ones(32, 8), 32)
    with pytest.raises(ValueError, match="below 128"):
        pack_w4a16(qweight, zeros + 128, scales, 64)
    assert kernel_group(4096, -1) == 128 and kernel_group(320, -1) == 64 and kernel_group(4096, 64) == 64


@pytest.mark.parametrize(
    "setting,device,cap,built,want",
    [
        ("auto", "cuda", (9, 0), True, "kiln"),
        ("auto", "cuda", (9, 0), False, "tinygemm"),
        ("auto", "cuda", (8, 0), True, "tinygemm"),
        ("auto", "cuda", (10, 0), True, "tinygemm"),
        ("auto", "cpu", None, False, "tinygemm"),
        ("tinygemm", "cuda", (9, 0), True, "tinygemm"),
        ("reference", "cuda", (9, 0), True, "reference"),
        ("kiln", "cuda", (9, 0), True, "kiln"),
    ],
)
def test_int4_kernel_choice(setting, device, cap, built, want):
    assert choose_int4_kernel(setting, device, cap, built) == want


@pytest.mark.parametrize(
    "device,cap,built,why",
    [("cpu", None, False, "not CUDA"), ("cuda", (8, 9), True, "sm_89"), ("cuda", (9, 0), False, "not built")],
)
def test_int4_kernel_kiln_where_it_cannot_run_is_a_clear_error(device, cap, built, why):
    with pytest.raises(ValueError, match=why):
        choose_int4_kernel("kiln", device, cap, built)
    with pytest.raises(ValueError, match="not one of"):
        choose_int4_kernel("marlin", "cuda", (9, 0), True)


def test_loader_keeps_its_values():
    """The loader's own int4_kernel values: auto repacks for tinygemm while loading, kiln leaves the
    layers unpacked for engine/layers/quant/w4a16.install."""
    assert [loader_int4_kernel(k) for k in ("kiln", "tinygemm", "reference")] == ["kiln", "auto", "reference"]


# ---- engine/layers/quant/w4a16.py: a layer moved into the kernel's layout (no kernel launched here) ----


class _FakeGemm:
    handle = 7

    def __init__(self, cache_dir=None, device=None):
        self.loaded_from = (cache_dir, device)


def _kiln_layer(out, inp, group, sym, act=False, seed=0):
    from engine.layers.linear import Linear
    from engine.layers.quant.config import QuantConfig
    from engine.layers.quant.linear import IntWeightMethod, attach
    from tests.support.quant import _act_order_g_idx

    m = Linear(inp, out, bias=False)
    attach(m, IntWeightMethod(QuantConfig("int", "gptq", 4, group, sym=sym)), "cpu")
    qweight, zeros, scales = _int4(out, inp, group if group > 0 else inp, sym, seed)
    m.qweight.copy_(qweight), m.zeros.copy_(zeros), m.scales.copy_(scales)
    if act:
        m.g_idx.copy_(_act_order_g_idx(inp, group))
        m.act_order = True
    return m


@pytest.mark.parametrize(
    "out,inp,group,sym,act",
    [(64, 512, 128, False, True), (32, 256, 64, True, False), (48, 384, -1, False, False), (32, 4096, -1, True, False)],
)
def test_repack_layer_keeps_the_weight(out, inp, group, sym, act):
    """act-order becomes a column permutation of the packed weight (x is gathered the same way),
    per-channel scales repeat over kernel groups of 128 (64): the dense weight is unchanged, bit for bit."""
    from engine.layers.quant import w4a16

    m = _kiln_layer(out, inp, group, sym, act)
    want = m.quant.weight(m, torch.float32)
    assert w4a16.repack(m, _FakeGemm(), torch.bfloat16) is None
    assert isinstance(m.quant, w4a16.KilnInt4Method) and m.quant.handle == 7
    assert not hasattr(m, "qweight") and (m.w4a16_perm is not None) == act
    assert m.w4a16_scales.shape[0] == inp // w4a16.kernel_group(inp, group)
    assert torch.equal(m.quant.weight(m, torch.float32), want)
    assert m.quant.weight_bytes(m) < inp * out  # (about half a byte a weight plus the groups' 5 bytes)


def test_install_falls_back_per_layer():
    """install: layers the kernel takes go to it, group 32 to tinygemm (here torch's CPU int4 kernel),
    a bf16-incompatible shape stays dequantising; the kernel is loaded once, and not at all without int4 layers."""
    from engine.layers.quant import int4_packed, w4a16

    model = torch.nn.Module()
    model.layers = torch.nn.ModuleList([torch.nn.Module() for _ in range(3)])
    model.layers[0].proj = _kiln_layer(32, 256, 64, False)
    model.layers[1].proj = _kiln_layer(32, 256, 32, True)
    model.layers[2].proj = _kiln_layer(40, 256, 32, True)  # (40 rows: neither kernel)
    model.quantizable_linears = lambda: {f"layers.{i}.proj": layer.proj for i, layer in enumerate(model.layers)}
    loads = []
    left = w4a16.install(model, "cache", "cpu", torch.bfloat16, load_gemm=lambda *a: loads.append(a) or _FakeGemm())
    assert loads == [("cache", "cpu")]
    assert isinstance(model.layers[0].proj.quant, w4a16.KilnInt4Method)
    assert model.layers[1].proj.quant is int4_packed.PACKED
    assert not hasattr(model.layers[2].proj, "w4a16_packed") and hasattr(model.layers[2].proj, "qweight")
    assert sorted(len(v) for v in left.values()) == [1, 1]
    assert any("tinygemm" in r for r in left) and any("dequantised" in r for r in left)
    bare = torch.nn.Module()
    bare.quantizable_linears = dict  # (no int4 layer: the kernel is never loaded)
    assert w4a16.install(bare, "cache", "cpu", torch.bfloat16, load_gemm=lambda *a: 1 / 0) == {}


def test_microbench_sizes_and_cpu_refusal(capsys):
    """engine/bench/w4a16.py (run by gpu_check's w4a16-bench stage): the weight bytes it
    divides by, enough copies to defeat a 50 MB L2, and a clean refusal without CUDA."""
    from engine.bench import w4a16 as w4a16_bench

    assert w4a16_bench.int4_bytes(4096, 4096) == 4096 * 2048 + 4096 * 32 * 5
    assert w4a16_bench.copies_for(w4a16_bench.int4_bytes(4096, 4096)) * 9_043_968 >= 256 << 20
    assert w4a16_bench.copies_for(1 << 30) == 2
    if not torch.cuda.is_available():
        assert w4a16_bench.main([]) == 1 and "no CUDA device" in capsys.readouterr().err
