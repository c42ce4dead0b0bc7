"""An EAGLE / EAGLE-3 head in the public layout (engine/models/eagle.py loads it), as torch modules
that train: its config.json for a target, and writing it out. engine/training/eagle_training.py
trains it; tests make untrained ones (random_eagle).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from engine.layers.rotary import apply_rope


class _Norm(nn.Module):
    """RMSNorm in x's dtype: training runs under bfloat16 autocast, where engine/layers/layernorm.py's
    RMSNorm (which normalises in float32) would give other numbers."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))


def _rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Llama's rotary embedding (halves rotated) of x [B, T, heads, D]: the tables per batch row, from
    the config dict's base (no scaling), the rotation the model's."""
    d = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d)
    freqs = positions[..., None].float() * inv
    emb = torch.cat([freqs, freqs], dim=-1)[:, :, None, :]
    return apply_rope(x, emb.cos(), emb.sin())


class _Attention(nn.Module):
    """Causal attention for training a head, with EAGLE-3's training-time test: pass d of a
    multi-step unroll (row s = the chain seeded at position s, now at position s + d) sees the
    first pass's keys at positions <= s (the target-fed rows a real draft step reads from the
    cache) and, of every later pass, only its own chain's row (the drafted positions s+1..s+d)."""

    def __init__(self, width_in: int, hidden: int, heads: int, kv_heads: int, head_dim: int, theta: float) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim, self.theta = heads, kv_heads, head_dim, theta
        self.q_proj = nn.Linear(width_in, heads * head_dim, bias=False)
        self.k_proj = nn.Linear(width_in, kv_heads * head_dim, bias=False)
        self.v_proj = nn.Linear(width_in, kv_heads * head_dim, bias=False)
        self.o_proj = nn.Linear(heads * head_dim, hidden, bias=False)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, cache: list | None = None) -> torch.Tensor:
        b, t, _ = x.shape
        rep = self.heads // self.kv_heads
        q = _rope(self.q_proj(x).view(b, t, self.heads, self.head_dim), positions, self.theta).transpose(1, 2)
        k = _rope(self.k_proj(x).view(b, t, self.kv_heads, self.head_dim), positions, self.theta)
        v = self.v_proj(x).view(b, t, self.kv_heads, self.head_dim)
        k = k.repeat_interleave(rep, dim=2).transpose(1, 2)  # [b, heads, t, d]
        v = v.repeat_interleave(rep, dim=2).transpose(1, 2)
        if not cache:  # a plain causal pass (or the first of an unroll)
            if cache is not None:
                cache.append((k, v))
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            return self.o_proj(out.transpose(1, 2).reshape(b, t, -1))
        passes = cache + [(k, v)]
        k0, v0 = passes[0]
        scale = self.head_dim**-0.5
        first = (q @ k0.transpose(-1, -2)) * scale  # [b, h, t, t]: keys of pass 0 at positions <= s
        first = first.masked_fill(torch.ones(t, t, dtype=torch.bool, device=x.device).triu(1), -float("inf"))
        own = torch.stack([(q * kj).sum(-1) * scale for kj, _ in passes[1:]], dim=-1)  # [b, h, t, d]
        weights = torch.cat([first, own], dim=-1).softmax(dim=-1)
        out = weights[..., :t] @ v0 + sum(weights[..., t + j, None] * vj for j, (_, vj) in enumerate(passes[1:]))
        cache.append((k, v))
        return self.o_proj(out.transpose(1, 2).reshape(b, t, -1))


