"""Quantised checkpoints (GPTQ, AWQ, compressed-tensors int and fp8) and fp8 at load.

Each format: a tiny checkpoint in its exact on-disk layout (tests/support/quant_checkpoints.py); kiln
keeps the weights quantised and its greedy output equals kiln's on the dequantised weights
(transformers needs GPU-only libraries for GPTQ/AWQ); the unpacking is checked on hand-made
words against each format's definition.
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from compiler.kernels import cpu_gemv
from engine.layers.quant import int4_packed, int_formats
from engine.layers.quant.cpu_packed import CpuPackedMethod
from engine.layers.quant.linear import FP8, Fp8Method, quantize_fp8_acts
from tests.support.quant import _drift, _greedy, packed_gguf_layer
from tests.support.quant_checkpoints import write_fp8, write_quantized

pytest.importorskip("compressed_tensors")


# --- unpacking, on hand-made words ------------------------------------------------------------


def _word(values, bits, order=None):
    """One int32 word holding `values` (value k at bits k*bits, or at the slot given by order)."""
    w = 0
    for slot in range(32 // bits):
        v = values[order[slot]] if order else values[slot]
        w |= v << (bits * slot)
    return w - (1 << 32) if w >= 1 << 31 else w


def test_gptq_unpack_hand_made():
    # 4-bit, in=8 (one word per output column), out=8, one group; v1 zeros stored minus one.
    q = [[(o + i) % 16 for i in range(8)] for o in range(8)]  # q[o][i]
    qweight = torch.tensor([[_word([q[o][i] for i in range(8)], 4) for o in range(8)]], dtype=torch.int32)
    zeros = [3, 4, 5, 6, 7, 8, 9, 10]
    qzeros = torch.tensor([[_word([z - 1 for z in zeros], 4)]], dtype=torch.int32)
    scales = torch.arange(1, 9, dtype=torch.float16)[None, :] / 8
    c = int_formats.from_gptq(dict(qweight=qweight, qzeros=qzeros, scales=scales), 4, -1, v1_zeros=True)
    w = int_formats.dequantize(c["qweight"], c["zeros"], c["scales"], c["g_idx"], 4)
    want = torch.tensor([[(q[o][i] - zeros[o]) * (o + 1) / 8 for i in range(8)] for o in range(8)])
    assert torch.equal(w, want)
    # 8-bit: four values per word
    q8 = [[(17 * o + 31 * i) % 256 for i in range(4)] for o in range(4)]
    qweight = torch.tensor([[_word(q8[o], 8) for o in range(4)]], dtype=torch.int32)
    qzeros = torch.tensor([[_word([127] * 4, 8)]], dtype=torch.int32)
    c = int_formats.from_gptq(
        dict(qweight=qweight, qzeros=qzeros, scales=torch.ones(1, 4, dtype=torch.float16)), 8, -1, v1_zeros=True
    )
    w = int_formats.dequantize(c["qweight"], c["zeros"], c["scales"], c["g_idx"], 8)
    assert torch.equal(w, torch.tensor(q8, dtype=torch.float32) - 128)


def test_awq_unpack_hand_made():
    # in=2, out=8: one word per input row; AWQ puts column order[k] in nibble k.
    order = [0, 2, 4, 6, 1, 3, 5, 7]
    q = [[(3 * o + 5 * i) % 16 for i in range(2)] for o in range(8)]
    qweight = torch.tensor([[_word([q[o][i] for o in range(8)], 4, order)] for i in range(2)], dtype=torch.int32)
    zeros = [1, 2, 3, 4, 5, 6, 7, 8]
    qzeros = torch.tensor([[_word(zeros, 4, order)]], dtype=torch.int32)
    c = int_formats.from_awq(dict(qweight=qweight, qzeros=qzeros, scales=torch.ones(1, 8, dtype=torch.float16)), 2)
    w = int_formats.dequantize(c["qweight"], c["zeros"], c["scales"], c["g_idx"], 4)
    assert torch.equal(w, torch.tensor([[q[o][i] - zeros[o] for i in range(2)] for o in range(8)], dtype=torch.float32))


def test_compressed_tensors_unpack_hand_made():
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32

    signed = torch.tensor([[(o * 8 + i) % 16 - 8 for i in range(8)] for o in range(8)], dtype=torch.int8)
    zp = torch.tensor([[o % 4 - 2] for o in range(8)], dtype=torch.int8)
    t = dict(
        weight_packed=pack_to_int32(signed, 4),
        weight_scale=torch.full((8, 1), 0.5),
        weight_zero_point=pack_to_int32(zp, 4, packed_dim=0),
        weight_shape=torch.tensor([8, 8]),
    )
    # the packed word is the definition's: value i at bits 4i, offset by 8
    assert t["weight_packed"][0, 0].item() == _word([v + 8 for v in signed[0].tolist()], 4)
    c = int_formats.from_compressed_tensors(t, 4, -1)
    w = int_formats.dequantize(c["qweight"], c["zeros"], c["scales"], c["g_idx"], 4)
    assert torch.equal(w, (signed.float() - zp.float()) * 0.5)


def test_fp8_linear_matches_definition():
    torch.manual_seed(0)
    w = torch.randn(8, 16)
    x = torch.randn(5, 16)
    for acts in ("dynamic", "static"):
        from engine.layers.quant.config import QuantConfig

        method = Fp8Method(QuantConfig("fp8", "ct", 8, activations=acts))
        m = torch.nn.Linear(16, 8, bias=False)
        del m.weight
        m.register_parameter("weight", None)
        method.create(m, "cpu")
        scale = w.abs().amax(dim=1) / 448
        m.weight_fp8.copy_((w / scale[:, None]).to(FP8))
        m.weight_scale.copy_(scale)
        s_in = x.abs().amax(dim=1, keepdim=True) / 448 if acts == "dynamic" else torch.full((5, 1), 0.02)
        if acts == "static":
            m.input_scale.fill_(0.02)
        xq = (x / s_in).clamp(-448, 448).to(FP8).float() * s_in
        want = xq @ (m.weight_fp8.float() * scale[:, None]).t()
        torch.testing.assert_close(method.apply(m, x), want)
    q, s = quantize_fp8_acts(x, None)
    assert q.dtype == FP8 and s.shape == (5, 1)


# --- whole checkpoints ------------------------------------------------------------------------

INT_CASES = [
    ("gptq", dict(bits=4, group_size=32, sym=True)),
    ("gptq", dict(bits=4, group_size=64, sym=False, act_order=True)),
    ("gptq", dict(bits=4, group_size=128, sym=True, act_order=True)),
    ("gptq", dict(bits=8, group_size=-1, sym=True)),
    ("gptq", dict(bits=8, group_size=32, sym=False)),
    ("awq", dict(bits=4, group_size=32, sym=False)),
    ("awq", dict(bits=4, group_size=64, sym=True)),
    ("ct", dict(bits=4, group_size=32, sym=True)),
    ("ct", dict(bits=4, group_size=64, sym=False, act_order=True)),
    ("ct", dict(bits=8, group_size=-1, sym=True)),
]


@pytest.mark.parametrize(
    "fmt,opts",
    INT_CASES,
    ids=[
        f"{f}-int{o['bits']}-g{o['group_size']}-{'sym' if o['sym'] else 'asym'}"
        f"{'-actorder' if o.get('act_order') else ''}"
        for f, o in INT_CASES
    ],
)
def test_int_checkpoint_equals_dequantised(fmt, opts, tiny_models, make_llm, tmp_path):
    arch = "qwen2" if fmt == "awq" else "llama"  # (qwen2: q/k/v biases next to quantised weights)
    quant_dir, ref_dir = write_quantized(tiny_models[arch], tmp_path, fmt, **opts)
    llm = make_llm(quant_dir)
    qkv = llm.engine.core.model.layers[0].self_attn.qkv_proj
    assert qkv.weight is None
    greedy = _greedy(llm)
    assert greedy == _greedy(make_llm(ref_dir))
    # float32 on the CPU: the weight-streaming kernels' layout (engine/layers/quant/cpu_packed.py),
    # float activations (so the greedy tokens above equal the dequantised checkpoint's)
    assert isinstance(qkv.quant, CpuPackedMethod) and qkv.quant.float_acts
    assert qkv.gemv_runs[0][2] == (cpu_gemv.INT4 if opts["bits"] == 4 else cpu_gemv.INT8)
    # (GPTQ act-order with several groups has a real permutation; compressed-tensors' keeps groups in order)
    assert (qkv.gemv_perm is not None) == (
        fmt == "gptq" and opts.get("act_order", False) and 0 < opts["group_size"] < qkv.in_features
    )
    ref = make_llm(quant_dir, int4_kernel="reference")  # (kiln's layout, dequantised on the fly)
    r_qkv = ref.engine.core.model.layers[0].self_attn.qkv_proj
    torch.testing.assert_close(
        qkv.quant.weight(qkv, torch.float32), r_qkv.quant.weight(r_qkv, torch.float32), rtol=1e-6, atol=1e-7
    )
    # bf16: the int8 activation path, within 3x the drift bf16 itself has from float32 (int8 per
    # block of 32 rounds each activation to amax / 254; greedy tokens of tiny random models flip on
    # near-ties, so the comparison is on prompt log-probabilities)
    kept = make_llm(quant_dir, dtype="bfloat16")
    k_qkv = kept.engine.core.model.layers[0].self_attn.qkv_proj
    assert isinstance(k_qkv.quant, CpuPackedMethod) and not k_qkv.quant.float_acts
    ref_bf16 = make_llm(quant_dir, dtype="bfloat16", int4_kernel="reference")
    assert _drift(kept, ref_bf16) <= 3 * _drift(ref_bf16, llm) + 0.01
    if opts["bits"] == 8:  # (torch has no int8-weight kernel: "packed" leaves it on the reference path)
        return
    # torch's packed int4 kernel (int4_kernel="packed"), act-order as a column permutation. Its bf16
    # scales/zeros and accumulation order move the output off the bf16 reference path by no more
    # than bf16 itself moves the reference off float32
    packed = make_llm(quant_dir, dtype="bfloat16", int4_kernel="packed")
    p_qkv = packed.engine.core.model.layers[0].self_attn.qkv_proj
    assert p_qkv.quant is int4_packed.PACKED and p_qkv.int4_packed.dtype == torch.uint8
    assert (p_qkv.int4_perm is not None) == (qkv.gemv_perm is not None)
    assert _drift(packed, ref_bf16) <= _drift(ref_bf16, llm) + 0.01  # (measured: 0.034-0.045 against 0.040-0.052)


@pytest.mark.parametrize("strategy,acts", [("channel", None), ("tensor", None)])
def test_fp8_weight_only_checkpoint_equals_dequantised(strategy, acts, tiny_models, make_llm, tmp_path):
    quant_dir, ref_dir = write_fp8(tiny_models["llama"], tmp_path, strategy, acts)
    llm = make_llm(quant_dir)
    assert llm.engine.core.model.layers[0].mlp.down_proj.weight_fp8.dtype == FP8
    assert _greedy(llm) == _greedy(make_llm(ref_dir))


@pytest.mark.parametrize("strategy,acts", [("channel", "dynamic"), ("tensor", "static"), ("channel", "static")])
def test_fp8_w8a8_checkpoint(strategy, acts, tiny_models, make_llm, tmp_path):
    """Activations quantised too: the output moves off the dequantised-weight run, by at most twice
    what rounding the weights to e4m3 moved it off the full-precision one (tiny random models are
    sensitive: 0.25 nats for the weights; per token 0.25, static calibrated scales 0.33-0.38)."""
    quant_dir, ref_dir = write_fp8(tiny_models["llama"], tmp_path, strategy, acts)
    llm = make_llm(quant_dir)
    o_proj = llm.engine.core.model.layers[0].self_attn.o_proj
    assert o_proj.quant.activations == acts
    if acts == "static":  # fused q/k/v take the largest of their three input scales
        from safetensors.torch import load_file

        t = load_file(str(quant_dir / "model.safetensors"))
        want = max(t[f"model.layers.0.self_attn.{p}_proj.input_scale"].item() for p in "qkv")
        assert llm.engine.core.model.layers[0].self_attn.qkv_proj.input_scale.item() == pytest.approx(want)
    ref = make_llm(ref_dir)
    assert 0.0 < _drift(llm, ref) < 2.0 * _drift(ref, make_llm(tiny_models["llama"]))


def test_fp8_at_load(tiny_models, make_llm, tmp_path):
    """--quantization fp8 on a float32 checkpoint: e4m3 weights with a scale per output row and
    dynamic per-token activations, the same model as compressed-tensors' FP8_DYNAMIC scheme."""
    src = tiny_models["llama"]
    llm = make_llm(src, quantization="fp8")
    from safetensors.torch import load_file

    w = load_file(str(src / "model.safetensors"))["model.layers.1.mlp.down_proj.weight"]
    down = llm.engine.core.model.layers[1].mlp.down_proj
    assert down.weight is None and down.weight_fp8.dtype == FP8
    torch.testing.assert_close(down.weight_scale, w.abs().amax(dim=1) / 448)
    deq = down.weight_fp8.float() * down.weight_scale[:, None]
    assert ((deq - w).abs() <= w.abs() * 0.0625 + 1e-6).all()  # e4m3: 3 mantissa bits
    quant_dir, _ = write_fp8(src, tmp_path, "channel", "dynamic")
    assert _greedy(llm) == _greedy(make_llm(quant_dir))


