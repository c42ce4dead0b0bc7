"""Quantised mixture-of-experts checkpoints (engine/layers/quant/moe.py): Mixtral, Qwen2-MoE (shared
expert) and Qwen3-MoE (a dense layer among sparse ones) written in each format's exact on-disk
layout (tests/support/quant_checkpoints.py) load with their experts kept quantised, and kiln's greedy
output equals its own run on the dequantised weights (transformers needs GPU-only libraries for
GPTQ/AWQ, and keeps MoE experts as stacked tensors its compressed-tensors support does not
dequantise). Block accounting is checked after every engine (make_llm)."""

from __future__ import annotations

import pytest
import torch

from compiler.kernels.moe import moe_experts_dense
from engine import SamplingParams
from engine.layers.quant.config import QuantConfig
from engine.layers.quant.linear import FP8, make_method
from engine.layers.quant.moe import QuantExperts, routed_experts
from tests.support.quant_checkpoints import write_fp8, write_quantized

pytest.importorskip("compressed_tensors")

GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
PROMPTS = [[5, 100, 200, 300, 17, 9], [42] * 20, [7], list(range(10, 70))]


def _greedy(llm):
    """The prompts as one batch (decode steps with more (token, expert) pairs than experts: every
    expert dequantised) and the first alone (fewer pairs: only the chosen experts)."""
    batch = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
    return batch + [llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False)[0].outputs[0].token_ids]


def _experts(llm, layer: int = 0):
    moe = llm.engine.core.model.layers[layer].mlp
    assert isinstance(moe.w13, QuantExperts) and isinstance(moe.w2, QuantExperts)
    assert not any(n.endswith(("w13", "w2")) for n, _ in moe.named_parameters())  # nothing dense
    return moe


# --- the expert path itself, on hand-made quantised experts ------------------------------------

E, H, I = 8, 64, 32  # noqa: E741 (experts, hidden, intermediate: the papers' names)


def _int_experts(out: int, inp: int, bits: int, group: int, act_order: bool, seed: int) -> QuantExperts:
    gen = torch.Generator().manual_seed(seed)
    m = QuantExperts(E, out, inp, make_method(QuantConfig("int", "gptq", bits, group, sym=False)), "cpu")
    m.qweight.copy_(torch.randint(0, 256, m.qweight.shape, generator=gen, dtype=torch.uint8))
    m.zeros.copy_(torch.randint(0, 1 << bits, m.zeros.shape, generator=gen, dtype=torch.uint8))
    m.scales.copy_(torch.rand(m.scales.shape, generator=gen) * (0.4 / (1 << bits)) + 1e-3)
    if act_order:
        for e in range(E):
            m.g_idx[e].copy_(m.g_idx[e][torch.randperm(inp, generator=gen)])
        m.act_order = True
    return m


def _fp8_experts(out: int, inp: int, seed: int) -> QuantExperts:
    gen = torch.Generator().manual_seed(seed)
    m = QuantExperts(E, out, inp, make_method(QuantConfig("fp8", "ct", 8, weight_strategy="channel")), "cpu")
    m.weight_fp8.copy_((torch.randn(m.weight_fp8.shape, generator=gen) * 4).to(FP8))
    m.weight_scale.copy_(torch.rand(E, out, generator=gen) * 0.05 + 0.01)
    return m


@pytest.mark.parametrize("kind", ["int4-g32", "int4-actorder", "int8-channel", "fp8"])
@pytest.mark.parametrize("num_tokens,k", [(1, 2), (3, 2), (4, 2), (40, 3)])
def test_routed_experts_equal_the_dense_path_on_dequantised_weights(kind, num_tokens, k):
    """Fewer pairs than experts (1x2, 3x2: only the chosen experts dequantised) and more (4x2,
    40x3: all of them), against compiler/kernels/moe.py's dense path over the dequantised experts."""
    if kind == "fp8":
        w13, w2 = _fp8_experts(2 * I, H, 1), _fp8_experts(H, I, 2)
    else:
        bits, group, act = {"int4-g32": (4, 32, False), "int4-actorder": (4, 16, True), "int8-channel": (8, -1, False)}[
            kind
        ]
        w13, w2 = _int_experts(2 * I, H, bits, group, act, 1), _int_experts(H, I, bits, group, act, 2)
    gen = torch.Generator().manual_seed(num_tokens)
    x = torch.randn(num_tokens, H, generator=gen)
    ids = torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(num_tokens)])
    weights = torch.rand(num_tokens, k, generator=gen)
    dense13, dense2 = w13.weight(None, torch.float32), w2.weight(None, torch.float32)
    assert dense13.shape == (E, 2 * I, H) and w13.shape == (E, 2 * I, H)
    want = moe_experts_dense(x, weights, ids, dense13, dense2, "silu")
    torch.testing.assert_close(routed_experts(w13, w2, x, weights, ids, "silu"), want, rtol=1e-5, atol=1e-5)
    # one expert's rows dequantise the same picked or in the stack
    torch.testing.assert_close(w13.weight(ids[0], torch.float32), dense13[ids[0]])


