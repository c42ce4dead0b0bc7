"""The Llama family (Llama 2/3, Mistral, Qwen2, Qwen3, Gemma, Phi-3, and the mixture-of-experts
Mixtral, Qwen2-MoE and Qwen3-MoE) over a flattened token batch.

Input is [num_tokens] ids and positions for a mixed batch of prefill chunks and
decodes; attention goes through an AttentionBackend with explicit metadata.
q/k/v and gate/up projections are fused (the loader concatenates HF's weights).
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

import compiler.kernels.ops  # noqa: F401 - registers every kiln:: op (kiln::moe_experts here)
from compiler.kernels import cpu_fused
from compiler.kernels import cpu_gemv
from compiler.kernels.cpu_linear import MIN_ONEDNN_ROWS, linear, row_bucket, warm_buckets
from engine.distributed.parallel import TensorParallel, all_reduce
from engine.distributed.parallel_layers import (
    ParallelLMHead,
    RowParallelLinear,
    VocabParallelEmbedding,
    parallel_logits,
)
from engine.layers.attention.base import AttentionBackend, AttentionMetadata
from engine.layers.forward_context import ForwardContext
from engine.layers.quant.cpu_packed import GEMM_ROWS
from engine.layers.quant.moe import QuantExperts, routed_experts
from engine.models import cpu_stack
from engine.models.config import ModelConfig, rope_inv_freq
from engine.models.glm import apply_interleaved_rope, interleaved_rope_tables
from engine.models.sharding import check_shardable, local_heads, vocab_rows_per_rank


class RMSNorm(nn.Module):
    """Llama's RMSNorm: weight * norm(x) in x's dtype. With a weight offset (Gemma): the scale is
    (offset + weight), applied in float32 before the cast back, as Gemma's reference does."""

    def __init__(self, dim: int, eps: float, weight_offset: float = 0.0) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim) if weight_offset else torch.ones(dim))
        self.eps = eps
        self.weight_offset = weight_offset
        self.fused = False  # kiln_cpu_fused ops on the CPU (LlamaForCausalLM.use_cpu_fused_ops)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused and cpu_fused.usable(x) and self.weight.dtype == x.dtype:
            return torch.ops.kiln_cpu_fused.rms_norm(x, self.weight, self.eps, self.weight_offset)
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.weight_offset:
            return (x * (self.weight_offset + self.weight.float())).to(dtype)
        return self.weight * x.to(dtype)

    def add_forward(self, residual: torch.Tensor, delta: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """(residual + delta, its norm); the fused op adds into residual in place (the residual
        stream's own tensor, never a caller's). delta None: nothing to add."""
        if delta is None:
            return residual, self(residual)
        if self.fused and cpu_fused.usable(residual) and self.weight.dtype == residual.dtype and residual.is_contiguous():
            return residual, torch.ops.kiln_cpu_fused.add_rms_norm(residual, delta, self.weight, self.eps,
                                                                  self.weight_offset)
        residual = residual + delta
        return residual, self(residual)


class Linear(nn.Linear):
    """nn.Linear that can carry stacked LoRA adapters (engine/lora/adapters.py): `parts` are the output
    sizes of the projections fused into it (q/k/v, gate/up), each adapted on its own."""

    def __init__(self, in_features: int, out_features: int, bias: bool, parts: tuple[int, ...] | None = None) -> None:
        super().__init__(in_features, out_features, bias=bias)
        sizes = parts or (out_features,)
        starts = [sum(sizes[:i]) for i in range(len(sizes))]
        self.lora_parts = list(zip(starts, sizes))  # (first output row, rows) per part
        self.register_buffer("lora_a", None, persistent=False)  # set by enable_lora
        self.register_buffer("lora_b", None, persistent=False)
        self.lora_rank = 0
        self.quant = None  # a quantised layer's method (engine/layers/quant/linear.py); None: dense weight
        self.gemm_weight = None  # oneDNN's blocked copy of weight for GEMM rows (engine/worker/cpu_gemm_weights.py)

    def enable_lora(self, num_slots: int, max_rank: int) -> None:
        width = num_slots * len(self.lora_parts) * max_rank
        self.lora_rank = max_rank
        self.register_buffer("lora_a", torch.zeros(width, self.in_features), persistent=False)
        self.register_buffer("lora_b", torch.zeros(self.out_features, width), persistent=False)

    def forward(self, x: torch.Tensor, lora: torch.Tensor | None = None) -> torch.Tensor:
        """lora: [T, slots] one-hot of each token's adapter slot (all zero: the base model)."""
        y = linear(x, self.weight, self.bias, self.gemm_weight) if self.quant is None else self.quant.apply(self, x)
        if lora is None or self.lora_a is None:
            return y
        mask = lora.repeat_interleave(len(self.lora_parts) * self.lora_rank, dim=1)
        return y + F.linear(F.linear(x, self.lora_a) * mask, self.lora_b)


class RotaryEmbedding(nn.Module):
    """cos/sin tables for every position, looked up by each token's position."""

    def __init__(self, config: ModelConfig, max_positions: int) -> None:
        super().__init__()
        self.config = config
        self.max_positions = max_positions
        self.fused = False  # kiln_cpu_fused::rope_ on the CPU (LlamaForCausalLM.use_cpu_fused_ops)
        self.register_buffer("cos_sin", torch.empty(max_positions, (config.rotary_dim or config.head_dim) * 2),
                             persistent=False)

    def fill(self) -> None:
        inv = rope_inv_freq(self.config).to(self.cos_sin.device)
        t = torch.arange(self.max_positions, dtype=torch.float32, device=inv.device)
        freqs = torch.outer(t, inv)
        emb = interleaved_rope_tables(freqs) if self.config.rope_interleaved else torch.cat([freqs, freqs], dim=-1)
        self.cos_sin.copy_(torch.cat([emb.cos(), emb.sin()], dim=-1))

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | FusedRope:
        """(cos, sin) [T, 1, rot] in x's dtype for the eager ops; on the fused CPU path the table and
        positions themselves (the op looks them up)."""
        if self.fused and cpu_fused.usable(x) and positions.dtype == torch.int64 and self.cos_sin.dtype == torch.float32:
            return FusedRope(positions, self.cos_sin, self.config.rope_interleaved)
        cos, sin = self.cos_sin[positions].to(x.dtype).chunk(2, dim=-1)
        return cos[:, None, :], sin[:, None, :]


def fuse_cpu_ops(model: nn.Module, cache_dir: Path | None) -> bool:
    """Run `model`'s norms, rotary embeddings and MLP activations through compiler/kernels/cpu_fused.py's
    ops (loaded, on the first start built, now). False: the library is not there (cpu_fused logs
    why) and the eager ops stay."""
    if not cpu_fused.FUSED.ensure(cache_dir):
        return False
    for module in model.modules():
        if isinstance(module, (RMSNorm, RotaryEmbedding, MLP)):
            module.fused = True
    return True


class FusedRope(NamedTuple):
    """What kiln_cpu_fused::rope_ needs: each token's position and the [positions, 2 * rot] table."""
    positions: torch.Tensor
    cos_sin: torch.Tensor
    interleaved: bool


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    if cos.shape[-1] < x.shape[-1]:  # partial rotary: the rest of each head passes through
        rot = cos.shape[-1]
        return torch.cat([apply_rope(x[..., :rot], cos, sin), x[..., rot:]], dim=-1)
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


def _row_parallel(in_features: int, out_features: int, bias: bool, tp: TensorParallel | None,
                  reduce: bool = True) -> nn.Module:
    """o_proj / down_proj: kiln's Linear, or this rank's columns of it (all-reduced) under tp."""
    if tp is None:
        return Linear(in_features, out_features, bias)
    return RowParallelLinear(in_features, out_features, bias, tp, reduce)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer_index: int, tp: TensorParallel | None = None) -> None:
        super().__init__()
        self.layer_index = layer_index  # which layer of the whole KV cache this attention owns
        self.sliding_window = config.layer_windows[layer_index] if config.layer_windows else 0
        self.softcap = config.attn_softcap
        # Under tp: this rank's query heads and the KV heads they read (column-parallel q/k/v).
        self.num_heads, self.num_kv_heads = local_heads(config, tp)
        self.head_dim = config.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.scale = config.attn_scale or self.head_dim ** -0.5
        self.rope = apply_interleaved_rope if config.rope_interleaved else apply_rope
        self.qkv_proj = Linear(config.hidden_size, self.q_size + 2 * self.kv_size, config.qkv_bias,
                               parts=(self.q_size, self.kv_size, self.kv_size))
        self.o_proj = _row_parallel(self.q_size, config.hidden_size, config.o_bias, tp)
        offset = config.norm_weight_offset  # (Gemma 3's q/k norms scale by 1 + weight too)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps, offset) if config.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps, offset) if config.qk_norm else None

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | FusedRope, kv_cache: torch.Tensor,
                meta: AttentionMetadata, backend: AttentionBackend, lora: torch.Tensor | None = None) -> torch.Tensor:
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
        out = backend.forward(q, k, v, kv_cache, self.layer_index, meta, self.scale, self.sliding_window,
                              self.softcap)
        return self.o_proj(out.view(n, self.q_size), lora)


