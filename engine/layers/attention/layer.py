"""The attention layer of a Llama-family decoder: fused q/k/v, optional q/k norms, rotary
embeddings, the backend's paged attention (engine/layers/attention/base.py), o_proj.

`config` below is a ModelConfig (engine/models/config.py), read by its fields only: layers/ never
imports models/.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from engine.distributed.parallel import TensorParallel
from engine.layers.attention.base import AttentionBackend, AttentionMetadata
from engine.layers.layernorm import RMSNorm
from engine.layers.linear import Linear, row_parallel
from engine.layers.rotary import FusedRope, apply_interleaved_rope, apply_rope


def local_heads(config: Any, tp: TensorParallel | None) -> tuple[int, int]:
    """(query heads, KV heads) this rank holds. Query heads split evenly; KV heads split evenly
    when there are at least as many as ranks, else each rank holds the one KV head its query
    heads read (replicated on tensor_parallel_size / num_kv_heads ranks).
    The rank's KV cache has local_heads(config, tp)[1] heads."""
    world = 1 if tp is None else tp.world_size
    heads, kv = config.num_heads, config.num_kv_heads
    if world == 1:
        return heads, kv
    if heads % world:
        raise ValueError(f"tensor_parallel_size={world} does not divide the model's {heads} attention heads")
    if kv >= world:
        if kv % world:
            raise ValueError(f"tensor_parallel_size={world} does not divide the model's {kv} KV heads")
        return heads // world, kv // world
    if world % kv:
        raise ValueError(
            f"tensor_parallel_size={world} is not a multiple of the model's {kv} KV heads "
            f"(fewer KV heads than ranks are replicated, which needs a whole number of ranks per head)"
        )
    return heads // world, 1


class Attention(nn.Module):
    def __init__(self, config: Any, layer_index: int, tp: TensorParallel | None = None) -> None:
        super().__init__()
        self.layer_index = layer_index  # which layer of the whole KV cache this attention owns
        self.sliding_window = config.layer_windows[layer_index] if config.layer_windows else 0
        self.softcap = config.attn_softcap
        # Under tp: this rank's query heads and the KV heads they read (column-parallel q/k/v).
        self.num_heads, self.num_kv_heads = local_heads(config, tp)
        self.head_dim = config.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.scale = config.attn_scale or self.head_dim**-0.5
        self.rope = apply_interleaved_rope if config.rope_interleaved else apply_rope
        self.qkv_proj = Linear(
            config.hidden_size,
            self.q_size + 2 * self.kv_size,
            config.qkv_bias,
            parts=(self.q_size, self.kv_size, self.kv_size),
        )
        self.o_proj = row_parallel(self.q_size, config.hidden_size, config.o_bias, tp)
        offset = config.norm_weight_offset  # (Gemma 3's q/k norms scale by 1 + weight too)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps, offset) if config.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps, offset) if config.qk_norm else None

    def forward(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor] | FusedRope,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        backend: AttentionBackend,
        lora: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """rope: (cos, sin) or the fused op's inputs (RotaryEmbedding.forward).
        kv_cache: the whole cache [layers, 2, blocks, block_size, Hkv, D] (see compiler/kernels/ops.py)."""
        n = x.shape[0]
        q, k, v = self.qkv_proj(x, lora).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(n, self.num_heads, self.head_dim)
        k = k.view(n, self.num_kv_heads, self.head_dim)
        v = v.view(n, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q = self.q_norm(q)
            k = self.k_norm(k)
        if isinstance(rope, FusedRope):  # in place on q and k (views of this step's qkv output)
            torch.ops.kiln_cpu_fused.rope_(q, k, rope.positions, rope.cos_sin, rope.interleaved)
        else:
            q = self.rope(q, *rope)
            k = self.rope(k, *rope)
        tokens = meta.slot_mapping.shape[0]
        if tokens < n:  # the row bucket's padding rows (LlamaForCausalLM.padded_rows): no K/V to write
            k, v = k[:tokens], v[:tokens]
        # q/k/v as views of the qkv output: the backend copies them only where its ops need it.
        out = backend.forward(q, k, v, kv_cache, self.layer_index, meta, self.scale, self.sliding_window, self.softcap)
        return self.o_proj(out.view(n, self.q_size), lora)