def test_decode_dequantises_only_the_chosen_experts(monkeypatch):
    """A decode step of one token (2 of 8 experts) dequantises 2 experts per weight, not 8."""
    w13, w2 = _int_experts(2 * I, H, 4, 32, False, 1), _int_experts(H, I, 4, 32, False, 2)
    seen = []
    real = QuantExperts.weight

    def spy(self, experts, dtype):
        out = real(self, experts, dtype)
        seen.append(out.shape[0])
        return out

    monkeypatch.setattr(QuantExperts, "weight", spy)
    routed_experts(w13, w2, torch.randn(1, H), torch.rand(1, 2), torch.tensor([[3, 5]]), "silu")
    assert seen == [2, 2]


# --- whole checkpoints -----------------------------------------------------------------------

INT_CASES = [
    ("mixtral", "gptq", dict(bits=4, group_size=32, sym=True)),
    ("qwen2_moe", "gptq", dict(bits=4, group_size=32, sym=False, act_order=True)),
    ("qwen3_moe", "gptq", dict(bits=8, group_size=-1, sym=True)),
    ("qwen3_moe", "awq", dict(bits=4, group_size=32, sym=False)),
    ("mixtral", "awq", dict(bits=4, group_size=64, sym=True)),
    ("qwen2_moe", "ct", dict(bits=4, group_size=32, sym=True)),
    ("qwen3_moe", "ct", dict(bits=4, group_size=64, sym=False, act_order=True)),
    ("mixtral", "ct", dict(bits=8, group_size=-1, sym=True)),
]


@pytest.mark.parametrize(
    "arch,fmt,opts",
    INT_CASES,
    ids=[
        f"{a}-{f}-int{o['bits']}-g{o['group_size']}-{'sym' if o['sym'] else 'asym'}"
        f"{'-actorder' if o.get('act_order') else ''}"
        for a, f, o in INT_CASES
    ],
)
def test_int_moe_checkpoint_equals_dequantised(arch, fmt, opts, tiny_models, make_llm, tmp_path):
    quant_dir, ref_dir = write_quantized(tiny_models[arch], tmp_path, fmt, **opts)
    llm = make_llm(quant_dir)
    moe = _experts(llm)
    bits = opts["bits"]
    assert moe.w13.qweight.dtype == torch.uint8
    assert moe.w13.qweight.shape[-1] == moe.w13.in_features // (2 if bits == 4 else 1)
    assert moe.gate.weight.dtype == torch.float32  # the router stays full precision
    if arch == "qwen2_moe":  # the shared expert: quantised like a dense MLP; its gate is not
        assert moe.shared_expert.gate_up_proj.weight is None and moe.shared_expert.down_proj.quant is not None
        assert moe.shared_expert_gate.weight.dtype == torch.float32
    if arch == "qwen3_moe":  # its dense layer among the sparse ones
        assert llm.engine.core.model.layers[1].mlp.gate_up_proj.weight is None
    assert _greedy(llm) == _greedy(make_llm(ref_dir))


def test_gptq_act_order_experts_keep_their_own_permutation(tiny_models, make_llm, tmp_path):
    quant_dir, _ = write_quantized(tiny_models["mixtral"], tmp_path, "gptq", bits=4, group_size=32, act_order=True)
    moe = _experts(make_llm(quant_dir))
    assert moe.w13.act_order and moe.w2.act_order
    assert not torch.equal(moe.w13.g_idx[0], moe.w13.g_idx[1])  # each expert's own input permutation


