"""Speculative decoding's draft side as the builder assembles it: a draft model (a small causal LM
with the target's tokenizer) or an EAGLE head (engine/models/eagle.py), checked against the target."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from engine.models.config import ModelConfig


@dataclass
class DraftParts:
    """The draft module, the geometry of its KV cache (config.num_layers, num_kv_heads, head_dim)
    and its attention backend."""

    model: nn.Module
    config: Any
    backend: Any
    vocab_ids: torch.Tensor | None = None  # a draft model's draft vocabulary (load_draft_vocab), or None


DRAFT_VOCAB_FILE = "draft_vocab.json"


def load_draft_vocab(path: Path, draft: ModelConfig, target_vocab: int) -> torch.Tensor | None:
    """A draft model's draft vocabulary: the token ids it may propose, from `draft_vocab.json`
    ({"token_ids": [...]}, ascending) in its directory, or None (the whole vocabulary). The draft's
    LM head is then evaluated on those rows only (the head of a 49k-token vocabulary is a fifth of
    a 135M model): its distribution q puts zero on every other token, which rejection sampling
    handles exactly (such a token is simply never drafted)."""
    file = Path(path) / DRAFT_VOCAB_FILE if Path(path).is_dir() else None
    if file is None or not file.is_file():
        return None
    try:
        ids = json.loads(file.read_text())["token_ids"]
    except (ValueError, KeyError, TypeError) as e:
        raise ValueError(f'speculative_model {path}: {DRAFT_VOCAB_FILE} is not {{"token_ids": [...]}}: {e}') from None
    if not ids or not all(isinstance(i, int) for i in ids):
        raise ValueError(f"speculative_model {path}: {DRAFT_VOCAB_FILE} must list token ids (integers)")
    out = torch.tensor(ids, dtype=torch.int64)
    if bool((out[1:] <= out[:-1]).any()):
        raise ValueError(f"speculative_model {path}: {DRAFT_VOCAB_FILE}'s token ids must be ascending and distinct")
    if int(out[0]) < 0 or int(out[-1]) >= min(draft.vocab_size, target_vocab):
        raise ValueError(
            f"speculative_model {path}: {DRAFT_VOCAB_FILE} names token ids outside the vocabulary "
            f"(0..{min(draft.vocab_size, target_vocab) - 1})"
        )
    return out


def check_draft_model(draft: ModelConfig, target: ModelConfig, tokenizer_len: int, path: Path) -> None:
    """A draft model must speak the target's tokenizer: its vocabulary covers every token id the
    tokenizer makes (a different tokenizer's ids would mean other tokens), and it generates."""
    if not draft.generates:
        raise ValueError(f"speculative_model {path}: the checkpoint has no language-model head (a bare model)")
    if draft.vocab_size < tokenizer_len:
        raise ValueError(
            f"speculative_model {path}: its vocabulary ({draft.vocab_size} tokens) does not cover the "
            f"target's tokenizer ({tokenizer_len} tokens): a draft model must use the target's "
            "tokenizer"
        )
    if draft.is_moe:
        raise ValueError(f"speculative_model {path}: a mixture-of-experts draft model is not supported")
