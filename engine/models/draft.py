"""Speculative decoding's draft side as the builder assembles it: a draft model (a small causal LM
with the target's tokenizer) or an EAGLE head (engine/models/eagle.py), checked against the target."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch import nn

from engine.models.config import ModelConfig


@dataclass
class DraftParts:
    """The draft module, the geometry of its KV cache (config.num_layers, num_kv_heads, head_dim)
    and its attention backend."""

    model: nn.Module
    config: Any
    backend: Any


def check_draft_model(draft: ModelConfig, target: ModelConfig, tokenizer_len: int, path: Path) -> None:
    """A draft model must speak the target's tokenizer: its vocabulary covers every token id the
    tokenizer makes (a different tokenizer's ids would mean other tokens), and it generates."""
    if not draft.generates:
        raise ValueError(f"speculative_model {path}: the checkpoint has no language-model head (a bare model)")
    if draft.vocab_size < tokenizer_len:
        raise ValueError(f"speculative_model {path}: its vocabulary ({draft.vocab_size} tokens) does not cover the "
                         f"target's tokenizer ({tokenizer_len} tokens): a draft model must use the target's "
                         "tokenizer")
    if draft.is_moe:
        raise ValueError(f"speculative_model {path}: a mixture-of-experts draft model is not supported")