def test_int_moe_quantised_bytes(tiny_models, make_llm, tmp_path):
    """int4 experts with group 32: 0.5 byte a weight plus 5 bytes a group (uint8 zero point,
    float32 scale) and 4 bytes a column of g_idx, against 4 bytes a float32 weight."""
    quant_dir, _ = write_quantized(tiny_models["qwen3_moe"], tmp_path, "gptq", bits=4, group_size=32)
    moe = _experts(make_llm(quant_dir))
    e, out, inp = moe.w13.shape
    assert moe.w13.weight_bytes() == e * out * (inp // 2 + inp // 32 * 5) + e * inp * 4
    assert moe.w13.weight_bytes() < 0.25 * e * out * inp * 4


@pytest.mark.parametrize("arch,strategy", [("mixtral", "channel"), ("qwen2_moe", "tensor")])
def test_fp8_weight_only_moe_checkpoint_equals_dequantised(arch, strategy, tiny_models, make_llm, tmp_path):
    quant_dir, ref_dir = write_fp8(tiny_models[arch], tmp_path, strategy, None)
    llm = make_llm(quant_dir)
    moe = _experts(llm)
    assert moe.w13.weight_fp8.dtype == FP8 and moe.w2.weight_scale.shape == moe.w2.shape[:2]
    assert _greedy(llm) == _greedy(make_llm(ref_dir))


def test_fp8_w8a8_moe_checkpoint(tiny_models, make_llm, tmp_path):
    """FP8 W8A8 (dynamic per-token activations): the experts run weight-only (their activations
    are not quantised), the attention layers quantise theirs. As for dense W8A8
    (test_quant_formats.py): the prompt log-probabilities move off the dequantised-weight run by
    less than twice what rounding the weights to e4m3 moved them off the full-precision one."""
    from tests.support.quant import _drift

    src = tiny_models["qwen3_moe"]
    quant_dir, ref_dir = write_fp8(src, tmp_path, "channel", "dynamic")
    llm = make_llm(quant_dir)
    assert _experts(llm).w13.weight_fp8.dtype == FP8
    assert llm.engine.core.model.layers[0].self_attn.o_proj.quant.activations == "dynamic"
    ref = make_llm(ref_dir)
    assert 0.0 < _drift(llm, ref) < 2.0 * _drift(ref, make_llm(src))


def test_fp8_at_load_quantises_the_experts(tiny_models, make_llm, tmp_path):
    """--quantization fp8 on a float32 MoE checkpoint: experts e4m3 with a scale per expert row,
    the same model as compressed-tensors' FP8_DYNAMIC checkpoint of it."""
    from safetensors.torch import load_file

    src = tiny_models["mixtral"]
    llm = make_llm(src, quantization="fp8")
    moe = _experts(llm, 1)
    w = load_file(str(src / "model.safetensors"))["model.layers.1.block_sparse_moe.experts.2.w2.weight"]
    torch.testing.assert_close(moe.w2.weight_scale[2], w.abs().amax(dim=1) / 448)
    deq = moe.w2.weight(torch.tensor([2]), torch.float32)[0]
    assert ((deq - w).abs() <= w.abs() * 0.0625 + 1e-6).all()  # e4m3: 3 mantissa bits
    quant_dir, _ = write_fp8(src, tmp_path, "channel", "dynamic")
    assert _greedy(llm) == _greedy(make_llm(quant_dir))


def test_dummy_quantised_moe_runs(tiny_models, make_llm):
    """load_format=dummy with a forced layout (benchmarks): random int4 experts, a finite output."""
    llm = make_llm(tiny_models["qwen2_moe"], load_format="dummy", quantization="gptq")
    assert _experts(llm).w13.qweight.dtype == torch.uint8
    out = llm.generate(
        [PROMPTS[0]], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, logprobs=1), use_tqdm=False
    )[0].outputs[0]
    assert len(out.token_ids) == 4


def test_missing_expert_weights_are_named(tiny_models, tmp_path):
    from safetensors.torch import load_file, save_file

    from engine.entrypoints.llm import LLM

    quant_dir, _ = write_quantized(tiny_models["qwen3_moe"], tmp_path, "gptq", bits=4, group_size=32)
    t = load_file(str(quant_dir / "model.safetensors"))
    for suffix in ("qweight", "qzeros", "scales", "g_idx"):
        del t[f"model.layers.0.mlp.experts.5.up_proj.{suffix}"]
    save_file(t, str(quant_dir / "model.safetensors"))
    with pytest.raises(ValueError, match="lacks quantised weights.*layers.0.mlp.w13 expert 5"):
        LLM(str(quant_dir), device="cpu", enforce_eager=True)


def test_compiled_quantised_moe_equals_eager(tiny_models, make_llm, tmp_path):
    """The quantised expert path under torch.compile (kiln's default) equals eager mode."""
    quant_dir, _ = write_quantized(tiny_models["qwen3_moe"], tmp_path, "gptq", bits=4, group_size=32)
    compiled = make_llm(quant_dir, enforce_eager=False, cache_dir=str(tmp_path / "cache"))
    assert _greedy(compiled) == _greedy(make_llm(quant_dir))


