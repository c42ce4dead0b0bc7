"""EAGLE and EAGLE-3 draft heads, in the layout public checkpoints use, fed by the target's
hidden states.

EAGLE (Li et al. 2024; SafeAILab/EAGLE `cnets1.py`, e.g. EAGLE-LLaMA3-Instruct-8B):
    config.json   a Llama config (num_hidden_layers, usually 1, of the target's width)
    fc            Linear(2H -> H) over [embedding of token t+1; target feature at t]
                  (weight, and a bias in the reference code)
    layers.i.*    Llama decoder layers; layer 0 has no input_layernorm
    (no norm)     the last layer's output is the next feature: the target's LM head reads it
    embed_tokens  optional: the target's embeddings otherwise
The target feature is its last hidden state after the final norm (what its LM head reads).

EAGLE-3 (Li et al. 2025; `cnets.py`, e.g. EAGLE3-LLaMA3.1-Instruct-8B; architectures
LlamaForCausalLMEagle3):
    fc            Linear(3 Ht -> H, no bias) over the target's hidden states entering layers
                  (2, L // 2, L - 3) (or config `eagle_aux_hidden_state_layer_ids`)
    midlayer.*    one decoder layer whose attention reads [input_layernorm(embedding);
                  hidden_norm(h)] (q/k/v take 2H); the residual is h
    norm, lm_head the head's own LM head over its draft vocabulary (draft_vocab_size)
    d2t           draft id -> target id offset (target = draft + d2t[draft]); t2d (unused here)
    embed_tokens  optional: the target's embeddings otherwise
A drafting step after the first feeds the head its own output (pre-norm) as h, without fc.

In kiln both heads take h from a static buffer (`hidden_in`, [tokens, H]; EAGLE-3's fc is
applied by `project` before it is written), so the head's forward has a model's signature
(ids, positions, KV cache, metadata) and runs, compiles and replays decode graphs as a model
does (engine/spec_decode/eagle.py drives it). Its KV cache is its own tensor over the target's
block ids. Heads whose shapes do not fit the target are refused, naming what does not fit.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from compiler.kernels.cpu_linear import linear
from engine.layers.attention.layer import Attention
from engine.layers.layernorm import RMSNorm
from engine.layers.linear import Linear
from engine.layers.mlp import MLP
from engine.layers.rotary import RotaryEmbedding
from engine.models.config import ModelConfig
from engine.models.llama import DecoderLayer, LlamaForCausalLM, fuse_cpu_ops

EAGLE3_ARCHITECTURES = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM")


@dataclass(frozen=True)
class EagleConfig:
    version: int  # 1: EAGLE, 3: EAGLE-3
    layer: ModelConfig  # the head's decoder geometry (its config.json)
    aux_layers: tuple[int, ...] = ()  # EAGLE-3: target layers whose input hidden states feed fc
    draft_vocab_size: int = 0  # EAGLE-3: rows of its own LM head

    # The KV cache's geometry (engine/runtime/builder.py sizes it like a model's).
    @property
    def num_layers(self) -> int:
        return self.layer.num_layers

    @property
    def num_kv_heads(self) -> int:
        return self.layer.num_kv_heads

    @property
    def head_dim(self) -> int:
        return self.layer.head_dim

    @property
    def hidden_size(self) -> int:
        return self.layer.hidden_size


def read_eagle_config(path: Path, version: int, target: ModelConfig) -> EagleConfig:
    file = path / "config.json"
    if not file.is_file():
        raise FileNotFoundError(f"speculative_model: no config.json in {path}")
    raw = json.loads(file.read_text())
    arch = raw.get("architectures") or []
    if version == 1 and any(a in EAGLE3_ARCHITECTURES for a in arch):
        raise ValueError(f"speculative_model {path}: an EAGLE-3 head ({arch[0]}): use speculative_method eagle3")
    raw.setdefault("model_type", "llama")
    raw.setdefault("vocab_size", target.vocab_size)
    layer = ModelConfig.from_dict(raw)
    if version == 1:
        return EagleConfig(1, layer)
    nested = raw.get("eagle_config") or {}
    aux = raw.get("eagle_aux_hidden_state_layer_ids") or nested.get("eagle_aux_hidden_state_layer_ids")
    n = target.num_layers
    aux = tuple(aux) if aux else (2, n // 2, n - 3)
    bad = [i for i in aux if not 0 <= i < n]
    if bad:
        raise ValueError(
            f"speculative_model {path}: EAGLE-3 reads the hidden states entering target layers {aux}, "
            f"but the target has {n} layers"
        )
    return EagleConfig(3, layer, aux, int(raw.get("draft_vocab_size") or layer.vocab_size))


class _NoNorm(nn.Module):
    """EAGLE's first layer has no input norm: the residual stream goes in as it is."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def add_forward(self, residual: torch.Tensor, delta: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        if delta is not None:
            residual = residual + delta
        return residual, residual


