"""Build a model and fill its weights: from HF safetensors (single or sharded), or random (dummy)."""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

import torch
from safetensors import safe_open

from engine.models.config import ModelConfig
from engine.models.llama import LlamaForCausalLM

logger = logging.getLogger(__name__)

_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
# HF name inside a layer -> (kiln parameter, slice index within a fused parameter or None)
_FUSED = {
    "self_attn.q_proj": ("self_attn.qkv_proj", 0),
    "self_attn.k_proj": ("self_attn.qkv_proj", 1),
    "self_attn.v_proj": ("self_attn.qkv_proj", 2),
    "mlp.gate_proj": ("mlp.gate_up_proj", 0),
    "mlp.up_proj": ("mlp.gate_up_proj", 1),
}


def safetensors_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return [model_dir / name for name in sorted(set(weight_map.values()))]
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"model: no *.safetensors files in {model_dir}")
    return files


def _fused_slices(model: LlamaForCausalLM, kiln_name: str) -> list[tuple[int, int]]:
    cfg = model.config
    if kiln_name.endswith("qkv_proj"):
        q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        return [(0, q), (q, q + kv), (q + kv, q + 2 * kv)]
    f = cfg.intermediate_size
    return [(0, f), (f, 2 * f)]


def _target(model: LlamaForCausalLM, hf_name: str) -> tuple[str, tuple[int, int] | None] | None:
    """Map an HF tensor name to (kiln parameter name, rows of a fused parameter)."""
    if hf_name == "model.embed_tokens.weight":
        return "embed_tokens.weight", None
    if hf_name == "model.norm.weight":
        return "norm.weight", None
    if hf_name == "lm_head.weight":
        return ("lm_head.weight", None) if model.lm_head is not None else None
    m = _LAYER.match(hf_name)
    if not m:
        return None
    layer, rest = m.group(1), m.group(2)
    module, _, kind = rest.rpartition(".")
    if module in _FUSED:
        fused, idx = _FUSED[module]
        name = f"layers.{layer}.{fused}.{kind}"
        return name, _fused_slices(model, name.rsplit(".", 1)[0])[idx]
    if "rotary_emb" in rest:
        return None
    return f"layers.{layer}.{rest}", None


def load_model(model_dir: Path, config: ModelConfig, dtype: torch.dtype, device: torch.device,
               max_positions: int, load_format: str = "auto", seed: int = 0) -> LlamaForCausalLM:
    with torch.device("meta"):
        model = LlamaForCausalLM(config, max_positions)
    model = model.to_empty(device=device)
    model.to(dtype)
    model.rotary.cos_sin = model.rotary.cos_sin.float()
    model.rotary.fill()
    if load_format == "dummy":
        _init_dummy(model, seed)
    else:
        _load_safetensors(model, model_dir)
    return model.eval().requires_grad_(False)


def _init_dummy(model: LlamaForCausalLM, seed: int) -> None:
    gen = torch.Generator(device=next(model.parameters()).device).manual_seed(seed)
    for name, param in model.named_parameters():
        if name.endswith("norm.weight"):  # unit scale: weight 1, or 0 where the norm adds an offset (Gemma)
            param.data.fill_(1.0 - model.config.norm_weight_offset)
        elif name.endswith("bias"):
            param.data.zero_()
        else:
            param.data.normal_(0.0, 0.02, generator=gen)


@torch.no_grad()
def _load_safetensors(model: LlamaForCausalLM, model_dir: Path) -> None:
    params = dict(model.named_parameters())
    seen: dict[str, int] = {}
    for file in safetensors_files(model_dir):
        with safe_open(str(file), framework="pt") as f:
            for hf_name in f.keys():
                target = _target(model, hf_name)
                if target is None:
                    continue
                name, rows = target
                if name not in params:
                    raise ValueError(f"model: checkpoint tensor {hf_name} has no place in the model ({name})")
                param = params[name]
                tensor = f.get_tensor(hf_name)
                dest = param.data if rows is None else param.data[rows[0]:rows[1]]
                if tuple(dest.shape) != tuple(tensor.shape):
                    raise ValueError(f"model: {hf_name} has shape {tuple(tensor.shape)}, "
                                     f"expected {tuple(dest.shape)}")
                dest.copy_(tensor.to(dtype=dest.dtype))
                seen[name] = seen.get(name, 0) + (dest.numel())
    missing = [n for n, p in params.items() if seen.get(n, 0) != p.numel()]
    if missing:
        raise ValueError(f"model: checkpoint in {model_dir} lacks weights for {missing[:5]}"
                         f"{' ...' if len(missing) > 5 else ''}")
