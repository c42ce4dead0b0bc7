"""Mixture-of-experts: kiln::moe_experts against a per-token loop (both implementations, under
torch.compile too), and a compiled MoE model against eager. Token-for-token equality with
transformers for Mixtral, Qwen2-MoE and Qwen3-MoE is in test_engine_vs_hf.py."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import compiler.kernels.ops  # noqa: F401  (registers kiln::moe_experts when this file runs alone)
from compiler.kernels.moe import moe_experts_dense, moe_experts_grouped
from engine import SamplingParams
from engine.models.config import ModelConfig
from engine.models.tiny_model import tiny_config

E, H, I = 8, 64, 32  # noqa: E741 (experts, hidden, intermediate: the papers' names)


def _weights(dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    return (torch.randn(E, 2 * I, H, generator=g) * 0.2).to(dtype), (torch.randn(E, H, I, generator=g) * 0.2).to(dtype)


def _naive(x, weights, ids, w13, w2, activation="silu"):
    out = torch.zeros(x.shape, dtype=torch.float32)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            gate, up = (w13[e].float() @ x[t].float()).chunk(2)
            act = F.gelu(gate, approximate="tanh") if activation != "silu" else F.silu(gate)
            out[t] += float(weights[t, j]) * (w2[e].float() @ (act * up))
    return out


def _routing(num_tokens: int, k: int, seed: int, skip_expert: int | None = None):
    g = torch.Generator().manual_seed(seed)
    experts = [e for e in range(E) if e != skip_expert]
    ids = torch.stack([torch.tensor(experts)[torch.randperm(len(experts), generator=g)[:k]] for _ in range(num_tokens)])
    return torch.rand(num_tokens, k, generator=g), ids


@pytest.mark.parametrize("impl", [moe_experts_grouped, moe_experts_dense])
@pytest.mark.parametrize("num_tokens,k", [(1, 1), (1, 2), (7, 2), (40, 3)])
@pytest.mark.parametrize("activation", ["silu", "gelu_pytorch_tanh"])
def test_moe_experts_equal_a_per_token_loop(impl, num_tokens, k, activation):
    w13, w2 = _weights()
    x = torch.randn(num_tokens, H, generator=torch.Generator().manual_seed(num_tokens))
    weights, ids = _routing(num_tokens, k, seed=k, skip_expert=3)  # an expert that gets no tokens
    got = impl(x, weights, ids, w13, w2, activation)
    torch.testing.assert_close(got, _naive(x, weights, ids, w13, w2, activation), rtol=1e-5, atol=1e-5)


def test_moe_experts_bf16_and_under_compile():
    w13, w2 = _weights(torch.bfloat16)
    x = torch.randn(12, H).bfloat16()
    weights, ids = _routing(12, 2, seed=5)
    want = _naive(x, weights, ids, w13, w2)
    for impl in (moe_experts_grouped, moe_experts_dense):
        torch.testing.assert_close(impl(x, weights, ids, w13, w2, "silu").float(), want, rtol=3e-2, atol=3e-2)
    fn = torch.compile(
        lambda x, w, i: torch.ops.kiln.moe_experts(x, w, i, w13.float(), w2.float(), "silu"),
        fullgraph=True,
        dynamic=True,
    )
    for n in (3, 9):
        x = torch.randn(n, H)
        weights, ids = _routing(n, 2, seed=n)
        torch.testing.assert_close(
            fn(x, weights, ids), _naive(x, weights, ids, w13.float(), w2.float()), rtol=1e-4, atol=1e-4
        )


def test_moe_config_fields():
    mixtral = ModelConfig.from_dict(tiny_config("mixtral", 512, 1, 2, 0))
    assert (mixtral.num_experts, mixtral.num_experts_per_tok, mixtral.sparse_layers) == (4, 2, (0, 1))
    assert mixtral.norm_topk_prob and mixtral.moe_intermediate_size == 128
    qwen3 = ModelConfig.from_dict({**tiny_config("qwen3_moe", 512, 1, 2, 0), "num_local_experts": 8})
    assert qwen3.sparse_layers == (0,) and qwen3.qk_norm  # layer 1 is in mlp_only_layers
    qwen2 = ModelConfig.from_dict({**tiny_config("qwen2_moe", 512, 1, 2, 0), "decoder_sparse_step": 2})
    assert qwen2.sparse_layers == (1,) and qwen2.shared_expert_intermediate_size == 96 and qwen2.qkv_bias
    dense = ModelConfig.from_dict(tiny_config("llama", 512, 1, 2, 0))
    assert not dense.is_moe and qwen2.num_parameters() > 0


def test_compiled_moe_model_matches_eager(tiny_models, make_llm):
    model = tiny_models["qwen3_moe"]
    prompts = [[5 + i, 17, 300 + i, 42] * (1 + i) for i in range(6)]
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    eager = make_llm(model, max_num_seqs=4).generate(prompts, params, use_tqdm=False)
    compiled = make_llm(model, max_num_seqs=4, enforce_eager=False).generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in compiled] == [o.outputs[0].token_ids for o in eager]
