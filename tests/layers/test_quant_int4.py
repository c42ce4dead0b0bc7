"""int4 layers on torch's packed int4 kernels (engine/layers/quant/int4_packed.py) against the
dequantised matmul of the same weights.

Tolerance: bfloat16 activations (the only dtype kiln sends the kernels: the CPU kernel's float32
path is scalar, ~500x slower): the kernel's scales and zeros are bf16 (the reference dequantises in
float32 then rounds the weight to bf16) and it accumulates differently -> 2e-2 of the output's scale.
"""

from __future__ import annotations

import pytest
import torch

from engine.layers.quant import int4_packed, int_formats
from tests.support.quant import _act_order_g_idx, _layer


def _close(y: torch.Tensor, want: torch.Tensor, rel: float) -> None:
    err = (y.float() - want.float()).abs().max().item()
    assert err <= rel * want.float().abs().max().item(), err


CASES = [  # (out, in, group, sym, act-order)
    (64, 256, 32, True, False),
    (48, 256, 64, False, False),
    (96, 512, 128, False, True),
    (64, 512, 256, True, False),
    (80, 384, -1, False, False),  # per channel: kernel group 128 (the largest dividing 384)
    (32, 256, 32, False, True),
]


@pytest.mark.parametrize("out,inp,group,sym,act", CASES)
def test_packed_matmul_matches_dequantised(out, inp, group, sym, act):
    dtype, rel = torch.bfloat16, 2e-2
    g_idx = _act_order_g_idx(inp, group) if act else None
    m = _layer(out, inp, group, sym, g_idx, bias=True)
    m.bias.data = m.bias.data.to(dtype)  # (the model casts biases to its dtype)
    w = m.quant.weight(m, torch.float32)  # the reference: dequantised in float32
    x = torch.randn(2, 3, inp, generator=torch.Generator().manual_seed(5))
    want = (x.to(dtype).float() @ w.to(dtype).float().t() + m.bias.float()).to(dtype)
    assert int4_packed.repack(m, dtype) is None
    assert m.quant is int4_packed.PACKED and not hasattr(m, "qweight")
    assert (m.int4_perm is not None) == act
    y = m.quant.apply(m, x.to(dtype))
    assert y.shape == (2, 3, out) and y.dtype == dtype
    _close(y, want, rel)
    # the dense weight back out of the packed layout (baselines): exact in float32
    _close(m.quant.weight(m, torch.float32), w, 1e-2)


def test_packing_in_row_chunks_equals_whole(monkeypatch):
    m = _layer(208, 256, 64, sym=False)
    perm = torch.randperm(256)
    whole = torch.ops.aten._convert_weight_to_int4pack_for_cpu(
        int_formats.unpack_nibbles(m.qweight)[:, perm].to(torch.int32).contiguous(), 1
    )
    monkeypatch.setattr(int4_packed, "ROW_CHUNK", 64)  # 64 + 64 + 64 + a ragged 16
    assert torch.equal(int4_packed.convert(m.qweight, perm, torch.device("cpu")), whole)


def test_what_stays_on_the_reference_path():
    cpu, bf16 = torch.device("cpu"), torch.bfloat16
    assert int4_packed.unsupported(64, 256, 8, 32, cpu, bf16) == "8-bit weights"
    assert "group size 16" in int4_packed.unsupported(64, 256, 4, 16, cpu, bf16)
    assert "group size 32" in int4_packed.unsupported(64, 80, 4, 32, cpu, bf16)  # ragged last group
    assert int4_packed.unsupported(64, 96, 4, -1, cpu, bf16) is None  # per channel: group 32
    assert "multiple of 16" in int4_packed.unsupported(40, 256, 4, 32, cpu, bf16)
    assert "float32 activations on the CPU" in int4_packed.unsupported(64, 256, 4, 32, cpu, torch.float32)
    assert int4_packed.unsupported(64, 256, 4, 32, cpu, bf16) is None
    assert int4_packed.packed_group(384, -1) == 128 and int4_packed.packed_group(100, -1) is None
    # act-order whose groups are not runs of one size: refused, the layer keeps its layout
    g = torch.zeros(256, dtype=torch.int32)
    g[200:] = 1
    m = _layer(64, 256, 32, g_idx=g)
    assert "act-order" in int4_packed.repack(m, torch.bfloat16)
    assert m.quant is not int4_packed.PACKED and m.qweight.shape == (64, 128)


# ---- float32 models on the CPU: int4_kernel="packed" (bf16 activations around the kernel) -------


