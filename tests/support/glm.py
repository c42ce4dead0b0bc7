"""GLM checkpoints in the layouts kiln reads."""

from __future__ import annotations

import json
import shutil

import torch

GLM_CONFIGS = {
    "glm": dict(model_type="glm", architectures=["GlmForCausalLM"]),
    "glm4": dict(model_type="glm4", architectures=["Glm4ForCausalLM"]),
}


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
    out = {
        "transformer.embedding.word_embeddings.weight": w["model.embed_tokens.weight"],
        "transformer.encoder.final_layernorm.weight": w["model.norm.weight"],
        "transformer.output_layer.weight": w["lm_head.weight"],
        "transformer.rotary_pos_emb.inv_freq": torch.ones(cfg["head_dim"] // 4),
    }
    for i in range(cfg["num_hidden_layers"]):
        hf, cg = f"model.layers.{i}.", f"transformer.encoder.layers.{i}."
        for kind in ("weight", "bias"):
            out[cg + f"self_attention.query_key_value.{kind}"] = torch.cat(
                [w[hf + f"self_attn.{p}_proj.{kind}"] for p in "qkv"]
            )
        out[cg + "self_attention.dense.weight"] = w[hf + "self_attn.o_proj.weight"]
        out[cg + "mlp.dense_h_to_4h.weight"] = w[hf + "mlp.gate_up_proj.weight"]
        out[cg + "mlp.dense_4h_to_h.weight"] = w[hf + "mlp.down_proj.weight"]
        out[cg + "input_layernorm.weight"] = w[hf + "input_layernorm.weight"]
        out[cg + "post_attention_layernorm.weight"] = w[hf + "post_attention_layernorm.weight"]
    save_file(out, str(dst / "model.safetensors"))
    (dst / "config.json").write_text(
        json.dumps(
            {
                "model_type": "chatglm",
                "architectures": ["ChatGLMModel"],
                "num_layers": cfg["num_hidden_layers"],
                "hidden_size": cfg["hidden_size"],
                "ffn_hidden_size": cfg["intermediate_size"],
                "kv_channels": cfg["head_dim"],
                "num_attention_heads": cfg["num_attention_heads"],
                "multi_query_attention": True,
                "multi_query_group_num": cfg["num_key_value_heads"],
                "padded_vocab_size": cfg["vocab_size"],
                "seq_length": cfg["max_position_embeddings"],
                "layernorm_epsilon": cfg["rms_norm_eps"],
                "rmsnorm": True,
                "add_bias_linear": False,
                "add_qkv_bias": True,
                "post_layer_norm": True,
                "apply_residual_connection_post_layernorm": False,
                "original_rope": True,
                "rope_ratio": cfg.get("rope_theta", 10000.0) / 10000.0,
                "eos_token_id": cfg["eos_token_id"],
                "pad_token_id": cfg["pad_token_id"],
                "tie_word_embeddings": False,
                "torch_dtype": "float32",
            }
        )
    )
    return dst