class MLP(nn.Module):
    def __init__(self, config: ModelConfig, intermediate_size: int | None = None, tp: TensorParallel | None = None,
                 reduce: bool = True) -> None:
        """tp: this rank's gate/up rows and down columns; reduce=False leaves down's partial sum."""
        super().__init__()
        world = 1 if tp is None else tp.world_size
        self.intermediate = (intermediate_size or config.intermediate_size) // world
        self.gate_up_proj = Linear(config.hidden_size, 2 * self.intermediate, config.mlp_bias,
                                   parts=(self.intermediate, self.intermediate))
        self.down_proj = _row_parallel(self.intermediate, config.hidden_size, config.mlp_bias, tp, reduce)
        self.tanh_gelu = config.hidden_act == "gelu_pytorch_tanh"
        self.fused = False  # kiln_cpu_fused::silu_and_mul on the CPU (LlamaForCausalLM.use_cpu_fused_ops)

    def forward(self, x: torch.Tensor, lora: torch.Tensor | None = None) -> torch.Tensor:
        gate_up = self.gate_up_proj(x, lora)
        if self.fused and cpu_fused.usable(gate_up) and gate_up.dim() == 2:
            return self.down_proj(torch.ops.kiln_cpu_fused.silu_and_mul(gate_up, self.tanh_gelu), lora)
        gate, up = gate_up.split(self.intermediate, dim=-1)
        act = F.gelu(gate, approximate="tanh") if self.tanh_gelu else F.silu(gate)
        return self.down_proj(act * up, lora)


