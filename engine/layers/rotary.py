"""Rotary position embeddings: the cos/sin tables (with llama3 / linear / llama.cpp scaling), Llama's
rotation of head halves, GLM's interleaved rotation of pairs, and what the fused CPU op takes.

`config` below is a ModelConfig (engine/models/config.py), read by its fields only: layers/ never
imports models/.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import torch
from torch import nn

from compiler.kernels import cpu_fused


def rope_inv_freq(config: Any) -> torch.Tensor:
    """Inverse frequencies for rotary embeddings, with llama3 / linear scaling applied."""
    dim = config.rotary_dim or config.head_dim
    inv = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    scaling = config.rope_scaling
    if scaling is None:
        return inv
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind == "freq_factors":  # llama.cpp divides each frequency by its factor
        return inv / torch.tensor(scaling["factors"], dtype=torch.float32)
    factor = float(scaling["factor"])
    if kind == "linear":
        return inv / factor
    low = float(scaling.get("low_freq_factor", 1.0))
    high = float(scaling.get("high_freq_factor", 4.0))
    old_len = float(scaling["original_max_position_embeddings"])
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > low_wavelen, inv / factor, inv)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, smoothed, scaled)


class FusedRope(NamedTuple):
    """What kiln_cpu_fused::rope_ needs: each token's position and the [positions, 2 * rot] table."""

    positions: torch.Tensor
    cos_sin: torch.Tensor
    interleaved: bool


class RotaryEmbedding(nn.Module):
    """cos/sin tables for every position, looked up by each token's position."""

    def __init__(self, config: Any, max_positions: int) -> None:
        super().__init__()
        self.config = config
        self.max_positions = max_positions
        self.fused = False  # kiln_cpu_fused::rope_ on the CPU (LlamaForCausalLM.use_cpu_fused_ops)
        self.register_buffer(
            "cos_sin", torch.empty(max_positions, (config.rotary_dim or config.head_dim) * 2), persistent=False
        )

    def fill(self) -> None:
        inv = rope_inv_freq(self.config).to(self.cos_sin.device)
        t = torch.arange(self.max_positions, dtype=torch.float32, device=inv.device)
        freqs = torch.outer(t, inv)
        emb = interleaved_rope_tables(freqs) if self.config.rope_interleaved else torch.cat([freqs, freqs], dim=-1)
        self.cos_sin.copy_(torch.cat([emb.cos(), emb.sin()], dim=-1))

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | FusedRope:
        """(cos, sin) [T, 1, rot] in x's dtype for the eager ops; on the fused CPU path the table and
        positions themselves (the op looks them up)."""
        if (
            self.fused
            and cpu_fused.usable(x)
            and positions.dtype == torch.int64
            and self.cos_sin.dtype == torch.float32
        ):
            return FusedRope(positions, self.cos_sin, self.config.rope_interleaved)
        cos, sin = self.cos_sin[positions].to(x.dtype).chunk(2, dim=-1)
        return cos[:, None, :], sin[:, None, :]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    if cos.shape[-1] < x.shape[-1]:  # partial rotary: the rest of each head passes through
        rot = cos.shape[-1]
        return torch.cat([apply_rope(x[..., :rot], cos, sin), x[..., rot:]], dim=-1)
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


def interleaved_rope_tables(freqs: torch.Tensor) -> torch.Tensor:
    """GLM: [positions, rotary_dim / 2] angles -> each angle twice in a row (pairs rotate together)."""
    return freqs.repeat_interleave(2, dim=-1)


def apply_interleaved_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """GLM: rotate the first cos.shape[-1] dims of each head pairwise ((x0, x1) -> (-x1, x0) ...); the
    rest pass through."""
    rot = cos.shape[-1]
    x_rot, x_pass = x[..., :rot], x[..., rot:]
    rotated = torch.stack((-x_rot[..., 1::2], x_rot[..., 0::2]), dim=-1).flatten(-2)
    return torch.cat([x_rot * cos + rotated * sin, x_pass], dim=-1)
