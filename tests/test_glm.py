"""GLM models: transformers' GlmForCausalLM / Glm4ForCausalLM token for token, and the original
ChatGLM checkpoint layout (weights renamed from the tiny GLM one) giving the same tokens."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from engine import SamplingParams
from engine.models.glm import hf_weight_name
from tests.test_engine_vs_hf import _prompts, hf_greedy

MAX_TOKENS = 10
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
GLM_CONFIGS = {
    "glm": dict(model_type="glm", architectures=["GlmForCausalLM"]),
    "glm4": dict(model_type="glm4", architectures=["Glm4ForCausalLM"]),
}


@pytest.fixture(scope="module")
def glm_models(tmp_path_factory):
    from engine.models.tiny_model import make_tiny_model

    root = tmp_path_factory.mktemp("glm")
    return {name: make_tiny_model(root / name, arch="llama", seed=11 + i,
                                  overrides=dict(cfg, partial_rotary_factor=0.5, attention_bias=True,
                                                 rope_scaling=None))
            for i, (name, cfg) in enumerate(GLM_CONFIGS.items())}


def to_chatglm_layout(src, dst):
    """A tiny transformers GLM checkpoint rewritten as ChatGLM3 / GLM-4-chat ships: its config.json
    keys and `transformer.encoder.layers.*` tensors with fused query_key_value."""
    from safetensors.torch import load_file, save_file

    dst.mkdir()
    for f in src.iterdir():
        if f.suffix != ".safetensors" and f.name not in ("config.json", "generation_config.json"):
            shutil.copy(f, dst / f.name)
    cfg = json.loads((src / "config.json").read_text())
    w = load_file(str(src / "model.safetensors"))
    out = {"transformer.embedding.word_embeddings.weight": w["model.embed_tokens.weight"],
           "transformer.encoder.final_layernorm.weight": w["model.norm.weight"],
           "transformer.output_layer.weight": w["lm_head.weight"],
           "transformer.rotary_pos_emb.inv_freq": torch.ones(cfg["head_dim"] // 4)}
    for i in range(cfg["num_hidden_layers"]):
        hf, cg = f"model.layers.{i}.", f"transformer.encoder.layers.{i}."
        for kind in ("weight", "bias"):
            out[cg + f"self_attention.query_key_value.{kind}"] = torch.cat(
                [w[hf + f"self_attn.{p}_proj.{kind}"] for p in "qkv"])
        out[cg + "self_attention.dense.weight"] = w[hf + "self_attn.o_proj.weight"]
        out[cg + "mlp.dense_h_to_4h.weight"] = w[hf + "mlp.gate_up_proj.weight"]
        out[cg + "mlp.dense_4h_to_h.weight"] = w[hf + "mlp.down_proj.weight"]
        out[cg + "input_layernorm.weight"] = w[hf + "input_layernorm.weight"]
        out[cg + "post_attention_layernorm.weight"] = w[hf + "post_attention_layernorm.weight"]
    save_file(out, str(dst / "model.safetensors"))
    (dst / "config.json").write_text(json.dumps({
        "model_type": "chatglm", "architectures": ["ChatGLMModel"], "num_layers": cfg["num_hidden_layers"],
        "hidden_size": cfg["hidden_size"], "ffn_hidden_size": cfg["intermediate_size"],
        "kv_channels": cfg["head_dim"], "num_attention_heads": cfg["num_attention_heads"],
        "multi_query_attention": True, "multi_query_group_num": cfg["num_key_value_heads"],
        "padded_vocab_size": cfg["vocab_size"], "seq_length": cfg["max_position_embeddings"],
        "layernorm_epsilon": cfg["rms_norm_eps"], "rmsnorm": True, "add_bias_linear": False, "add_qkv_bias": True,
        "post_layer_norm": True, "apply_residual_connection_post_layernorm": False, "original_rope": True,
        "rope_ratio": cfg.get("rope_theta", 10000.0) / 10000.0, "eos_token_id": cfg["eos_token_id"],
        "pad_token_id": cfg["pad_token_id"], "tie_word_embeddings": False, "torch_dtype": "float32"}))
    return dst


@pytest.mark.parametrize("name", list(GLM_CONFIGS))
def test_glm_greedy_matches_transformers(name, glm_models, make_llm):
    model = glm_models[name]
    llm = make_llm(model, max_num_seqs=16)
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
    llm = make_llm(chatglm, max_num_seqs=16)
    assert llm.engine.model_config.model_type == "chatglm"
    prompts = _prompts(llm.engine.model_config.vocab_size)[::2]
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    expected = hf_greedy(str(glm_models["glm"]), prompts, MAX_TOKENS)
    assert [o.outputs[0].token_ids for o in outs] == expected


def test_weight_names():
    assert hf_weight_name("transformer.encoder.layers.3.self_attention.query_key_value.bias", "chatglm") == \
        "model.layers.3.self_attn.qkv_proj.bias"
    assert hf_weight_name("transformer.output_layer.weight", "chatglm") == "lm_head.weight"
    assert hf_weight_name("model.layers.0.post_attention_layernorm.weight", "glm4") == \
        "model.layers.0.pre_feedforward_layernorm.weight"
    assert hf_weight_name("model.layers.0.post_self_attn_layernorm.weight", "glm4") == \
        "model.layers.0.post_attention_layernorm.weight"
    assert hf_weight_name("model.layers.0.post_attention_layernorm.weight", "glm") == \
        "model.layers.0.post_attention_layernorm.weight"


def test_partial_rotary_without_interleaving_matches_transformers(make_llm, tmp_path):
    """The partial rotary path on its own (Phi-4-mini's partial_rotary_factor 0.75, rotate-half)."""
    from engine.models.tiny_model import make_tiny_model

    model = make_tiny_model(tmp_path / "phi3-partial", arch="phi3", seed=3,
                            overrides={"partial_rotary_factor": 0.75})
    llm = make_llm(model)
    config = llm.engine.model_config
    assert (config.rotary_dim, config.rope_interleaved) == (config.head_dim * 3 // 4, False)
    prompts = _prompts(config.vocab_size)[::4]
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == hf_greedy(str(model), prompts, MAX_TOKENS)