class SparseMoE(nn.Module):
    """Router + top-k routed experts (kiln::moe_experts, compiler/kernels/moe.py), plus Qwen2-MoE's
    sigmoid-gated shared expert. Expert weights are stacked: w13 [E, 2I, H] (gate rows, then
    up rows), w2 [E, H, I]; in a quantised model both are QuantExperts (engine/layers/quant/moe.py). Under tp every expert (and the shared one) holds this rank's I/tp
    gate/up rows and down columns, the router is whole, and one all-reduce sums the block."""

    def __init__(self, config: ModelConfig, tp: TensorParallel | None = None) -> None:
        super().__init__()
        self.tp = tp
        world = 1 if tp is None else tp.world_size
        e, h, i = config.num_experts, config.hidden_size, config.moe_intermediate_size // world
        self.top_k = config.num_experts_per_tok
        self.renormalize = config.norm_topk_prob
        self.activation = config.hidden_act
        self.gate = nn.Linear(h, e, bias=False)
        self.w13 = nn.Parameter(torch.empty(e, 2 * i, h))
        self.w2 = nn.Parameter(torch.empty(e, h, i))
        shared = config.shared_expert_intermediate_size
        self.shared_expert = MLP(config, shared, tp, reduce=False) if shared else None
        self.shared_expert_gate = nn.Linear(h, 1, bias=False) if shared else None

    def forward(self, x: torch.Tensor, lora: torch.Tensor | None = None) -> torch.Tensor:
        probs = F.softmax(self.gate(x).float(), dim=-1)
        weights, ids = probs.topk(self.top_k, dim=-1)
        if self.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        if isinstance(self.w13, QuantExperts):  # a quantised checkpoint's experts (engine/layers/quant/moe.py)
            out = routed_experts(self.w13, self.w2, x, weights, ids, self.activation)
        else:
            out = torch.ops.kiln.moe_experts(x, weights, ids, self.w13, self.w2, self.activation)
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out if self.tp is None else all_reduce(out, self.tp)


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_index: int, tp: TensorParallel | None = None) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, config.norm_weight_offset)
        self.self_attn = Attention(config, layer_index, tp)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, config.norm_weight_offset)
        self.mlp = SparseMoE(config, tp) if layer_index in config.sparse_layers else MLP(config, tp=tp)
        # Gemma 2: post_attention_layernorm normalises the attention output; the MLP has a norm on
        # each side. Otherwise post_attention_layernorm is the norm before the MLP.
        self.sandwich = config.sandwich_norms
        if self.sandwich:
            self.pre_feedforward_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps,
                                                     config.norm_weight_offset)
            self.post_feedforward_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps,
                                                      config.norm_weight_offset)

    def forward(self, residual, delta, rope, kv_cache, meta, backend, lora=None):
        """The residual stream is carried as (residual, delta not yet added): each add is done by the
        norm that reads its sum (one fused op on the CPU). Returns the next (residual, delta)."""
        residual, h = self.input_layernorm.add_forward(residual, delta)
        attn = self.self_attn(h, rope, kv_cache, meta, backend, lora)
        if self.sandwich:
            residual = residual + self.post_attention_layernorm(attn)
            h = self.pre_feedforward_layernorm(residual)
            return residual, self.post_feedforward_layernorm(self.mlp(h, lora))
        residual, h = self.post_attention_layernorm.add_forward(residual, attn)
        return residual, self.mlp(h, lora)