@pytest.mark.parametrize("out,inp,group,sym,act", CASES[:3])
def test_float32_layer_through_the_bf16_kernel(out, inp, group, sym, act):
    """A float32 model's int4 layer packed for bf16 activations: float32 in, float32 out, within
    bf16's error of the float32 reference (the activations and scales are rounded to bf16)."""
    g_idx = _act_order_g_idx(inp, group) if act else None
    m = _layer(out, inp, group, sym, g_idx, bias=True)
    w = m.quant.weight(m, torch.float32)
    x = torch.randn(5, inp, generator=torch.Generator().manual_seed(7))
    want = x @ w.t() + m.bias
    kernel = int4_packed.kernel_dtype(torch.float32, "packed")
    assert kernel == torch.bfloat16 and int4_packed.kernel_dtype(torch.float32, "auto") == torch.float32
    assert int4_packed.repack(m, kernel) is None and m.int4_scales_zeros.dtype == torch.bfloat16
    y = m.quant.apply(m, x)
    assert y.dtype == torch.float32 and y.shape == (5, out)
    _close(y, want, 2e-2)


def test_float32_model_packed_agrees_with_the_reference(tiny_models, make_llm, tmp_path):
    """A float32 int4 model with int4_kernel="packed": every int4 layer on the packed kernel, and
    its greedy tokens against the float32 reference path (dequantise on the fly) agree on most
    positions (bf16 activations flip near-ties of tiny random models; the figure is printed and
    recorded in benchmarks/2026-11-30.md, quantmoe)."""
    pytest.importorskip("compressed_tensors")
    from engine import SamplingParams
    from tests.support.quant_checkpoints import write_quantized

    quant_dir, _ = write_quantized(tiny_models["llama"], tmp_path, "gptq", bits=4, group_size=32, act_order=True)
    fast = make_llm(quant_dir, int4_kernel="packed")
    ref = make_llm(quant_dir, int4_kernel="reference")
    qkv = fast.engine.core.model.layers[0].self_attn.qkv_proj
    assert qkv.quant is int4_packed.PACKED and qkv.int4_scales_zeros.dtype == torch.bfloat16
    assert ref.engine.core.model.layers[0].self_attn.qkv_proj.quant is not int4_packed.PACKED
    greedy = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    gen = torch.Generator().manual_seed(0)
    prompts = [
        torch.randint(5, 200, (int(n),), generator=gen).tolist() for n in torch.randint(1, 30, (8,), generator=gen)
    ]
    a = [o.outputs[0].token_ids for o in fast.generate(prompts, greedy, use_tqdm=False)]
    b = [o.outputs[0].token_ids for o in ref.generate(prompts, greedy, use_tqdm=False)]
    # agreement up to the first divergence (after it the continuations differ by construction)
    prefix = sum(next((i for i, (p, q) in enumerate(zip(x, y)) if p != q), len(x)) for x, y in zip(a, b))
    total = sum(len(x) for x in a)
    print(f"packed vs reference: {prefix}/{total} tokens before the first divergence")
    assert prefix >= 0.5 * total


# ---- CUDA: torch's tinygemm kernel (_weight_int4pack_mm) -------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize(
    "out,inp,group,sym,act",
    [(4096, 4096, 128, True, False), (1024, 2048, 64, False, True), (6144, 4096, -1, False, False)],
)
def test_cuda_packed_matmul_matches_dequantised_and_replays_in_a_graph(out, inp, group, sym, act):
    """bf16 activations (the only dtype the CUDA kernel takes): within 2e-2 of the output's scale
    of the dequantised matmul, and the same inside a CUDA graph replayed on new inputs."""
    dev = torch.device("cuda")
    m = _layer(out, inp, group, sym, _act_order_g_idx(inp, group) if act else None).to(dev)
    w = m.quant.weight(m, torch.float32)
    assert int4_packed.repack(m, torch.bfloat16) is None and m.int4_packed.is_cuda
    x = torch.randn(3, inp, device=dev, dtype=torch.bfloat16)
    _close(m.quant.apply(m, x), (x.float() @ w.t()).bfloat16(), 2e-2)
    _close(m.quant.weight(m, torch.float32), w, 1e-2)
    static_x = torch.zeros(1, inp, device=dev, dtype=torch.bfloat16)
    m.quant.apply(m, static_x)  # warm-up outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_y = m.quant.apply(m, static_x)
    for seed in range(2):
        static_x.copy_(
            torch.randn(1, inp, device=dev, dtype=torch.bfloat16, generator=torch.Generator(dev).manual_seed(seed))
        )
        graph.replay()
        _close(static_y, (static_x.float() @ w.t()).bfloat16(), 2e-2)


# kiln's own W4A16 kernel (templates/w4a16_gemm.cu.j2): tests/layers/test_w4a16.py (CPU) and
# tests/layers/test_w4a16_gpu.py.