class _EagleBase(nn.Module):
    """What both heads share: the input buffer, the embeddings (own or the target's), the backend."""

    def __init__(self, cfg: EagleConfig, target: LlamaForCausalLM, own_embeddings: bool) -> None:
        super().__init__()
        self.eagle = cfg
        self.config = cfg.layer
        self.embed_tokens = nn.Embedding(target.config.vocab_size, cfg.hidden_size) if own_embeddings else None
        self.__dict__["target"] = target  # (not a submodule: its weights are the target's)
        self.backend = None
        self.register_buffer("hidden_in", torch.zeros(0, cfg.hidden_size), persistent=False)
        self.pad_cpu_rows = False

    def set_backend(self, backend) -> None:
        self.backend = backend

    def use_cpu_fused_ops(self, cache_dir: Path | None) -> float:
        """The fused CPU norms / RoPE / activation for the head's layers too (as the target's)."""
        t0 = time.perf_counter()
        fuse_cpu_ops(self, cache_dir)
        return time.perf_counter() - t0

    def allocate_inputs(self, max_tokens: int) -> None:
        """The static input buffer of h ([max_tokens, H]), read in place by forward (and graphs)."""
        self.hidden_in = torch.zeros(
            max_tokens, self.eagle.hidden_size, dtype=self.hidden_in.dtype, device=self.hidden_in.device
        )

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        table = self.embed_tokens if self.embed_tokens is not None else self.target.embed_tokens
        return table(input_ids)

    def features(self, target_hidden: torch.Tensor, rows: int) -> torch.Tensor:
        """The target's features of a step's first `rows` rows, as h: EAGLE reads the final hidden
        states (`target_hidden`), EAGLE-3 its fc over the captured layers' (engine/models/llama.py aux_hidden)."""
        raise NotImplementedError


class EagleHead(_EagleBase):
    """EAGLE: fc over [embedding; h], Llama layers (the first without input norm), the target's LM head."""

    def __init__(
        self, cfg: EagleConfig, target: LlamaForCausalLM, max_positions: int, own_embeddings: bool, fc_bias: bool
    ) -> None:
        super().__init__(cfg, target, own_embeddings)
        h = cfg.hidden_size
        self.fc = nn.Linear(2 * h, h, bias=fc_bias)
        self.layers = nn.ModuleList(DecoderLayer(cfg.layer, i) for i in range(cfg.num_layers))
        self.layers[0].input_layernorm = _NoNorm()
        self.rotary = RotaryEmbedding(cfg.layer, max_positions)

    def forward(self, input_ids, positions, kv_cache, meta, ctx=None) -> torch.Tensor:
        tokens = input_ids.shape[0]
        x = linear(
            torch.cat([self.embed(input_ids).to(self.hidden_in.dtype), self.hidden_in[:tokens]], dim=-1),
            self.fc.weight,
            self.fc.bias,
        )
        rope = self.rotary(positions, x)
        delta = None
        for layer in self.layers:
            x, delta = layer(x, delta, rope, kv_cache, meta, self.backend)
        return x if delta is None else x + delta

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.target.compute_logits(hidden)

    def features(self, target_hidden: torch.Tensor, rows: int) -> torch.Tensor:
        return target_hidden[:rows]