def test_bad_quantization_settings(tiny_models, tmp_path):
    from engine.entrypoints.llm import LLM

    with pytest.raises(ValueError, match="only 'fp8'"):
        LLM(str(tiny_models["llama"]), device="cpu", enforce_eager=True, quantization="gptq")
    quant_dir, _ = write_quantized(tiny_models["llama"], tmp_path, "gptq", bits=4, group_size=32)
    with pytest.raises(ValueError, match="already quantised"):
        LLM(str(quant_dir), device="cpu", enforce_eager=True, quantization="fp8")
    # act-order permutations that differ between q and k cannot share the fused layer
    from safetensors.torch import load_file, save_file

    t = load_file(str(quant_dir / "model.safetensors"))
    t["model.layers.0.self_attn.k_proj.g_idx"] = t["model.layers.0.self_attn.k_proj.g_idx"].flip(0).contiguous()
    save_file(t, str(quant_dir / "model.safetensors"))
    with pytest.raises(ValueError, match="g_idx unlike"):
        LLM(str(quant_dir), device="cpu", enforce_eager=True)
    cfg = json.loads((quant_dir / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "bitsandbytes"}
    (quant_dir / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="not supported"):
        LLM(str(quant_dir), device="cpu", enforce_eager=True)


def test_compiled_forward_equals_eager(tiny_models, make_llm, tmp_path):
    """The quantised layers run under torch.compile (kiln's default) exactly as in eager mode."""
    quant_dir, _ = write_quantized(tiny_models["llama"], tmp_path, "gptq", bits=4, group_size=32, act_order=True)
    compiled = make_llm(quant_dir, enforce_eager=False, cache_dir=str(tmp_path / "cache"))
    assert _greedy(compiled) == _greedy(make_llm(quant_dir))


# --- the GEMM rows of a layer in the CPU kernels' layout ----------------------------------------


TOLERANCE = {torch.float32: {"rtol": 1e-5, "atol": 1e-5}, torch.bfloat16: {"rtol": 1e-2, "atol": 1e-2}}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gemm_rows_dequantise_in_slices(dtype):
    """From GEMM_ROWS rows (a prefill chunk) a packed layer runs its GEMM slice by slice of output
    rows (cpu_packed.gemm_in_slices), each slice dequantised into one reused scratch: the product of
    the whole dequantised weight, whatever the slice (a row group of 16; runs of two formats whose
    row counts leave padded groups, as a Q4_K_M file's fused q/k/v), bias included."""
    from engine.layers.quant import cpu_packed

    k = 256
    layer = packed_gguf_layer(("Q4_K", "Q6_K"), (40, 56), k, bias=True)
    layer.bias.data = layer.bias.data.to(dtype)  # (a model's bias is in its dtype)
    x = torch.randn(cpu_packed.GEMM_ROWS[False] + 3, k).to(dtype)
    w = CpuPackedMethod.packed_order_weight(layer, dtype)
    whole = F.linear(x, w, layer.bias)
    group = cpu_packed.ROW_GROUP * k * w.element_size()
    for budget in (group, 3 * group, cpu_packed.GEMM_SLICE_BYTES):  # (one group a slice; three; one slice a run)
        torch.testing.assert_close(cpu_packed.gemm_in_slices(layer, x, budget), whole, **TOLERANCE[dtype])
    torch.testing.assert_close(layer.quant.apply(layer, x), whole, **TOLERANCE[dtype])  # (the layer's own GEMM rows)
    assert cpu_packed.slice_rows(2048, 4) == 1024 and cpu_packed.slice_rows(1 << 20, 4) == cpu_packed.ROW_GROUP


@pytest.mark.parametrize("formats", [("Q4_K",), ("Q4_K", "Q6_K")], ids=["one-run", "gate-up-runs"])
def test_gate_up_rows_activated_in_slices(formats):
    """A fused gate/up layer's GEMM rows with the activation applied per slice (gated_in_slices:
    never the whole [M, 2 I] product) equal act(gate) * up of the whole layer's product; it
    declines (None) below GEMM_ROWS and where runs do not split at the gate/up boundary."""
    from engine.layers.quant import cpu_packed

    k, half = 256, 48

    def act(gu):
        gate, up = gu.split(gu.shape[-1] // 2, dim=-1)
        return F.silu(gate) * up

    sizes = (2 * half,) if len(formats) == 1 else (half, half)
    layer = packed_gguf_layer(formats, sizes, k, bias=False)
    x = torch.randn(cpu_packed.GEMM_ROWS[False] + 3, k)
    whole = act(x @ CpuPackedMethod.packed_order_weight(layer, torch.float32).T)
    group = cpu_packed.ROW_GROUP * k * 4
    for budget in (2 * group, 6 * group, cpu_packed.GEMM_SLICE_BYTES):
        torch.testing.assert_close(cpu_packed.gated_in_slices(layer, x, half, act, budget), whole, **TOLERANCE[x.dtype])
    assert cpu_packed.gated_in_slices(layer, x[: cpu_packed.GEMM_ROWS[False] - 1], half, act) is None
    assert cpu_packed.gated_in_slices(packed_gguf_layer(("Q4_K", "Q6_K"), (32, 64), k, False), x, half, act) is None
