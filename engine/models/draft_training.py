"""Training drafts for speculative decoding on the CPU: a small draft model distilled from the
target's own outputs, and EAGLE / EAGLE-3 heads trained on the target's hidden states. The
checkpoints are written in the public layouts kiln loads (engine/models/eagle.py, an HF Llama
directory), so a head made here and one downloaded load by the same code.

The data (token sequences, and for heads the target's hidden states over them) comes from the
caller (`kiln make-draft-model`, engine/entrypoints/cli/make_draft.py, generates it with kiln).
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn


# ---- an EAGLE head in the public layout, as torch modules that train --------------------------
class _Norm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))


def _rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Llama's rotary embedding (halves rotated) of x [B, T, heads, D]."""
    d = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d)
    freqs = positions[..., None].float() * inv
    emb = torch.cat([freqs, freqs], dim=-1)[:, :, None, :]
    rotated = torch.cat([-x[..., d // 2:], x[..., :d // 2]], dim=-1)
    return x * emb.cos() + rotated * emb.sin()


class _Attention(nn.Module):
    def __init__(self, width_in: int, hidden: int, heads: int, kv_heads: int, head_dim: int, theta: float) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim, self.theta = heads, kv_heads, head_dim, theta
        self.q_proj = nn.Linear(width_in, heads * head_dim, bias=False)
        self.k_proj = nn.Linear(width_in, kv_heads * head_dim, bias=False)
        self.v_proj = nn.Linear(width_in, kv_heads * head_dim, bias=False)
        self.o_proj = nn.Linear(heads * head_dim, hidden, bias=False)

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q = _rope(self.q_proj(x).view(b, t, self.heads, self.head_dim), positions, self.theta)
        k = _rope(self.k_proj(x).view(b, t, self.kv_heads, self.head_dim), positions, self.theta)
        v = self.v_proj(x).view(b, t, self.kv_heads, self.head_dim)
        rep = self.heads // self.kv_heads
        k, v = k.repeat_interleave(rep, dim=2), v.repeat_interleave(rep, dim=2)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
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
        self.self_attn = _Attention(h, h, c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"],
                                    c["rope_theta"])
        self.post_attention_layernorm = _Norm(h, c["rms_norm_eps"])
        self.mlp = _MLP(h, c["intermediate_size"])

    def forward(self, x, positions):
        h = self.input_layernorm(x) if hasattr(self, "input_layernorm") else x
        x = x + self.self_attn(h, positions)
        return x + self.mlp(self.post_attention_layernorm(x))


class _Eagle3Layer(nn.Module):
    def __init__(self, c: dict) -> None:
        super().__init__()
        h = c["hidden_size"]
        self.input_layernorm = _Norm(h, c["rms_norm_eps"])
        self.hidden_norm = _Norm(h, c["rms_norm_eps"])
        self.self_attn = _Attention(2 * h, h, c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"],
                                    c["rope_theta"])
        self.post_attention_layernorm = _Norm(h, c["rms_norm_eps"])
        self.mlp = _MLP(h, c["intermediate_size"])

    def forward(self, emb, hidden, positions):
        x = torch.cat([self.input_layernorm(emb), self.hidden_norm(hidden)], dim=-1)
        hidden = hidden + self.self_attn(x, positions)
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


class TrainableEagle(nn.Module):
    """An EAGLE (version 1) or EAGLE-3 head whose state_dict is the public layout. The target's
    embeddings and LM head are given (frozen, not saved): the head reads the target's."""

    def __init__(self, config: dict, version: int, embed: torch.Tensor, lm_head: torch.Tensor,
                 target_hidden: int, num_aux: int = 3) -> None:
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

    def step(self, tokens: torch.Tensor, features: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """One drafting step over whole sequences: tokens [B, T] (the token after each feature),
        features [B, T, width] (EAGLE: the target's final hidden states, or the head's own output;
        EAGLE-3: the captured layers' (3 Ht wide) or the head's own output (H wide)). Returns the
        head's output h [B, T, H] (pre-norm)."""
        emb = F.embedding(tokens, self.embed)
        if self.version == 1:
            x = self.fc(torch.cat([emb, features], dim=-1))
            for layer in self.layers:
                x = layer(x, positions)
            return x
        if features.shape[-1] != self.config["hidden_size"]:
            features = self.fc(features)
        return self.midlayer(emb, features, positions)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """EAGLE: the target's LM head over h; EAGLE-3: its own, over the draft vocabulary."""
        if self.version == 1:
            return h @ self.target_head.T
        return self.lm_head(self.norm(h))


def eagle_config(target_config: dict, version: int, draft_vocab_size: int = 0, layers: int = 1,
                 intermediate_size: int | None = None) -> dict:
    """A head's config.json for a target's config: the target's width, heads and rotary base."""
    h = target_config["hidden_size"]
    heads = target_config["num_attention_heads"]
    c = {
        "architectures": ["LlamaForCausalLM"] if version == 1 else ["LlamaForCausalLMEagle3"],
        "model_type": "llama", "hidden_size": h, "num_hidden_layers": layers if version == 1 else 1,
        "num_attention_heads": heads, "num_key_value_heads": target_config.get("num_key_value_heads", heads),
        "head_dim": target_config.get("head_dim") or h // heads,
        "intermediate_size": intermediate_size or target_config["intermediate_size"],
        "rms_norm_eps": target_config.get("rms_norm_eps", 1e-6), "rope_theta": target_config.get("rope_theta", 1e4),
        "max_position_embeddings": target_config.get("max_position_embeddings", 2048),
        "vocab_size": target_config["vocab_size"], "hidden_act": "silu", "tie_word_embeddings": False,
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


def random_eagle(out_dir: Path, target_config: dict, embed: torch.Tensor, lm_head: torch.Tensor, version: int,
                 seed: int = 0, draft_vocab: torch.Tensor | None = None) -> Path:
    """An untrained head (random weights, norms 1) for a target: tests need only its shapes."""
    torch.manual_seed(seed)
    vd = len(draft_vocab) if draft_vocab is not None else target_config["vocab_size"]
    config = eagle_config(target_config, version, vd)
    head = TrainableEagle(config, version, embed, lm_head, target_config["hidden_size"])
    if version == 3:
        head.set_draft_vocab(draft_vocab if draft_vocab is not None else torch.arange(vd))
    return save_eagle(head, out_dir)


# ---- training --------------------------------------------------------------------------------
def _batches(n: int, batch: int, gen: torch.Generator):
    order = torch.randperm(n, generator=gen)
    for i in range(0, n, batch):
        yield order[i:i + batch]


def train_eagle(head: TrainableEagle, tokens: torch.Tensor, features: torch.Tensor, target_final: torch.Tensor,
                epochs: int, lr: float = 3e-4, batch: int = 8, seed: int = 0, unroll: int = 2,
                log=print) -> float:
    """Train a head on the target's features. tokens [N, T+1]; features [N, T, width] (the
    target's features at positions 0..T-1: EAGLE its final hidden states, EAGLE-3 the captured
    layers'); target_final [N, T, Ht] (EAGLE's regression target: the next position's feature).
    Row t reads (token t+1, feature t) and learns the token at t+2 (cross-entropy) and, for
    EAGLE, the feature at t+1 (smooth L1, as the paper). `unroll` more passes feed the head its
    own outputs (shifted), as drafting steps after the first do. Returns the last loss."""
    gen = torch.Generator().manual_seed(seed)
    params = [p for p in head.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    n, t = features.shape[0], features.shape[1] - 1
    total = epochs * math.ceil(n / batch)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: min(1.0, (i + 1) / 20) * max(0.1, 1 - i / total))
    positions = torch.arange(t)[None]
    head.train()
    loss_value, t0, step = float("nan"), time.perf_counter(), 0
    for epoch in range(epochs):
        for idx in _batches(n, batch, gen):
            feats = features[idx, :t]
            nxt = tokens[idx, 1:t + 1]  # the token after each feature's position
            labels = tokens[idx, 2:t + 2]  # what the head predicts there
            loss = 0.0
            h = head.step(nxt, feats, positions.expand(len(idx), t))
            for depth in range(unroll + 1):
                logits = head.logits(h)
                want = labels[:, depth:] if depth else labels
                got = logits[:, :want.shape[1]]
                if head.version == 3:
                    want = _to_draft(head, want)
                loss = loss + F.cross_entropy(got.reshape(-1, got.shape[-1]), want.reshape(-1), ignore_index=-100)
                if head.version == 1:
                    feat_want = target_final[idx, 1 + depth:t + 1] if depth == 0 else target_final[idx, 1 + depth:t + 1]
                    loss = loss + F.smooth_l1_loss(h[:, :feat_want.shape[1]], feat_want)
                if depth == unroll or h.shape[1] < 2:
                    break
                # the next drafting step: the head's own output at t, token at t + 2 + depth
                h = head.step(tokens[idx, 2 + depth:t + 1], h[:, :t - 1 - depth], positions[:, 1 + depth:t].expand(len(idx), -1))
            opt.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            sched.step()
            step += 1
            loss_value = float(loss)
        log(f"  epoch {epoch + 1}/{epochs}: loss {loss_value:.3f} ({time.perf_counter() - t0:.0f}s)")
    head.eval()
    return loss_value


def _to_draft(head: TrainableEagle, target_ids: torch.Tensor) -> torch.Tensor:
    """Target ids -> draft ids (-100 where the draft vocabulary lacks the token)."""
    vd = head.d2t.shape[0]
    lookup = torch.full((head.t2d.shape[0],), -100, dtype=torch.int64)
    lookup[torch.arange(vd) + head.d2t] = torch.arange(vd)
    return lookup[target_ids]
