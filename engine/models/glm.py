"""GLM models on the Llama-family model: transformers' GlmForCausalLM and Glm4ForCausalLM, and the
original ChatGLM3 / GLM-4-chat checkpoints (model_type "chatglm", `transformer.encoder.layers.*`).

What differs from Llama, and where it lives:
- rotary embeddings on the first half of each head only, with pairs (x0, x1), (x2, x3), ...
  rotated together ("interleaved"), as transformers' GLM code does: `apply_interleaved_rope`
  (engine/layers/rotary.py), selected by ModelConfig.rope_interleaved, over ModelConfig.rotary_dim;
- q/k/v with biases, o_proj without; gate and up projections already fused in the checkpoint
  (gate rows first: kiln's own layout);
- GLM-4: a norm after attention and one after the MLP, the shape of Gemma 2's "sandwich": the
  loader renames GLM-4's norms onto those (`hf_weight_name`);
- ChatGLM's config and weight names are translated to transformers' GLM ones (`chatglm_config`,
  `hf_weight_name`); its fused query_key_value is q rows, then k, then v: kiln's qkv_proj as is.
"""

from __future__ import annotations

import re
from typing import Any

GLM_MODEL_TYPES = ("glm", "glm4", "chatglm")
DEFAULT_PARTIAL_ROTARY = 0.5  # GLM rotates half of each head

# Glm4 decoder-layer norm -> kiln's (sandwich) name. Order matters: each name is mapped once.
_GLM4_NORMS = {
    "post_self_attn_layernorm": "post_attention_layernorm",
    "post_attention_layernorm": "pre_feedforward_layernorm",
    "post_mlp_layernorm": "post_feedforward_layernorm",
}
_CHATGLM_LAYER = re.compile(r"^transformer\.encoder\.layers\.(\d+)\.(.+)$")
_CHATGLM_IN_LAYER = {
    "input_layernorm": "input_layernorm",
    "post_attention_layernorm": "post_attention_layernorm",
    "self_attention.query_key_value": "self_attn.qkv_proj",
    "self_attention.dense": "self_attn.o_proj",
    "mlp.dense_h_to_4h": "mlp.gate_up_proj",
    "mlp.dense_4h_to_h": "mlp.down_proj",
}
_CHATGLM_TOP = {
    "transformer.embedding.word_embeddings.weight": "model.embed_tokens.weight",
    "transformer.encoder.final_layernorm.weight": "model.norm.weight",
    "transformer.output_layer.weight": "lm_head.weight",
}


def chatglm_config(raw: dict[str, Any]) -> dict[str, Any]:
    """A ChatGLM3 / GLM-4-chat config.json in transformers' GLM terms (model_type stays "chatglm"
    so that the loader renames the weights)."""
    if (
        not raw.get("rmsnorm", True)
        or raw.get("apply_residual_connection_post_layernorm", False)
        or not raw.get("post_layer_norm", True)
    ):
        raise ValueError(
            "model: this ChatGLM variant (LayerNorm or post-norm residuals) is not supported; "
            "ChatGLM3 and GLM-4 (RMSNorm, pre-norm) are"
        )
    if raw.get("add_bias_linear", False):
        raise ValueError("model: ChatGLM checkpoints with biases on every linear layer are not supported")
    heads = raw["num_attention_heads"]
    head_dim = raw.get("kv_channels") or raw["hidden_size"] // heads
    kv_heads = raw.get("multi_query_group_num", heads) if raw.get("multi_query_attention", False) else heads
    eos = raw.get("eos_token_id")
    return {
        "model_type": "chatglm",
        "architectures": ["ChatGLMForConditionalGeneration"],  # ("ChatGLMModel" has its LM head: output_layer)
        "vocab_size": raw.get("padded_vocab_size") or raw["vocab_size"],
        "hidden_size": raw["hidden_size"],
        "intermediate_size": raw["ffn_hidden_size"],
        "num_hidden_layers": raw["num_layers"],
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "rms_norm_eps": raw.get("layernorm_epsilon", 1e-5),
        "max_position_embeddings": raw.get("seq_length", 8192),
        "rope_theta": 10000.0 * float(raw.get("rope_ratio", 1.0)),
        "partial_rotary_factor": DEFAULT_PARTIAL_ROTARY,
        "attention_bias": bool(raw.get("add_qkv_bias", True)),
        "tie_word_embeddings": bool(raw.get("tie_word_embeddings", False)),
        "hidden_act": "silu",
        "eos_token_id": eos,
        "bos_token_id": raw.get("bos_token_id"),
        "torch_dtype": raw.get("torch_dtype"),
    }


def hf_weight_name(name: str, model_type: str) -> str:
    """A GLM checkpoint's tensor name in the Llama family's terms (other models: unchanged)."""
    if model_type == "chatglm":
        if name in _CHATGLM_TOP:
            return _CHATGLM_TOP[name]
        m = _CHATGLM_LAYER.match(name)
        if m:
            module, _, kind = m.group(2).rpartition(".")
            if module in _CHATGLM_IN_LAYER:
                return f"model.layers.{m.group(1)}.{_CHATGLM_IN_LAYER[module]}.{kind}"
        return name  # (rotary_pos_emb.inv_freq and the like: no place in the model, skipped)
    if model_type == "glm4":
        head, _, last = name.rpartition(".")  # "...layers.N.<norm>.weight"
        prefix, _, norm = head.rpartition(".")
        if norm in _GLM4_NORMS and ".layers." in name:
            return f"{prefix}.{_GLM4_NORMS[norm]}.{last}"
    return name
