"""A Llama-family model's decoder layers as one C++ call on the CPU (templates/cpu_decoder_stack.inc).

At batch 1 the eager forward of SmolLM2 (30 layers) is ~1,200 torch ops, and their Python dispatch
costs about as much as the weight-streaming projections of a 4-bit model; the stack runs the same
kernels in the same order from C++ (the fused norms / RoPE / activation, kiln_cpu_gemv's
projections, kiln_cpu's KV write and attention), so its output is the eager forward's bit for bit
(tests/models/test_cpu_stack.py) at a few µs of host time a layer (batch-1 decode steps 1.2-1.55x faster
on SmolLM2: benchmarks/2026-12-02.md, BENCH_cpustep, `kiln bench cpu --decoder-stack`).

Steps of up to 8 rows (batch-1 decode, spec-decode verifies) run on the stack's own thread team:
one parallel region for the whole step, each thread its share of every projection's output rows,
a spin-then-yield barrier between phases, the short serial parts (norms, RoPE, attention) on the
first thread. OpenMP's fork/join per projection let the idle thread fall asleep and pay a wake-up
~240 times a step (SmolLM2 F32 batch 1: 1.12-1.22x on a quiet machine; with a busy neighbour on
one of the two cores ~0.9x; larger steps keep fork/join: at batch 16 the team was 0.9x).

With an EAGLE-3 head (engine/models/eagle.py) the stack also copies the residual stream entering
the head's target layers into the model's aux_hidden, as the eager forward does (until then a
target with an EAGLE-3 head ran op by op: 27 tok/s instead of 45 on SmolLM2 F32).

`build` makes the stack from a loaded model, or says why it cannot: it covers the plain pre-norm
layer (input norm, q/k/v with optional bias and q/k norms, RoPE of either layout, partial rotary,
windows and soft-capping, o_proj, post-attention norm, gated SiLU / tanh-GELU MLP) whose
projections all run on the weight-streaming kernels (dense float weights, or cpu_packed layers
without an act-order permutation). Not covered (the eager forward runs them): mixture-of-experts,
tensor parallelism, LoRA, Gemma 2/3's sandwich norms and local rotary base, other quantised
methods. `StackRunner.runs` decides per step: only as many rows as every projection runs on the
kernels in the eager forward too (dense: cpu_gemv.MAX_DENSE_ROWS for the dtype, more go to oneDNN;
packed: below each layer's gemm_rows, this machine's measured crossover (cpu_crossover.py), from
there prefill chunks run the GEMM on a dequantised weight), and at most cpu_packed.MLP_PIECE_ROWS
(the stack's MLP product is [rows, 2 x intermediate] whole, where the eager forward runs larger
steps in pieces of that many rows; at a few hundred rows a step is seconds, and the host time the
stack saves, a few ms, no longer counts), the backend's plain C++ attention (no fp8 KV scales), no
autograd, no torch.compile.
"""

from __future__ import annotations

import logging

import torch

from compiler.kernels import cpu_fused, cpu_gemv
from engine.layers.attention.base import AttentionBackend, AttentionMetadata
from engine.layers.quant import cpu_packed

logger = logging.getLogger(__name__)


def _projection_reason(linear, dtype: torch.dtype) -> str | None:
    """Why a projection cannot run in the stack (None: it can)."""
    quant = linear.quant
    if quant is None:
        w = linear.weight
        if not (
            w.is_cpu
            and w.dim() == 2
            and w.is_contiguous()
            and (w.dtype == dtype or (dtype == torch.float32 and w.dtype in cpu_gemv.DENSE_DTYPES))
        ):
            return f"a dense {w.dtype} weight with {dtype} activations"
        return None
    if not hasattr(linear, "gemv_runs"):
        return f"{type(quant).__name__} weights (only the weight-streaming kernels' layout runs in the stack)"
    if linear.gemv_perm is not None:
        return "act-order column permutation"
    return None


