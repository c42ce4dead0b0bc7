"""The speculative-decoding tests' models (a target, noisy draft copies, a smaller draft, EAGLE and
EAGLE-3 heads, a periodic model and the head that predicts it) and settings, shared by
tests/spec_decode/test_spec_models.py, test_spec_uploads.py and test_spec_gpu.py."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine.training.eagle_head import TrainableEagle, eagle_config, random_eagle, save_eagle

K = 3
PROMPTS = [[10 + i, 200 + 3 * i, 30 + 2 * i] for i in range(6)] + [list(range(40, 75)), [5, 6, 7, 8, 9] * 4]


def target_weights(path):
    w = load_file(str(path / "model.safetensors"))
    embed = w["model.embed_tokens.weight"]
    return json.loads((path / "config.json").read_text()), embed, w.get("lm_head.weight", embed)


def noisy_copy(src, dst, scale: float, seed: int = 0):
    """The target with noise on its layer weights: a draft that agrees with it often, not always."""
    shutil.copytree(src, dst)
    w = load_file(str(dst / "model.safetensors"))
    gen = torch.Generator().manual_seed(seed)
    for name, t in w.items():
        if ".layers." in name and name.endswith("weight") and "norm" not in name:
            w[name] = t + scale * t.std() * torch.randn(t.shape, generator=gen)
    save_file(w, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


def succ_eagle(periodic, out):
    """An EAGLE head for the periodic model (engine/models/tiny_model.py make_periodic_model) that
    drafts what it will say: fc passes the embedding of the token through and the layer adds
    nothing, so the target's LM head reads that embedding and picks its successor."""
    cfg, embed, head = target_weights(periodic)
    config = eagle_config(cfg, 1)
    h = cfg["hidden_size"]
    eagle = TrainableEagle(config, 1, embed, head, h)
    with torch.no_grad():
        for p in eagle.parameters():
            p.zero_()
        eagle.fc.weight[:, :h] = torch.eye(h)
        for name, p in eagle.named_parameters():
            if "norm" in name:
                p.fill_(1.0)
    return save_eagle(eagle, out)


def with_draft_vocab(src, dst, token_ids):
    """A copy of draft model src that drafts from token_ids only (draft_vocab.json)."""
    shutil.copytree(src, dst)
    (dst / "draft_vocab.json").write_text(json.dumps({"token_ids": list(token_ids)}))
    return dst


@pytest.fixture(scope="session")
def spec_models(tiny_llama, tmp_path_factory):
    """The drafts and heads, made once for the session: every module only reads them."""
    from engine.models.tiny_model import make_periodic_model, make_tiny_model

    root = tmp_path_factory.mktemp("spec-models")
    cfg, embed, head = target_weights(tiny_llama)
    periodic = make_periodic_model(root / "periodic")
    noisy = noisy_copy(tiny_llama, root / "noisy", 0.1)
    return {
        "target": tiny_llama,
        "noisy": noisy,
        # drafts only even token ids: the target's odd ones are never drafted, always the residual's
        "noisy_vocab": with_draft_vocab(noisy, root / "noisy-vocab", range(0, cfg["vocab_size"], 2)),
        # Another geometry: its own KV tensor of 1 layer x 1 head x 32, over the same block ids.
        "small": make_tiny_model(
            root / "small",
            seed=7,
            overrides=dict(
                num_hidden_layers=1, hidden_size=64, intermediate_size=128, num_attention_heads=2, num_key_value_heads=1
            ),
        ),
        "eagle": random_eagle(root / "eagle", cfg, embed, head, 1, seed=1),
        "eagle3": random_eagle(
            root / "eagle3", cfg, embed, head, 3, seed=2, draft_vocab=torch.arange(0, cfg["vocab_size"], 3)
        ),
        "periodic": periodic,
        "periodic_eagle": succ_eagle(periodic, root / "periodic-eagle"),
    }


# (method, draft) pairs run against the tiny target
METHODS = [
    ("draft_model", "noisy"),
    ("draft_model", "noisy_vocab"),
    ("draft_model", "small"),
    ("eagle", "eagle"),
    ("eagle3", "eagle3"),
]


def spec_settings(models, method, draft, k=K):
    return dict(speculative_method=method, speculative_model=str(models[draft]), num_speculative_tokens=k)
