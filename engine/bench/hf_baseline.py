"""The transformers baseline of `kiln bench latency --baseline`: the same weights in a Hugging Face
model (quantised layers dequantised), generating greedily with `generate` (eager, sdpa)."""

from __future__ import annotations

import time

import torch


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _dense(module: torch.nn.Module, kind: str, dtype: torch.dtype) -> torch.Tensor | None:
    """A linear layer's weight or bias; a quantised layer's weight dequantised (for the baseline)."""
    if kind == "weight" and getattr(module, "quant", None) is not None:
        return module.quant.weight(module, dtype)
    return getattr(module, kind)


def hf_state_dict_from_kiln(model) -> dict[str, torch.Tensor]:
    """kiln's parameters under transformers' names (views; fused q/k/v and gate/up split)."""
    cfg = model.config
    q = cfg.num_heads * cfg.head_dim
    kv = cfg.num_kv_heads * cfg.head_dim
    f = cfg.intermediate_size
    dtype = model.embed_tokens.weight.dtype
    sd: dict[str, torch.Tensor] = {
        "model.embed_tokens.weight": model.embed_tokens.weight,
        "model.norm.weight": model.norm.weight,
    }
    if model.lm_head is not None:
        sd["lm_head.weight"] = model.lm_head.weight
    for i, layer in enumerate(model.layers):
        pre = f"model.layers.{i}."
        attn, mlp = layer.self_attn, layer.mlp
        for kind in ("weight", "bias"):
            t = _dense(attn.qkv_proj, kind, dtype)
            if t is not None:
                sd[pre + f"self_attn.q_proj.{kind}"] = t[:q]
                sd[pre + f"self_attn.k_proj.{kind}"] = t[q : q + kv]
                sd[pre + f"self_attn.v_proj.{kind}"] = t[q + kv :]
            t = _dense(attn.o_proj, kind, dtype)
            if t is not None:
                sd[pre + f"self_attn.o_proj.{kind}"] = t
            t = _dense(mlp.gate_up_proj, kind, dtype)
            if t is not None:
                sd[pre + f"mlp.gate_proj.{kind}"] = t[:f]
                sd[pre + f"mlp.up_proj.{kind}"] = t[f:]
            t = _dense(mlp.down_proj, kind, dtype)
            if t is not None:
                sd[pre + f"mlp.down_proj.{kind}"] = t
        if attn.q_norm is not None:
            sd[pre + "self_attn.q_norm.weight"] = attn.q_norm.weight
            sd[pre + "self_attn.k_norm.weight"] = attn.k_norm.weight
        sd[pre + "input_layernorm.weight"] = layer.input_layernorm.weight
        sd[pre + "post_attention_layernorm.weight"] = layer.post_attention_layernorm.weight
    return sd


def build_hf_model(engine) -> torch.nn.Module:
    """transformers' model for the engine's config.json, on the engine's device, with kiln's weights."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(str(engine.model_dir))
    with torch.device(engine.core.device):
        hf = AutoModelForCausalLM.from_config(config, dtype=engine.core.dtype, attn_implementation="sdpa")
    hf.eval().requires_grad_(False)
    missing, unexpected = hf.load_state_dict(hf_state_dict_from_kiln(engine.core.model), strict=False)
    tied = getattr(config, "tie_word_embeddings", False)
    missing = [m for m in missing if not (tied and m == "lm_head.weight")]
    if missing or unexpected:
        raise RuntimeError(
            f"baseline: weights do not map onto transformers' model: missing {missing[:4]}, unexpected {unexpected[:4]}"
        )
    return hf


def run_hf(hf, prompts: list[list[int]], output_len: int, device: torch.device) -> tuple[float, list[list[int]]]:
    ids = torch.tensor(prompts, dtype=torch.long, device=device)
    mask = torch.ones_like(ids)

    def generate(n: int):
        return hf.generate(
            ids,
            attention_mask=mask,
            max_new_tokens=n,
            min_new_tokens=n,
            do_sample=False,
            pad_token_id=0,
            eos_token_id=None,
        )

    with torch.inference_mode():
        generate(min(4, output_len))  # warm-up (cuBLAS handles, allocator)
        _sync(device)
        t0 = time.perf_counter()
        out = generate(output_len)
        _sync(device)
        seconds = time.perf_counter() - t0
    return seconds, out[:, ids.shape[1] :].tolist()
