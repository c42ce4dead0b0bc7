"""GLM models: transformers' GlmForCausalLM / Glm4ForCausalLM token for token, and the original
ChatGLM checkpoint layout (weights renamed from the tiny GLM one) giving the same tokens."""

from __future__ import annotations

import pytest

from engine import SamplingParams
from engine.models.glm import hf_weight_name
from tests.support.glm import GLM_CONFIGS, to_chatglm_layout
from tests.support.hf_reference import _prompts, hf_greedy

MAX_TOKENS = 10
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module")
def glm_models(tmp_path_factory):
    from engine.models.tiny_model import make_tiny_model

    root = tmp_path_factory.mktemp("glm")
    return {
        name: make_tiny_model(
            root / name,
            arch="llama",
            seed=11 + i,
            overrides=dict(cfg, partial_rotary_factor=0.5, attention_bias=True, rope_scaling=None),
        )
        for i, (name, cfg) in enumerate(GLM_CONFIGS.items())
    }


@pytest.mark.parametrize("name", list(GLM_CONFIGS))
def test_glm_greedy_matches_transformers(name, glm_models, make_llm):
    model = glm_models[name]
    llm = make_llm(model, max_num_seqs=16, kv_cache_dtype="float32")
    config = llm.engine.model_config
    assert (config.rotary_dim, config.rope_interleaved) == (config.head_dim // 2, True)
    assert config.qkv_bias and not config.o_bias and config.sandwich_norms == (name == "glm4")
    prompts = _prompts(config.vocab_size)[::2]
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    expected = hf_greedy(str(model), prompts, MAX_TOKENS)
    for i, (out, want) in enumerate(zip(outs, expected)):
        assert out.outputs[0].token_ids == want, f"{name} prompt {i} (len {len(prompts[i])}) diverged"


def test_chatglm_layout_gives_the_same_tokens(glm_models, make_llm, tmp_path):
    chatglm = to_chatglm_layout(glm_models["glm"], tmp_path / "chatglm")
    llm = make_llm(chatglm, max_num_seqs=16, kv_cache_dtype="float32")
    assert llm.engine.model_config.model_type == "chatglm"
    prompts = _prompts(llm.engine.model_config.vocab_size)[::2]
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    expected = hf_greedy(str(glm_models["glm"]), prompts, MAX_TOKENS)
    assert [o.outputs[0].token_ids for o in outs] == expected


def test_weight_names():
    assert (
        hf_weight_name("transformer.encoder.layers.3.self_attention.query_key_value.bias", "chatglm")
        == "model.layers.3.self_attn.qkv_proj.bias"
    )
    assert hf_weight_name("transformer.output_layer.weight", "chatglm") == "lm_head.weight"
    assert (
        hf_weight_name("model.layers.0.post_attention_layernorm.weight", "glm4")
        == "model.layers.0.pre_feedforward_layernorm.weight"
    )
    assert (
        hf_weight_name("model.layers.0.post_self_attn_layernorm.weight", "glm4")
        == "model.layers.0.post_attention_layernorm.weight"
    )
    assert (
        hf_weight_name("model.layers.0.post_attention_layernorm.weight", "glm")
        == "model.layers.0.post_attention_layernorm.weight"
    )


def test_partial_rotary_without_interleaving_matches_transformers(make_llm, tmp_path):
    """The partial rotary path on its own (Phi-4-mini's partial_rotary_factor 0.75, rotate-half)."""
    from engine.models.tiny_model import make_tiny_model

    model = make_tiny_model(tmp_path / "phi3-partial", arch="phi3", seed=3, overrides={"partial_rotary_factor": 0.75})
    llm = make_llm(model, kv_cache_dtype="float32")
    config = llm.engine.model_config
    assert (config.rotary_dim, config.rope_interleaved) == (config.head_dim * 3 // 4, False)
    prompts = _prompts(config.vocab_size)[::4]
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == hf_greedy(str(model), prompts, MAX_TOKENS)
