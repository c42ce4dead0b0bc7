"""GPU checks of the features built without a GPU: the grouped MoE op inside a CUDA graph,
MoE / LoRA / speculative decoding / structured outputs through compiled engines with decode
graphs, against eager engines on the same weights. float32 end to end (the MoE op then takes
its dense path; the grouped one is checked directly in bf16), so tokens must match exactly.
"""

from __future__ import annotations

import pytest
import torch

from engine import LoRARequest, SamplingParams, StructuredOutputsParams

pytestmark = pytest.mark.gpu

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
PROMPTS = [[5 + i, 90 + 7 * i, 300 - i, 42] * (1 + i % 3) for i in range(12)]


def test_grouped_moe_op_replays_in_a_cuda_graph():
    from compiler.kernels.moe import moe_experts_dense, moe_experts_grouped

    e, h, i, k, t = 16, 256, 128, 2, 24
    g = torch.Generator(device="cuda").manual_seed(0)
    w13 = (torch.randn(e, 2 * i, h, device="cuda", generator=g) * 0.05).bfloat16()
    w2 = (torch.randn(e, h, i, device="cuda", generator=g) * 0.05).bfloat16()
    x = torch.randn(t, h, device="cuda", generator=g).bfloat16()
    weights, ids = torch.rand(t, e, device="cuda", generator=g).softmax(-1).topk(k, dim=-1)
    eager = moe_experts_grouped(x, weights, ids, w13, w2, "silu")
    dense = moe_experts_dense(x, weights, ids, w13, w2, "silu")
    torch.testing.assert_close(eager.float(), dense.float(), rtol=2e-2, atol=2e-2)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = moe_experts_grouped(x, weights, ids, w13, w2, "silu")
    new_weights, new_ids = torch.rand(t, e, device="cuda", generator=g).softmax(-1).topk(k, dim=-1)
    weights.copy_(new_weights)
    ids.copy_(new_ids)
    graph.replay()
    torch.testing.assert_close(out, moe_experts_grouped(x, weights, ids, w13, w2, "silu"))


def _engine_pair(model: str, **kw):
    from engine.entrypoints.llm import LLM

    common = dict(
        model=model,
        device="cuda",
        dtype="float32",
        max_num_seqs=8,
        max_model_len=256,
        num_gpu_blocks=256,
        cuda_graph_sizes=[1, 2, 4, 8],
    )
    return LLM(**common, **kw), LLM(**common, enforce_eager=True)


def test_moe_model_with_decode_graphs_equals_eager(tiny_models):
    graphs, eager = _engine_pair(str(tiny_models["qwen3_moe"]))
    a = graphs.generate(PROMPTS, GREEDY, use_tqdm=False)
    b = eager.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in a] == [o.outputs[0].token_ids for o in b]


def test_lora_spec_decode_and_structured_outputs_with_graphs(tiny_llama, tmp_path):
    from engine.bench.lora import write_random_adapter
    from engine.entrypoints.llm import LLM
    from engine.models.config import ModelConfig

    config = ModelConfig.from_dir(tiny_llama)
    adapters = [
        LoRARequest(f"a{i}", i + 1, str(write_random_adapter(config, tmp_path / f"a{i}", 8, seed=i))) for i in range(2)
    ]
    common = dict(
        model=str(tiny_llama),
        device="cuda",
        dtype="float32",
        max_num_seqs=8,
        max_model_len=256,
        num_gpu_blocks=256,
        cuda_graph_sizes=[1, 2, 4, 8],
        enable_lora=True,
        max_loras=2,
        max_lora_rank=8,
    )
    graphs = LLM(**common, speculative_method="ngram", num_speculative_tokens=3)
    eager = LLM(**common, enforce_eager=True)
    loras = [None, adapters[0], adapters[1]] * 4
    a = graphs.generate(PROMPTS, GREEDY, use_tqdm=False, lora_request=loras)
    b = eager.generate(PROMPTS, GREEDY, use_tqdm=False, lora_request=loras)
    assert [o.outputs[0].token_ids for o in a] == [o.outputs[0].token_ids for o in b]
    choice = SamplingParams(
        temperature=0.8,
        seed=1,
        max_tokens=40,
        structured_outputs=StructuredOutputsParams(choice=["alpha", "beta gamma"]),
    )
    outs = graphs.generate(PROMPTS[:4], choice, use_tqdm=False)
    assert all(o.outputs[0].text in ("alpha", "beta gamma") for o in outs)
    for llm in (graphs, eager):
        llm.engine.core.check_integrity()
        assert llm.engine.core.pool.is_fully_free()


def test_kv_tiers_host_and_disk_with_graphs(tiny_llama, tmp_path):
    """The KV tiers on the device: blocks copied out of the GPU cache (under async scheduling),
    held in the host tier and on disk; after eviction and after a restart they load back into the
    cache and the tokens equal the first run's (float32)."""
    from engine.entrypoints.llm import LLM

    common = dict(
        model=str(tiny_llama),
        device="cuda",
        dtype="float32",
        max_num_seqs=8,
        max_model_len=256,
        num_gpu_blocks=256,
        cuda_graph_sizes=[1, 2, 4, 8],
        kv_offloading_size=0.05,
        kv_disk_path=str(tmp_path),
    )
    prompts = [[(s * 131 + i * 7) % 480 + 10 for i in range(150)] for s in range(3)]
    llm = LLM(**common)
    want = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
    llm.reset_prefix_cache()  # every idle block leaves the cache
    again = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in again] == want
    assert [o.num_cached_tokens for o in again] == [144] * 3
    host = llm.engine.core.kv_tiers.store.tiers[0]
    assert host.name == "host" and host.stats.hits == 27
    llm.close()
    restarted = LLM(**common)
    out = restarted.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in out] == want and [o.num_cached_tokens for o in out] == [144] * 3
    assert restarted.engine.core.kv_tiers.store.tiers[1].stats.hits == 27
    restarted.close()