# --- int4 experts on torch's packed CPU kernel (kiln::moe_experts_int4) ------------------------


@pytest.mark.parametrize("act_order", [False, True])
@pytest.mark.parametrize("num_tokens,k", [(1, 2), (40, 3)])
def test_packed_int4_experts_match_dequantised(act_order, num_tokens, k):
    """Experts repacked for bf16 activations (a bf16 model, or int4_kernel="packed"): within
    bf16's error (2e-2 of the output's scale) of the dense path over the dequantised experts."""
    from engine.layers.quant import int4_packed

    w13, w2 = _int_experts(2 * I, H, 4, 32, act_order, 1), _int_experts(H, I, 4, 32, act_order, 2)
    dense13, dense2 = w13.weight(None, torch.float32), w2.weight(None, torch.float32)
    kernel = int4_packed.kernel_dtype(torch.float32, "packed")
    assert w13.packable(kernel) is None and w13.packable(torch.float32) is not None
    w13.repack(kernel)
    w2.repack(kernel)
    assert w13.int4_group == 32 and not hasattr(w13, "qweight") and (w13.int4_perm is not None) == act_order
    torch.testing.assert_close(w13.weight(None, torch.float32), dense13, rtol=0, atol=2e-2 * dense13.abs().max().item())
    gen = torch.Generator().manual_seed(num_tokens)
    x = torch.randn(num_tokens, H, generator=gen)
    ids = torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(num_tokens)])
    weights = torch.rand(num_tokens, k, generator=gen)
    want = moe_experts_dense(x, weights, ids, dense13, dense2, "silu")
    got = routed_experts(w13, w2, x, weights, ids, "silu")
    assert got.dtype == torch.float32
    assert (got - want).abs().max() <= 2e-2 * want.abs().max()


def test_bf16_moe_model_runs_packed_experts(tiny_models, make_llm, tmp_path):
    """A bf16 int4 MoE model: experts on the packed kernel; its prompt log-probabilities stay as
    near the bf16 reference path as bf16 itself is to float32 (as for dense int4 layers)."""
    from tests.support.quant import _drift

    quant_dir, _ = write_quantized(tiny_models["qwen3_moe"], tmp_path, "gptq", bits=4, group_size=32, act_order=True)
    packed = make_llm(quant_dir, dtype="bfloat16")
    moe = _experts(packed)
    assert moe.w13.int4_group == 32 and moe.w2.int4_group == 32 and moe.w13.int4_perm is not None
    ref_bf16 = make_llm(quant_dir, dtype="bfloat16", int4_kernel="reference")
    assert ref_bf16.engine.core.model.layers[0].mlp.w13.int4_group == 0
    assert _drift(packed, ref_bf16) <= _drift(ref_bf16, make_llm(quant_dir)) + 0.01


def test_ignore_list_keeps_the_shared_expert_dense(tiny_models, make_llm, tmp_path):
    """compressed-tensors' ignore list: a Qwen2-MoE whose shared expert was left unquantised loads
    it dense (the experts quantised), and equals the run on the dequantised weights."""
    quant_dir, ref_dir = write_quantized(
        tiny_models["qwen2_moe"],
        tmp_path,
        "ct",
        bits=4,
        group_size=32,
        keep_dense=r".*mlp\.shared_expert\.(gate|up|down)_proj$",
    )
    llm = make_llm(quant_dir)
    moe = _experts(llm)
    assert moe.shared_expert.gate_up_proj.quant is None and moe.shared_expert.gate_up_proj.weight is not None
    assert moe.shared_expert.down_proj.quant is None
    assert llm.engine.core.model.layers[0].self_attn.qkv_proj.weight is None  # the rest stays quantised
    assert _greedy(llm) == _greedy(make_llm(ref_dir))


def test_ignore_list_must_cover_a_fused_layer_whole(tiny_models, tmp_path):
    from engine.entrypoints.llm import LLM

    quant_dir, _ = write_quantized(
        tiny_models["qwen2_moe"], tmp_path, "ct", bits=4, group_size=32, keep_dense=r".*mlp\.shared_expert\.gate_proj$"
    )
    with pytest.raises(ValueError, match="only some of the projections fused"):
        LLM(str(quant_dir), device="cpu", enforce_eager=True)