def why_not(model, dtype: torch.dtype) -> str | None:
    """Why `model` cannot run as a CPU decoder stack (None: it can)."""
    cfg = model.config
    if dtype not in cpu_fused.DTYPES:
        return f"{dtype} activations"
    if not cpu_fused.FUSED.ready:
        return "the fused CPU ops are not loaded"
    if model.tp is not None:
        return "tensor parallelism"
    if cfg.is_moe:
        return "mixture-of-experts layers"
    if cfg.sandwich_norms or model.rotary_local is not None:
        return "Gemma 2/3 sandwich norms or local rotary base"
    if model.lora_slots:
        return "LoRA adapters"
    if model.rotary.cos_sin.dtype != torch.float32:
        return "a non-float32 rotary table"
    for i, layer in enumerate(model.layers):
        attn = layer.self_attn
        norms = [layer.input_layernorm, layer.post_attention_layernorm, model.norm]
        norms += [attn.q_norm, attn.k_norm] if attn.q_norm is not None else []
        if any(n.weight.dtype != dtype for n in norms):
            return f"layer {i}: norm weights not in {dtype}"
        for proj in (attn.qkv_proj, attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj):
            reason = _projection_reason(proj, dtype)
            if reason:
                return f"layer {i}: {reason}"
    if not cpu_gemv.GEMV.ensure():
        return "the weight-streaming kernels are not available"
    return None


def _kernel_rows(linear, dtype: torch.dtype) -> int:
    """The most rows of `dtype` activations that the eager forward runs `linear` with on the kernels."""
    if linear.quant is None:
        return cpu_gemv.MAX_DENSE_ROWS.get(dtype, 0)
    return min(linear.quant.gemm_rows - 1, cpu_packed.MLP_PIECE_ROWS)


def _add_projection(stack, linear) -> None:
    if linear.quant is None:
        stack.add_dense(linear.weight, linear.bias)
        return
    runs = linear.gemv_runs
    stack.add_packed(
        linear.out_features,
        linear.in_features,
        not linear.quant.float_acts,
        linear.bias,
        [r[0] for r in runs],
        [r[1] for r in runs],
        [r[2] for r in runs],
        [r[3] for r in runs],
        [getattr(linear, f"gemv_packed{i}") for i in range(len(runs))],
    )


class StackRunner:
    """The built stack and when it runs."""

    def __init__(self, stack, max_rows: int, dtype: torch.dtype) -> None:
        self.stack = stack
        self.max_rows = max_rows  # (the stack's own check too)
        self.dtype = dtype

    def runs(self, rows: int, positions: torch.Tensor, backend: AttentionBackend | None, lora) -> bool:
        return (
            rows <= self.max_rows
            and lora is None
            and backend is not None
            and positions.dtype == torch.int64
            and getattr(backend, "plain_cpu_kernels", False)
            and not torch.is_grad_enabled()
            and not torch.compiler.is_compiling()
        )

    def forward(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        aux: torch.Tensor | None = None,
        aux_layers: tuple[int, ...] = (),
    ) -> torch.Tensor:
        """aux_layers (EAGLE-3): the residual stream entering each of these layers is copied into
        its [hidden] columns of aux, side by side (LlamaModel._keep_aux's layout)."""
        return self.stack.forward(
            x,
            positions,
            kv_cache,
            meta.slot_mapping,
            meta.query_start_loc,
            meta.seq_lens,
            meta.block_tables,
            aux,
            list(aux_layers),
        )


def build(model, dtype: torch.dtype) -> StackRunner | None:
    """The model's stack, or None (logged with the reason) when it cannot run as one."""
    reason = why_not(model, dtype)
    if reason:
        logger.info("CPU decoder stack: off (%s); the eager forward runs op by op", reason)
        return None
    cfg = model.config
    first = model.layers[0].self_attn
    projections = [
        p
        for layer in model.layers
        for p in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj)
    ]
    max_rows = min(_kernel_rows(p, dtype) for p in projections)
    stack = torch.classes.kiln_cpu_fused.DecoderStack(
        cpu_gemv.GEMV.level,
        cfg.hidden_size,
        first.num_heads,
        first.num_kv_heads,
        first.head_dim,
        model.norm.eps,
        model.norm.weight_offset,
        model.layers[0].mlp.tanh_gelu,
        cfg.rope_interleaved,
        max_rows,
        model.norm.weight,
        model.rotary.cos_sin,
    )
    for layer in model.layers:
        attn = layer.self_attn
        stack.add_layer(
            attn.layer_index,
            layer.input_layernorm.weight,
            layer.post_attention_layernorm.weight,
            None if attn.q_norm is None else attn.q_norm.weight,
            None if attn.k_norm is None else attn.k_norm.weight,
            float(attn.scale),
            int(attn.sliding_window or 0),
            float(attn.softcap or 0.0),
        )
        for proj in (attn.qkv_proj, attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj):
            _add_projection(stack, proj)
    logger.info(
        "CPU decoder stack: %d layers as one C++ call per step, steps of up to %d rows", cfg.num_layers, max_rows
    )
    return StackRunner(stack, max_rows, dtype)