class Eagle3Layer(nn.Module):
    """EAGLE-3's decoder layer: attention over [input_layernorm(embedding); hidden_norm(h)]."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        h = cfg.hidden_size
        self.input_layernorm = RMSNorm(h, cfg.rms_norm_eps)
        self.hidden_norm = RMSNorm(h, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(h, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, 0)
        attn = self.self_attn
        attn.qkv_proj = Linear(
            2 * h, attn.q_size + 2 * attn.kv_size, cfg.qkv_bias, parts=(attn.q_size, attn.kv_size, attn.kv_size)
        )
        self.mlp = MLP(cfg)

    def forward(self, emb, hidden, rope, kv_cache, meta, backend) -> torch.Tensor:
        x = torch.cat([self.input_layernorm(emb), self.hidden_norm(hidden)], dim=-1)
        hidden = hidden + self.self_attn(x, rope, kv_cache, meta, backend)
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


class Eagle3Head(_EagleBase):
    """EAGLE-3: fc over several target layers' hidden states, one layer, its own LM head over a
    draft vocabulary mapped to the target's ids (d2t)."""

    def __init__(self, cfg: EagleConfig, target: LlamaForCausalLM, max_positions: int, own_embeddings: bool) -> None:
        super().__init__(cfg, target, own_embeddings)
        h = cfg.hidden_size
        self.fc = nn.Linear(len(cfg.aux_layers) * target.config.hidden_size, h, bias=False)
        self.midlayer = Eagle3Layer(cfg.layer)
        self.norm = RMSNorm(h, cfg.layer.rms_norm_eps)
        self.lm_head = nn.Linear(h, cfg.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.int64), persistent=False)
        self.register_buffer("target_ids", torch.arange(cfg.draft_vocab_size), persistent=False)
        self.rotary = RotaryEmbedding(cfg.layer, max_positions)

    def set_d2t(self, d2t: torch.Tensor) -> None:
        self.d2t.copy_(d2t)
        self.target_ids.copy_(torch.arange(len(d2t), device=d2t.device) + d2t)

    def forward(self, input_ids, positions, kv_cache, meta, ctx=None) -> torch.Tensor:
        tokens = input_ids.shape[0]
        hidden = self.hidden_in[:tokens]
        emb = self.embed(input_ids).to(hidden.dtype)
        return self.midlayer(emb, hidden, self.rotary(positions, hidden), kv_cache, meta, self.backend)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits over the target's vocabulary: the draft vocabulary's at their target ids, -inf elsewhere."""
        # (kiln's linear: the weight-streaming kernels at a few rows on the CPU, as the target's head)
        draft = linear(self.norm(hidden), self.lm_head.weight).float()
        full = draft.new_full((draft.shape[0], self.target.config.vocab_size), -float("inf"))
        return full.index_copy(1, self.target_ids, draft)

    def features(self, target_hidden: torch.Tensor, rows: int) -> torch.Tensor:
        return linear(self.target.aux_hidden[:rows], self.fc.weight)


# ---- loading ---------------------------------------------------------------------------------
def _read_tensors(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the head's checkpoint (safetensors or PyTorch .bin), names without "model."."""
    files = sorted(path.glob("*.safetensors"))
    tensors: dict[str, torch.Tensor] = {}
    if files:
        from safetensors.torch import load_file

        for f in files:
            tensors.update(load_file(str(f)))
    else:
        bins = sorted(path.glob("*.bin"))
        if not bins:
            raise FileNotFoundError(f"speculative_model: no *.safetensors or *.bin weights in {path}")
        for f in bins:
            tensors.update(torch.load(str(f), map_location="cpu", weights_only=True))
    return {name.removeprefix("model."): t for name, t in tensors.items()}