class _MLP(nn.Module):
    def __init__(self, hidden: int, inter: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inter, bias=False)
        self.up_proj = nn.Linear(hidden, inter, bias=False)
        self.down_proj = nn.Linear(inter, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class _Eagle1Layer(nn.Module):
    def __init__(self, c: dict, first: bool) -> None:
        super().__init__()
        h = c["hidden_size"]
        if not first:
            self.input_layernorm = _Norm(h, c["rms_norm_eps"])
        self.self_attn = _Attention(
            h, h, c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"], c["rope_theta"]
        )
        self.post_attention_layernorm = _Norm(h, c["rms_norm_eps"])
        self.mlp = _MLP(h, c["intermediate_size"])

    def forward(self, x, positions, cache=None):
        h = self.input_layernorm(x) if hasattr(self, "input_layernorm") else x
        x = x + self.self_attn(h, positions, cache)
        return x + self.mlp(self.post_attention_layernorm(x))


class _Eagle3Layer(nn.Module):
    def __init__(self, c: dict) -> None:
        super().__init__()
        h = c["hidden_size"]
        self.input_layernorm = _Norm(h, c["rms_norm_eps"])
        self.hidden_norm = _Norm(h, c["rms_norm_eps"])
        self.self_attn = _Attention(
            2 * h, h, c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"], c["rope_theta"]
        )
        self.post_attention_layernorm = _Norm(h, c["rms_norm_eps"])
        self.mlp = _MLP(h, c["intermediate_size"])

    def forward(self, emb, hidden, positions, cache=None):
        x = torch.cat([self.input_layernorm(emb), self.hidden_norm(hidden)], dim=-1)
        hidden = hidden + self.self_attn(x, positions, cache)
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


class TrainableEagle(nn.Module):
    """An EAGLE (version 1) or EAGLE-3 head whose state_dict is the public layout. The target's
    embeddings and LM head are given (frozen, not saved): the head reads the target's."""

    def __init__(
        self,
        config: dict,
        version: int,
        embed: torch.Tensor,
        lm_head: torch.Tensor,
        target_hidden: int,
        num_aux: int = 3,
    ) -> None:
        super().__init__()
        self.config, self.version = config, version
        h = config["hidden_size"]
        self.register_buffer("embed", embed, persistent=False)
        self.register_buffer("target_head", lm_head, persistent=False)
        if version == 1:
            self.fc = nn.Linear(2 * h, h, bias=True)
            self.layers = nn.ModuleList(_Eagle1Layer(config, i == 0) for i in range(config["num_hidden_layers"]))
        else:
            vd = config["draft_vocab_size"]
            self.fc = nn.Linear(num_aux * target_hidden, h, bias=False)
            self.midlayer = _Eagle3Layer(config)
            self.norm = _Norm(h, config["rms_norm_eps"])
            self.lm_head = nn.Linear(h, vd, bias=False)
            self.register_buffer("d2t", torch.zeros(vd, dtype=torch.int64))
            self.register_buffer("t2d", torch.zeros(config["vocab_size"], dtype=torch.bool))

    def set_draft_vocab(self, target_ids: torch.Tensor) -> None:
        """EAGLE-3: the target ids of the draft vocabulary (ascending), as d2t offsets and t2d."""
        self.d2t.copy_(target_ids - torch.arange(len(target_ids)))
        self.t2d.zero_()
        self.t2d[target_ids] = True
        with torch.no_grad():  # start from the target's own LM head rows
            if self.lm_head.weight.shape[1] == self.target_head.shape[1]:
                self.lm_head.weight.copy_(self.target_head[target_ids])

    def step(
        self, tokens: torch.Tensor, features: torch.Tensor, positions: torch.Tensor, caches: list[list] | None = None
    ) -> torch.Tensor:
        """One drafting step over whole sequences: tokens [B, T] (the token after each feature),
        features [B, T, width] (EAGLE: the target's final hidden states, or the head's own output;
        EAGLE-3: the captured layers' (3 Ht wide) or the head's own output (H wide)). Returns the
        head's output h [B, T, H] (pre-norm). caches: per layer, the earlier passes' keys and
        values of a training-time-test unroll (None: a plain causal pass)."""
        emb = F.embedding(tokens, self.embed)
        if self.version == 1:
            x = self.fc(torch.cat([emb, features], dim=-1))
            for i, layer in enumerate(self.layers):
                x = layer(x, positions, None if caches is None else caches[i])
            return x
        if features.shape[-1] != self.config["hidden_size"]:
            features = self.fc(features)
        return self.midlayer(emb, features, positions, None if caches is None else caches[0])

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """EAGLE: the target's LM head over h; EAGLE-3: its own, over the draft vocabulary."""
        if self.version == 1:
            return h @ self.target_head.T
        return self.lm_head(self.norm(h))


def rope_theta(config: dict) -> float:
    """The rotary base of an HF config dict (transformers 5 keeps it in rope_parameters)."""
    return float(config.get("rope_theta") or (config.get("rope_parameters") or {}).get("rope_theta") or 10000.0)


def eagle_config(
    target_config: dict, version: int, draft_vocab_size: int = 0, layers: int = 1, intermediate_size: int | None = None
) -> dict:
    """A head's config.json for a target's config: the target's width, heads and rotary base."""
    h = target_config["hidden_size"]
    heads = target_config["num_attention_heads"]
    c = {
        "architectures": ["LlamaForCausalLM"] if version == 1 else ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "hidden_size": h,
        "num_hidden_layers": layers if version == 1 else 1,
        "num_attention_heads": heads,
        "num_key_value_heads": target_config.get("num_key_value_heads", heads),
        "head_dim": target_config.get("head_dim") or h // heads,
        "intermediate_size": intermediate_size or target_config["intermediate_size"],
        "rms_norm_eps": target_config.get("rms_norm_eps", 1e-6),
        "rope_theta": rope_theta(target_config),
        "max_position_embeddings": target_config.get("max_position_embeddings", 2048),
        "vocab_size": target_config["vocab_size"],
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
    }
    if version == 3:
        c["draft_vocab_size"] = draft_vocab_size or target_config["vocab_size"]
        c["target_hidden_size"] = h
        n = target_config["num_hidden_layers"]
        # EAGLE-3's layers (2, L // 2, L - 3), or spread over a target too shallow for them
        c["eagle_aux_hidden_state_layer_ids"] = [2, n // 2, n - 3] if n >= 6 else [0, n // 2, n - 1]
    return c


def save_eagle(head: TrainableEagle, out_dir: Path) -> Path:
    from safetensors.torch import save_file

    out_dir.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().contiguous() for k, v in head.state_dict().items()}
    save_file(state, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    (out_dir / "config.json").write_text(json.dumps(head.config, indent=2))
    return out_dir


def random_eagle(
    out_dir: Path,
    target_config: dict,
    embed: torch.Tensor,
    lm_head: torch.Tensor,
    version: int,
    seed: int = 0,
    draft_vocab: torch.Tensor | None = None,
) -> Path:
    """An untrained head (random weights, norms 1) for a target: tests need only its shapes."""
    torch.manual_seed(seed)
    vd = len(draft_vocab) if draft_vocab is not None else target_config["vocab_size"]
    config = eagle_config(target_config, version, vd)
    head = TrainableEagle(config, version, embed, lm_head, target_config["hidden_size"])
    if version == 3:
        head.set_draft_vocab(draft_vocab if draft_vocab is not None else torch.arange(vd))
    return save_eagle(head, out_dir)
