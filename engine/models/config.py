"""ModelConfig: the Llama-family fields kiln needs, read from an HF config.json."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from engine.models.glm import DEFAULT_PARTIAL_ROTARY, GLM_MODEL_TYPES, chatglm_config

SUPPORTED_MODEL_TYPES = (
    "llama",
    "mistral",
    "qwen2",
    "qwen3",
    "gemma",
    "gemma2",
    "gemma3_text",
    "phi3",
    "mixtral",
    "qwen2_moe",
    "qwen3_moe",
    "glm",
    "glm4",
    "chatglm",
)
_QWEN2 = ("qwen2", "qwen2_moe")
_QWEN3 = ("qwen3", "qwen3_moe")
_GEMMA = ("gemma", "gemma2", "gemma3_text")
_GLM = GLM_MODEL_TYPES
# MLP activations kiln runs (HF names); Gemma's legacy "gelu" means the tanh approximation.
ACTIVATIONS = ("silu", "gelu_pytorch_tanh")


@dataclass(frozen=True)
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool
    sliding_window: int | None
    torch_dtype: str | None
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)
    bos_token_id: int | None = None
    hidden_act: str = "silu"
    norm_weight_offset: float = 0.0  # Gemma's RMSNorm scales by (offset + weight), offset 1
    embed_scale: float | None = None  # Gemma multiplies the embeddings by sqrt(hidden_size)
    # Mixture of experts (Mixtral, Qwen2-MoE, Qwen3-MoE); num_experts 0: a dense model.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True  # renormalise the k chosen experts' router probabilities to sum 1
    shared_expert_intermediate_size: int = 0  # Qwen2-MoE: an always-on expert behind a sigmoid gate
    sparse_layers: tuple[int, ...] = ()  # the layers whose MLP is the MoE block
    # False for checkpoints of the bare model (architectures "LlamaModel", "MistralModel", ...:
    # embedding models such as e5-mistral): no LM head, so they serve embeddings only.
    generates: bool = True
    # Per layer: its attention window (0 = full context). Gemma 2 alternates windowed and full layers.
    layer_windows: tuple[int, ...] = ()
    # Gemma 2: attention scores and final logits squashed by cap * tanh(x / cap) (0 = off); the
    # attention scale from query_pre_attn_scalar; a norm after attention and around the MLP.
    attn_softcap: float = 0.0
    final_softcap: float = 0.0
    attn_scale: float | None = None
    sandwich_norms: bool = False
    # Gemma 3: the windowed layers use their own rotary base (no scaling); None: one rope for all.
    local_rope_theta: float | None = None
    # Rotary embeddings on the first rotary_dim dims of each head only (0: all of head_dim); GLM's
    # rotate pairs of neighbouring dims ("interleaved", engine/models/glm.py).
    rotary_dim: int = 0
    rope_interleaved: bool = False
    # The checkpoint's quantization_config (GPTQ, AWQ, compressed-tensors), None for full precision.
    quantization: dict[str, Any] | None = None

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> "ModelConfig":
        model_type = raw.get("model_type", "llama")
        if model_type == "chatglm":  # the original ChatGLM3 / GLM-4-chat layout
            raw = chatglm_config(raw)
        if model_type == "gemma3":
            raise ValueError(
                "model: gemma3 checkpoints with a vision tower are not supported; the text-only ones "
                "(model_type gemma3_text, Gemma3ForCausalLM) are"
            )
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"model: unsupported model_type {model_type!r} (kiln runs {', '.join(SUPPORTED_MODEL_TYPES)})"
            )
        gemma = model_type in _GEMMA
        gemma2 = model_type == "gemma2"
        sandwich = model_type in ("gemma2", "gemma3_text", "glm4")  # (GLM-4's extra norms: the same shape)
        act = (
            (raw.get("hidden_activation") or raw.get("hidden_act") or "gelu_pytorch_tanh")
            if gemma
            else raw.get("hidden_act", "silu")
        )
        if gemma and act == "gelu":
            act = "gelu_pytorch_tanh"
        if act not in ACTIVATIONS:
            raise ValueError(f"model: unsupported hidden_act {act!r} (kiln runs {', '.join(ACTIVATIONS)})")
        heads = raw["num_attention_heads"]
        rope = raw.get("rope_parameters") or {}
        local_theta = raw.get("rope_local_base_freq")  # Gemma 3 (older config format)
        if "full_attention" in rope:  # rope per layer type (Gemma 3, transformers 5's format)
            local_theta = (rope.get("sliding_attention") or {}).get("rope_theta", local_theta)
            rope = rope["full_attention"]
        scaling = raw.get("rope_scaling") or None
        if rope and rope.get("rope_type", "default") != "default":
            scaling = dict(rope)
        theta = rope.get("rope_theta", raw.get("rope_theta", 10000.0))
        partial = rope.get(
            "partial_rotary_factor",
            raw.get("partial_rotary_factor", DEFAULT_PARTIAL_ROTARY if model_type in _GLM else 1.0),
        )
        head_dim = raw.get("head_dim") or raw["hidden_size"] // heads
        rotary_dim = int(head_dim * partial)
        if not 0 < rotary_dim <= head_dim or rotary_dim % 2:
            raise ValueError(
                f"model: partial_rotary_factor={partial} gives {rotary_dim} rotary dims of "
                f"{head_dim}: expected an even number in (0, head_dim]"
            )
        if scaling is not None:
            kind = scaling.get("rope_type", scaling.get("type", "default"))
            if kind == "default":
                scaling = None
            elif kind not in ("llama3", "linear", "freq_factors"):  # (freq_factors: a GGUF file's rope_freqs)
                raise ValueError(f"model: unsupported rope scaling type {kind!r} (kiln supports llama3, linear)")
        eos = raw.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        windows = _layer_windows(raw, model_type)
        window = max(windows) or None
        moe = _moe_fields(raw, model_type)
        scalar = raw.get("query_pre_attn_scalar") if sandwich else None
        return cls(
            model_type=model_type,
            vocab_size=raw["vocab_size"],
            hidden_size=raw["hidden_size"],
            intermediate_size=raw["intermediate_size"],
            num_layers=raw["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=raw.get("num_key_value_heads") or heads,
            head_dim=head_dim,
            rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
            max_position_embeddings=raw.get("max_position_embeddings", 2048),
            rope_theta=float(theta),
            rope_scaling=scaling,
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", gemma)),
            qkv_bias=model_type in _QWEN2 or bool(raw.get("attention_bias", False)),
            o_bias=model_type not in _QWEN2 + _GLM and bool(raw.get("attention_bias", False)),
            mlp_bias=bool(raw.get("mlp_bias", False)),
            qk_norm=model_type in _QWEN3 or model_type == "gemma3_text",
            sliding_window=window,
            torch_dtype=raw.get("torch_dtype") or raw.get("dtype"),
            eos_token_ids=eos_ids,
            bos_token_id=raw.get("bos_token_id"),
            hidden_act=act,
            norm_weight_offset=1.0 if gemma else 0.0,
            embed_scale=raw["hidden_size"] ** 0.5 if gemma else None,
            generates=not _bare_model(raw.get("architectures")),
            layer_windows=windows,
            attn_softcap=float(raw.get("attn_logit_softcapping") or 0.0) if gemma2 else 0.0,
            final_softcap=float(raw.get("final_logit_softcapping") or 0.0) if gemma2 else 0.0,
            attn_scale=float(scalar) ** -0.5 if scalar else None,
            sandwich_norms=sandwich,
            local_rope_theta=float(local_theta) if model_type == "gemma3_text" and local_theta else None,
            rotary_dim=rotary_dim if rotary_dim != head_dim else 0,
            rope_interleaved=model_type in _GLM,
            quantization=raw.get("quantization_config") or None,
            **moe,
        )

    @classmethod
    def from_dir(cls, path: str | Path, cache_dir: Path | None = None) -> "ModelConfig":
        """From an HF checkpoint directory's config.json, or a GGUF file's metadata (what transformers
        derives from it kept under cache_dir, if given: engine/models/loader/gguf_cache.py)."""
        from engine.models.loader import gguf_file

        if gguf_file.is_gguf(path):
            return cls.from_dict(gguf_file.hf_config(path, cache_dir))
        file = Path(path) / "config.json"
        if not file.is_file():
            raise FileNotFoundError(f"model: no config.json in {path}")
        return cls.from_dict(json.loads(file.read_text()))

    def num_parameters(self) -> int:
        d, f, v = self.hidden_size, self.intermediate_size, self.vocab_size
        attn = d * (self.num_heads + 2 * self.num_kv_heads) * self.head_dim + self.num_heads * self.head_dim * d
        per_layer = attn + 2 * d
        sparse = len(self.sparse_layers)
        moe = self.num_experts * (3 * d * self.moe_intermediate_size + d) + 3 * d * self.shared_expert_intermediate_size
        mlps = (self.num_layers - sparse) * 3 * d * f + sparse * moe
        embed = v * d * (1 if self.tie_word_embeddings else 2)
        return self.num_layers * per_layer + mlps + embed + d


def _layer_windows(raw: dict[str, Any], model_type: str) -> tuple[int, ...]:
    """Each layer's attention window (0: full attention). Qwen2/3 window only the layers from
    max_window_layers on, and only with use_sliding_window; Gemma 2 alternates (layer_types).
    Windows on some layers only are refused except for Gemma 2, whose mix is its design."""
    window = raw.get("sliding_window")
    num_layers = raw["num_hidden_layers"]
    if window is None:
        return (0,) * num_layers
    if model_type in ("gemma2", "gemma3_text"):  # windowed and full layers mixed by design
        pattern = raw.get("sliding_window_pattern") or (2 if model_type == "gemma2" else 6)
        kinds = raw.get("layer_types") or [
            "sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(num_layers)
        ]
        return tuple(int(window) if k == "sliding_attention" else 0 for k in kinds)
    if model_type in _QWEN2 + _QWEN3:
        if not raw.get("use_sliding_window", False):
            return (0,) * num_layers
        first = raw.get("max_window_layers", num_layers)
        kinds = ["sliding_attention" if i >= first else "full_attention" for i in range(num_layers)]
    else:
        kinds = raw.get("layer_types") or ["sliding_attention"] * num_layers
    if all(k == "full_attention" for k in kinds):
        return (0,) * num_layers
    if not all(k == "sliding_attention" for k in kinds):
        raise ValueError("model: sliding-window attention on some layers only is not supported")
    return (int(window),) * num_layers


def _bare_model(architectures: list[str] | None) -> bool:
    """The checkpoint holds the transformer without its LM head (e.g. ["MistralModel"])."""
    return bool(architectures) and all(a.endswith("Model") and not a.endswith("LMHeadModel") for a in architectures)


def _moe_fields(raw: dict[str, Any], model_type: str) -> dict[str, Any]:
    """The MoE fields of ModelConfig for Mixtral and Qwen2/3-MoE configs ({} for dense models)."""
    num_layers = raw["num_hidden_layers"]
    if model_type == "mixtral":  # every layer sparse; experts as wide as intermediate_size; top-k renormalised
        return dict(
            num_experts=raw["num_local_experts"],
            num_experts_per_tok=raw["num_experts_per_tok"],
            moe_intermediate_size=raw["intermediate_size"],
            norm_topk_prob=True,
            sparse_layers=tuple(range(num_layers)),
        )
    if model_type not in ("qwen2_moe", "qwen3_moe"):
        return {}
    experts = raw.get("num_experts", raw.get("num_local_experts", 0)) or 0  # (transformers 5 writes the latter)
    step = raw.get("decoder_sparse_step", 1) or 1
    dense_only = set(raw.get("mlp_only_layers") or ())
    sparse = tuple(i for i in range(num_layers) if experts > 0 and i not in dense_only and (i + 1) % step == 0)
    return dict(
        num_experts=experts,
        num_experts_per_tok=raw["num_experts_per_tok"],
        moe_intermediate_size=raw["moe_intermediate_size"],
        norm_topk_prob=bool(raw.get("norm_topk_prob", False)),
        shared_expert_intermediate_size=raw.get("shared_expert_intermediate_size", 0) or 0,
        sparse_layers=sparse,
    )