def _fused(tensors: dict[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    """HF's separate q/k/v and gate/up projections of one layer -> kiln's fused ones."""
    out = {}
    for name, t in tensors.items():
        if not name.startswith(prefix):
            continue
        rest = name[len(prefix) :]
        for parts, fused in (
            (("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), "self_attn.qkv_proj"),
            (("mlp.gate_proj", "mlp.up_proj"), "mlp.gate_up_proj"),
        ):
            module, _, kind = rest.rpartition(".")
            if module == parts[0]:
                pieces = [tensors.get(f"{prefix}{p}.{kind}") for p in parts]
                if any(p is None for p in pieces):
                    raise ValueError(f"speculative_model: {prefix}{fused}: missing one of {parts}")
                out[f"{fused}.{kind}"] = torch.cat(pieces, dim=0)
                break
            if module in parts:
                break
        else:
            out[rest] = t
    return out


def _fill(module: nn.Module, weights: dict[str, torch.Tensor], where: str) -> None:
    """Copy weights into module's parameters by name, shape-checked; every parameter filled."""
    params = dict(module.named_parameters())
    for name, param in params.items():
        if name not in weights:
            raise ValueError(f"speculative_model: the checkpoint lacks {where}{name}")
        w = weights[name]
        if tuple(w.shape) != tuple(param.shape):
            raise ValueError(
                f"speculative_model: {where}{name} has shape {tuple(w.shape)}, but the head built for "
                f"this target expects {tuple(param.shape)}"
            )
        param.data.copy_(w)


def load_eagle(
    path: Path, version: int, target: LlamaForCausalLM, dtype: torch.dtype, device: torch.device, max_positions: int
) -> EagleHead | Eagle3Head:
    """The head of `path`, checked against the target: its width, its features' width (EAGLE-3:
    layers x target hidden), its embeddings' and vocabulary's sizes."""
    tcfg = target.config
    tensors = _read_tensors(path)
    has_mid = any(n.startswith("midlayer.") for n in tensors)
    if version == 3 and not has_mid:
        raise ValueError(
            f"speculative_model {path}: no midlayer.* weights: not an EAGLE-3 head (an EAGLE head? use "
            "speculative_method eagle)"
        )
    if version == 1 and has_mid:
        raise ValueError(
            f"speculative_model {path}: midlayer.* weights: an EAGLE-3 head (use speculative_method eagle3)"
        )
    cfg = read_eagle_config(path, version, tcfg)
    h = cfg.hidden_size
    own = "embed_tokens.weight" in tensors
    if own and tuple(tensors["embed_tokens.weight"].shape) != (tcfg.vocab_size, h):
        raise ValueError(
            f"speculative_model {path}: embed_tokens has shape {tuple(tensors['embed_tokens.weight'].shape)}"
            f"; the target's vocabulary needs ({tcfg.vocab_size}, {h})"
        )
    if not own and h != tcfg.hidden_size:
        raise ValueError(
            f"speculative_model {path}: the head is {h} wide and has no embeddings of its own, so it "
            f"would read the target's, which are {tcfg.hidden_size} wide"
        )
    fc = tensors.get("fc.weight")
    if fc is None:
        raise ValueError(f"speculative_model {path}: no fc.weight: not an EAGLE head")
    if version == 1:
        if h != tcfg.hidden_size:
            raise ValueError(
                f"speculative_model {path}: EAGLE's features are the target's hidden states "
                f"({tcfg.hidden_size} wide), but the head is {h} wide"
            )
        if tuple(fc.shape) != (h, 2 * h):
            raise ValueError(
                f"speculative_model {path}: fc.weight has shape {tuple(fc.shape)}, EAGLE needs "
                f"({h}, {2 * h}) ([embedding; feature] -> hidden)"
                + (" (an EAGLE-3 head? use speculative_method eagle3)" if fc.shape[1] != 2 * h else "")
            )
        with torch.device("meta"):
            head = EagleHead(cfg, target, max_positions, own, "fc.bias" in tensors)
        weights = {n: t for n, t in tensors.items() if n.startswith(("fc.", "embed_tokens."))}
        for i in range(cfg.num_layers):
            weights.update({f"layers.{i}.{n}": t for n, t in _fused(tensors, f"layers.{i}.").items()})
    else:
        width = len(cfg.aux_layers) * tcfg.hidden_size
        if tuple(fc.shape) != (h, width):
            raise ValueError(
                f"speculative_model {path}: fc.weight has shape {tuple(fc.shape)}; EAGLE-3 over "
                f"{len(cfg.aux_layers)} target layers of {tcfg.hidden_size} needs ({h}, {width})"
            )
        head_w = tensors.get("lm_head.weight")
        if head_w is None or tuple(head_w.shape) != (cfg.draft_vocab_size, h):
            raise ValueError(
                f"speculative_model {path}: lm_head.weight is "
                f"{None if head_w is None else tuple(head_w.shape)}, expected "
                f"({cfg.draft_vocab_size}, {h}) (draft_vocab_size x hidden)"
            )
        d2t = tensors.get("d2t")
        if d2t is None:
            if cfg.draft_vocab_size != tcfg.vocab_size:
                raise ValueError(
                    f"speculative_model {path}: no d2t map for a draft vocabulary of "
                    f"{cfg.draft_vocab_size} (the target's has {tcfg.vocab_size})"
                )
            d2t = torch.zeros(cfg.draft_vocab_size, dtype=torch.int64)
        ids = torch.arange(len(d2t)) + d2t.long()
        if len(d2t) != cfg.draft_vocab_size or int(ids.min()) < 0 or int(ids.max()) >= tcfg.vocab_size:
            raise ValueError(
                f"speculative_model {path}: d2t maps draft ids outside the target's vocabulary of {tcfg.vocab_size}"
            )
        with torch.device("meta"):
            head = Eagle3Head(cfg, target, max_positions, own)
        weights = {n: t for n, t in tensors.items() if n.startswith(("fc.", "embed_tokens.", "norm.", "lm_head."))}
        weights.update({f"midlayer.{n}": t for n, t in _fused(tensors, "midlayer.").items()})
    head = head.to_empty(device=device)
    head.rotary.cos_sin = head.rotary.cos_sin.float()
    head.rotary.fill()
    for name, param in head.named_parameters():
        param.data = param.data.to(dtype)
    head.hidden_in = head.hidden_in.to(dtype)
    with torch.no_grad():
        _fill(head, {n: t.to(dtype) for n, t in weights.items()}, "")
        if version == 3:
            head.d2t = torch.zeros(cfg.draft_vocab_size, dtype=torch.int64, device=device)
            head.target_ids = torch.zeros(cfg.draft_vocab_size, dtype=torch.int64, device=device)
            head.set_d2t(d2t.long().to(device))
    return head.eval().requires_grad_(False)