class LlamaForCausalLM(nn.Module):
    def __init__(self, config: ModelConfig, max_positions: int, tp: TensorParallel | None = None) -> None:
        """tp: this rank's place in a tensor-parallel group (engine/distributed/parallel.py): the
        model is then this rank's shard; None (or one rank): the whole model."""
        super().__init__()
        self.config = config
        tp = self.tp = tp if tp is not None and tp.world_size > 1 else None
        check_shardable(config, tp)
        # No random init (the weights are loaded): on the meta device it would import Dynamo, seconds of start-up.
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size,
                                         _weight=torch.empty(config.vocab_size, config.hidden_size)) \
            if tp is None else VocabParallelEmbedding(vocab_rows_per_rank(config, tp), config.hidden_size, tp)
        self.layers = nn.ModuleList(DecoderLayer(config, i, tp) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, config.norm_weight_offset)
        self.rotary = RotaryEmbedding(config, max_positions)
        # Gemma 3: windowed layers rotate with their own base (and no scaling).
        self.rotary_local = None if config.local_rope_theta is None else RotaryEmbedding(
            dataclasses.replace(config, rope_theta=config.local_rope_theta, rope_scaling=None), max_positions)
        # (a bare model has no head: compute_logits then reads the embeddings, only ever for warm-ups)
        self.lm_head = None if config.tie_word_embeddings or not config.generates else nn.Linear(
            config.hidden_size, config.vocab_size, bias=False) if tp is None else ParallelLMHead(
            vocab_rows_per_rank(config, tp), config.hidden_size, tp)
        # GGUF on the CPU: the LM head also in the file's blocks, for steps of fewer than
        # packed_head_rows rows (engine/models/loader/gguf_quant.py: pack_head)
        self.packed_head: Linear | None = None
        # An fp16/bf16 checkpoint in float32 on the CPU: the LM head's exact 2-byte copy, for steps
        # of decode rows (engine/worker/cpu_half_weights.py: keep_half_head)
        self.half_head: torch.Tensor | None = None
        # oneDNN's blocked copy of the LM head for GEMM rows (engine/worker/cpu_gemm_weights.py)
        self.gemm_head: torch.Tensor | None = None
        self.backend: AttentionBackend | None = None
        self.lora_slots = 0  # adapters one batch can mix (engine/lora/adapters.py); 0: LoRA off
        self.pad_cpu_rows = False  # forward in oneDNN row buckets (padded_rows; set by use_cpu_fused_ops)
        self.cpu_stack: cpu_stack.StackRunner | None = None  # the layers as one C++ call (use_cpu_stack)
        # EAGLE-3 (engine/models/eagle.py): the hidden states entering these layers, side by side, are
        # written into aux_hidden [tokens, len(aux_layers) * hidden] by every forward (a static buffer:
        # decode graphs write it too).
        self.aux_layers: tuple[int, ...] = ()
        self.aux_hidden: torch.Tensor | None = None

    def set_backend(self, backend: AttentionBackend) -> None:
        self.backend = backend

    def quantizable_linears(self) -> dict[str, Linear]:
        """The linear layers kiln quantises, by name: every attention and dense-MLP projection (not
        the LM head or the embeddings, which every format here leaves in full precision)."""
        return {name: m for name, m in self.named_modules() if isinstance(m, Linear) and name.startswith("layers.")}

    def moe_layers(self) -> list[SparseMoE]:
        """The mixture-of-experts blocks, for the quantisers (engine/layers/quant/moe.py takes layers,
        never the model)."""
        return [layer.mlp for layer in self.layers if isinstance(layer.mlp, SparseMoE)]

    def enable_lora(self, num_slots: int, max_rank: int) -> None:
        """Give every attention and dense-MLP projection room for num_slots adapters of rank <= max_rank."""
        if self.config.is_moe:
            raise ValueError("LoRA adapters are not supported for mixture-of-experts models")
        if self.tp is not None:
            raise ValueError("enable_lora: LoRA adapters are not supported with tensor_parallel_size > 1 yet")
        self.lora_slots = num_slots
        for module in self.modules():
            if isinstance(module, Linear):
                module.enable_lora(num_slots, max_rank)

    def use_cpu_fused_ops(self, cache_dir: Path | None) -> float:
        """Load (first start: build) compiler/kernels/cpu_fused.py's ops and run this model's norms, rotary
        embeddings and MLP activations through them on the CPU. Returns the seconds spent. A
        library that cannot be built leaves the eager ops on (cpu_fused logs why)."""
        t0 = time.perf_counter()
        if not fuse_cpu_ops(self, cache_dir):
            return time.perf_counter() - t0
        seconds = time.perf_counter() - t0
        # Row buckets end to end pay only where every projection is a dense oneDNN one.
        self.pad_cpu_rows = (self.tp is None and not self.config.is_moe
                             and all(m.quant is None for m in self.modules() if isinstance(m, Linear)))
        return seconds

    def use_cpu_stack(self) -> bool:
        """Run the decoder layers as one C++ call per step where they can (engine/models/cpu_stack.py;
        after use_cpu_fused_ops, with the CPU attention and weight-streaming kernels loaded). Returns
        whether it is on (the reason it is not is logged)."""
        self.cpu_stack = cpu_stack.build(self, self.embed_tokens.weight.dtype)
        return self.cpu_stack is not None

    def padded_rows(self, tokens: int, x: torch.Tensor, lora: torch.Tensor | None) -> int:
        """The rows the eager CPU forward runs: `tokens` rounded up to oneDNN's row bucket
        (compiler/kernels/cpu_linear.py), so that every projection takes its input as is instead of
        padding a copy of it (9 copies a step for 2 layers). Padding rows (id 0, position 0) are
        claimed by no sequence: attention writes them as zeros and the caller never sees them."""
        if (not self.pad_cpu_rows or tokens < MIN_ONEDNN_ROWS or lora is not None or x.dtype != torch.float32
                or not x.is_cpu or torch.compiler.is_compiling()):
            return tokens
        return row_bucket(tokens)

    def warm_cpu_linear(self, max_tokens: int, max_seqs: int) -> int:
        """Build oneDNN's primitive for every row bucket (compiler/kernels/cpu_linear.py) of the dense float32
        projections (up to max_tokens rows) and the LM head (up to max_seqs sampled rows) now, not
        while serving. Returns the number of shapes built."""
        dense = [(m.weight, m.bias, m.gemm_weight) for m in self.modules() if isinstance(m, Linear) and m.quant is None]
        built = warm_buckets(dense, max_tokens)
        if self.tp is None:
            built += warm_buckets([(self.head_weight(), None, self.gemm_head)], max_seqs)
        return built

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata, ctx: ForwardContext | None = None) -> torch.Tensor:
        """ids, positions [T] -> final hidden states [T, hidden]. kv_cache: [layers, 2, blocks, bs, Hkv, D].
        ctx: the step's feature inputs (engine/layers/forward_context.py); None: no feature is used."""
        lora = None
        if self.lora_slots and ctx is not None and ctx.lora_slots is not None:  # one-hot of each token's slot
            slots = torch.arange(self.lora_slots, device=input_ids.device)
            lora = (ctx.lora_slots[:, None] == slots).to(self.embed_tokens.weight.dtype)
        tokens = input_ids.shape[0]
        rows = self.padded_rows(tokens, self.embed_tokens.weight, lora)
        if rows != tokens:
            input_ids = F.pad(input_ids, (0, rows - tokens))
            positions = F.pad(positions, (0, rows - tokens))
        x = self.embed_tokens(input_ids)
        if self.config.embed_scale is not None:  # Gemma: rounded to the weights' dtype first, as in HF
            x = x * torch.tensor(self.config.embed_scale, dtype=x.dtype)
        if self.cpu_stack is not None and self.cpu_stack.runs(rows, positions, self.backend, lora):
            # (EAGLE-3's hidden states between layers: the stack copies them into aux_hidden)
            hidden = self.cpu_stack.forward(x, positions, kv_cache, meta, self.aux_hidden, self.aux_layers)
            return hidden if rows == tokens else hidden[:tokens]
        rope = self.rotary(positions, x)
        local = self.rotary_local(positions, x) if self.rotary_local is not None else rope
        delta = None
        for i, layer in enumerate(self.layers):
            if i in self.aux_layers:
                self._keep_aux(i, x, delta, tokens)
            x, delta = layer(x, delta, local if layer.self_attn.sliding_window else rope, kv_cache, meta,
                             self.backend, lora)
        hidden = self.norm.add_forward(x, delta)[1]
        return hidden if rows == tokens else hidden[:tokens]

    def _keep_aux(self, layer: int, x: torch.Tensor, delta: torch.Tensor | None, tokens: int) -> None:
        """The residual stream entering `layer` (x + its pending delta; x is later added to in
        place) into its slots of aux_hidden."""
        width = self.config.hidden_size
        h = (x if delta is None else x + delta)[:tokens]
        for k, at in enumerate(self.aux_layers):
            if at == layer:
                self.aux_hidden[:tokens, k * width:(k + 1) * width].copy_(h)

    def head_weight(self) -> torch.Tensor:
        """The LM head's weight [vocab, hidden]: lm_head's, or the embedding table when tied."""
        return self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def head_rows(self, ids: torch.Tensor) -> torch.Tensor:
        """The LM head's rows of token ids `ids` (a copy), for compute_logits(head=...)."""
        if self.tp is not None:
            raise ValueError("a draft vocabulary needs an unsharded model")
        weight = self.head_weight()
        return weight.index_select(0, ids.to(weight.device)).contiguous()

    def compute_logits(self, hidden: torch.Tensor, head: torch.Tensor | None = None) -> torch.Tensor:
        """Logits over the vocabulary, or with `head` (head_rows) over those rows only."""
        if head is not None:
            logits = linear(hidden, head).float()
            cap = self.config.final_softcap
            return cap * torch.tanh(logits / cap) if cap else logits
        weight = self.head_weight()
        if self.tp is not None:  # this rank's vocabulary rows, gathered: the full logits on every rank
            logits = parallel_logits(hidden, weight, self.config.vocab_size, self.tp).float()
        elif self.packed_head is not None and hidden.dim() == 2 and hidden.shape[0] < GEMM_ROWS[
                self.packed_head.quant.float_acts]:
            logits = self.packed_head(hidden).float()
        elif (self.half_head is not None and hidden.dim() == 2
              and hidden.shape[0] <= cpu_gemv.MAX_DENSE_ROWS.get(hidden.dtype, 0)):
            logits = linear(hidden, self.half_head).float()  # (more rows: the float32 head's GEMM)
        else:
            logits = linear(hidden, weight, None, self.gemm_head).float()
        cap = self.config.final_softcap
        return cap * torch.tanh(logits / cap) if cap else logits
