"""Write a tiny HF checkpoint as a GGUF file in llama.cpp's on-disk layout (test helper).

Metadata under llama.cpp's keys, the byte-level BPE tokenizer as a "gpt2" vocabulary with its
merges and chat template, tensors under llama.cpp's names, with what its converter does to them
(Llama q/k rows permuted for its rotary, Gemma norm weights stored as 1 + w). Basic formats are
quantised with the `gguf` package; the k-quants (which it cannot quantise) get random valid blocks
with moderate scales, so every type is exercised on a real file. The reference is transformers
loading the same file.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file

# HF model_type -> GGUF general.architecture
GGUF_ARCH = {
    "llama": "llama",
    "mistral": "llama",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "gemma2": "gemma2",
    "gemma3_text": "gemma3",
}
_LAYER = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
}
_SANDWICH = {
    "pre_feedforward_layernorm": "ffn_norm",
    "post_attention_layernorm": "post_attention_norm",
    "post_feedforward_layernorm": "post_ffw_norm",
}
_K_QUANTS = {"Q2_K", "Q4_K", "Q5_K", "Q6_K"}


def gguf_name(hf: str, sandwich: bool) -> str:
    top = {
        "model.embed_tokens.weight": "token_embd.weight",
        "model.norm.weight": "output_norm.weight",
        "lm_head.weight": "output.weight",
    }
    if hf in top:
        return top[hf]
    _, _, layer, rest = hf.split(".", 3)
    module, _, kind = rest.rpartition(".")
    part = (_SANDWICH.get(module) if sandwich else None) or _LAYER[module]
    return f"blk.{layer}.{part}.{kind}"


def _permute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """llama.cpp's convert_hf_to_gguf permute: HF's half-split rotary rows -> interleaved pairs."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def random_k_blocks(qtype: str, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """Random valid blocks of a k-quant with scales that give weights of about +-0.1."""
    import gguf

    block, nbytes = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[qtype]]
    raw = rng.integers(0, 256, size=(rows, cols // block, nbytes), dtype=np.uint8)

    def f16(offset: int, lo: float, hi: float) -> None:
        vals = rng.uniform(lo, hi, size=raw.shape[:2]).astype(np.float16)
        raw[:, :, offset : offset + 2] = vals.view(np.uint8).reshape(*raw.shape[:2], 2)

    if qtype == "Q2_K":  # (a type kiln refuses: only its layout matters)
        pass
    elif qtype == "Q6_K":  # int8 scales times 6-bit values minus 32
        f16(208, 1e-5, 4e-5)
    else:  # d * scale * q - dmin * min: centre the values around zero
        f16(0, 2e-4, 4e-4)
        f16(2, 1e-3, 2e-3) if qtype == "Q4_K" else f16(2, 2e-3, 4e-3)
    return raw.reshape(rows, -1)


def llama3_freq_factors(scaling: dict, head_dim: int, theta: float) -> np.ndarray:
    """What llama.cpp's converter stores for Llama 3 rope scaling: a divisor per frequency."""
    factor, low, high = scaling["factor"], scaling.get("low_freq_factor", 1.0), scaling.get("high_freq_factor", 4.0)
    old = scaling["original_max_position_embeddings"]
    out = []
    for i in range(0, head_dim, 2):
        wavelen = 2 * np.pi * theta ** (i / head_dim)
        if wavelen < old / high:
            out.append(1.0)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


def write_gguf(
    model_dir: Path, out: Path, types: dict[str, str] | str = "F32", name: str | None = None, seed: int = 0
) -> Path:
    """types: one GGML type name for every matrix, or {substring of the GGUF name: type} (first match;
    norms and biases always F32)."""
    import gguf

    cfg = json.loads((model_dir / "config.json").read_text())
    model_type = cfg["model_type"]
    arch = GGUF_ARCH[model_type]
    sandwich = model_type in ("gemma2", "gemma3_text")
    gemma = model_type.startswith("gemma")
    heads, kv_heads = cfg["num_attention_heads"], cfg.get("num_key_value_heads") or cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    w = gguf.GGUFWriter(str(out), arch)
    w.add_name(name or f"tiny {model_type}")
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_dimension_count(head_dim)
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    theta = cfg.get("rope_theta") or (cfg.get("rope_parameters") or {}).get("full_attention", {}).get("rope_theta")
    w.add_rope_freq_base(float(theta or 10000.0))
    w.add_vocab_size(cfg["vocab_size"])
    if cfg.get("sliding_window") and sandwich:
        w.add_sliding_window(cfg["sliding_window"])
    if model_type == "gemma2":
        w.add_attn_logit_softcapping(cfg["attn_logit_softcapping"])
        w.add_final_logit_softcapping(cfg["final_logit_softcapping"])
    _add_tokenizer(w, model_dir, cfg)
    scaling = cfg.get("rope_scaling") or cfg.get("rope_parameters") or {}
    if arch == "llama" and scaling.get("rope_type") == "llama3":
        w.add_tensor("rope_freqs.weight", llama3_freq_factors(scaling, head_dim, float(theta or 10000.0)))

    rng = np.random.default_rng(seed)
    tensors = load_file(str(model_dir / "model.safetensors"))
    for hf, t in tensors.items():
        g = gguf_name(hf, sandwich)
        t = t.float()
        if arch == "llama" and ".attn_q." in g:
            t = _permute(t, heads)
        elif arch == "llama" and ".attn_k." in g:
            t = _permute(t, kv_heads)
        if gemma and g.endswith("norm.weight"):
            t = t + 1.0
        qtype = (
            "F32"
            if t.dim() == 1
            else (types if isinstance(types, str) else next((q for k, q in types.items() if k in g), "F32"))
        )
        arr = t.numpy()
        if qtype in _K_QUANTS:
            data = random_k_blocks(qtype, *arr.shape, rng)
        elif qtype == "F32":
            data = arr
        else:
            data = gguf.quants.quantize(arr, gguf.GGMLQuantizationType[qtype])
        w.add_tensor(g, data, raw_dtype=gguf.GGMLQuantizationType[qtype])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


def _add_tokenizer(w, model_dir: Path, cfg: dict) -> None:
    """The tiny model's byte-level BPE as llama.cpp's "gpt2" vocabulary."""
    tok = json.loads((model_dir / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    special = {t["content"]: t["id"] for t in tok.get("added_tokens", [])}
    vocab.update(special)
    tokens = [None] * len(vocab)
    for text, i in vocab.items():
        tokens[i] = text
    merges = [m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt-2")
    w.add_token_list(tokens)
    w.add_token_types([3 if t in special else 1 for t in tokens])
    w.add_token_merges(merges)
    w.add_bos_token_id(cfg["bos_token_id"])
    w.add_eos_token_id(cfg["eos_token_id"])
    w.add_pad_token_id(cfg["pad_token_id"])
    w.add_add_bos_token(True)
    template = json.loads((model_dir / "tokenizer_config.json").read_text()).get("chat_template")
    if template is None and (model_dir / "chat_template.jinja").is_file():
        template = (model_dir / "chat_template.jinja").read_text()
    if template:
        w.add_chat_template(template)
