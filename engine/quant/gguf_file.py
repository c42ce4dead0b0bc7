"""GGUF files (llama.cpp's single-file checkpoints): config, tokenizer and weights.

The config and the tokenizer (with its chat template) come from the file's metadata through
transformers' GGUF support, so kiln sees the same config a transformers user would. Tensors are
read one at a time from the memory-mapped file, renamed from llama.cpp's names to HF's and
dequantised (engine/quant/gguf_blocks.py) to float32, undoing what llama.cpp's converter did to
them: the rotary row permutation of Llama-architecture q/k, Gemma's +1 on norm weights.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import torch

from engine.quant.gguf_blocks import dequantize

# llama.cpp tensor name inside a block -> HF name inside model.layers.N
_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
}
# Gemma 2/3 have four norms per layer; llama.cpp's ffn_norm is then the one before the MLP.
_SANDWICH_NAMES = {"ffn_norm": "pre_feedforward_layernorm", "post_attention_norm": "post_attention_layernorm",
                   "post_ffw_norm": "post_feedforward_layernorm"}
_TOP_NAMES = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
              "output.weight": "lm_head.weight"}
_BLOCK = re.compile(r"^blk\.(\d+)\.([a-z0-9_]+)\.(weight|bias)$")
# Tensors llama.cpp stores that kiln derives itself (rope_freqs: llama3 rope factors, from the config).
_SKIPPED = ("rope_freqs.weight",)


def is_gguf(path: str | Path) -> bool:
    p = Path(path)
    return p.suffix.lower() == ".gguf" and p.is_file()


def hf_config(path: str | Path) -> dict[str, Any]:
    """The HF config dict transformers derives from the file's metadata."""
    from transformers import AutoConfig

    p = Path(path)
    try:
        config = AutoConfig.from_pretrained(str(p.parent), gguf_file=p.name)
    except ValueError as exc:  # e.g. an architecture transformers' GGUF mapping lacks
        raise ValueError(f"model: cannot read the config of GGUF file {p}: {exc}") from exc
    return config.to_dict()


def load_tokenizer(path: str | Path):
    """The tokenizer (vocabulary, merges, special tokens, chat template) stored in the file."""
    from transformers import AutoTokenizer

    p = Path(path)
    return AutoTokenizer.from_pretrained(str(p.parent), gguf_file=p.name)


def _architecture(reader) -> str:
    field = reader.fields["general.architecture"]
    return bytes(field.parts[field.data[0]]).decode()


def _hf_name(gguf_name: str, sandwich: bool) -> str | None:
    if gguf_name in _TOP_NAMES:
        return _TOP_NAMES[gguf_name]
    if gguf_name in _SKIPPED:
        return None
    m = _BLOCK.match(gguf_name)
    part = m and ((_SANDWICH_NAMES.get(m.group(2)) if sandwich else None) or _LAYER_NAMES.get(m.group(2)))
    if not part:
        raise ValueError(f"model: GGUF tensor {gguf_name!r} has no place in kiln's models "
                         "(mixture-of-experts GGUF files are not supported)")
    return f"model.layers.{m.group(1)}.{part}.{m.group(3)}"


def _unpermute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row order (its rotary pairs adjacent dims, HF's pairs the two halves)."""
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def iter_tensors(path: str | Path, num_heads: int, num_kv_heads: int,
                 gemma_norms: bool, sandwich: bool) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, float32 tensor) for each weight, one at a time (peak memory: one tensor).
    gemma_norms: norm weights are stored as 1 + w (Gemma); sandwich: Gemma 2/3's four norms."""
    from gguf import GGUFReader

    reader = GGUFReader(str(path))
    permuted = _architecture(reader) == "llama"  # (Mistral GGUFs are written as llama too)
    for t in reader.tensors:
        name = _hf_name(t.name, sandwich)
        if name is None:
            continue
        raw = torch.from_numpy(np.array(t.data))  # a copy of this tensor's bytes only
        w = dequantize(raw, int(t.tensor_type), tuple(int(s) for s in reversed(t.shape.tolist())))
        if permuted and ".self_attn.q_proj." in name:
            w = _unpermute(w, num_heads)
        elif permuted and ".self_attn.k_proj." in name:
            w = _unpermute(w, num_kv_heads)
        if gemma_norms and name.endswith("norm.weight"):
            w = w - 1.0
        yield name, w
