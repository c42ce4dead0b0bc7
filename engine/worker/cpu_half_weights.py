"""A float32 model's dense projection weights kept in two bytes on the CPU, where that loses nothing.

An fp16 or bf16 checkpoint runs in float32 on a CPU without native bf16/fp16 dot products
(engine/worker/cpu_dtype.py), and its weights are then float32 copies of 2-byte values: a decode
step streams twice the bytes the checkpoint holds. The weight-streaming kernels multiply float32
activations by float16 / bfloat16 weights widened in registers (templates/cpu_gemv_isa.inc), which
gives exactly the products of the float32 copy, so each projection whose every value is a 2-byte
value (checked here, weight by weight) keeps that form: half the bytes per decode step, the same
outputs. The GEMM of a prefill's rows widens the weight per call (compiler/kernels/cpu_linear.py).

The decoder layers' projections (`quantizable_linears`) are replaced. The embedding table (and a
tied LM head) stays float32, since the embedding lookup hands its rows to float32 activations as is
and a GEMM of many rows would widen the whole head per call; the LM head gets an exact 2-byte copy
beside it (`keep_half_head`: +1/2 of its bytes in memory) that decode steps read instead, a
sixth of SmolLM2's bytes per step.
"""

from __future__ import annotations

import torch
from torch import nn

HALF_DTYPES = (torch.float16, torch.bfloat16)


def exact_half(weight: torch.Tensor) -> torch.Tensor | None:
    """`weight` (float32) in the first 2-byte dtype that holds every value exactly, else None."""
    for dtype in HALF_DTYPES:
        half = weight.to(dtype)
        if torch.equal(half.float(), weight):
            return half
    return None


def keep_half_weights(model, dtype: torch.dtype) -> tuple[int, int]:
    """Replace the float32 weights of `model`'s dense projections by exact 2-byte copies where they
    exist. Returns (projections changed, bytes saved). Nothing changes unless dtype is float32."""
    if dtype != torch.float32:
        return 0, 0
    changed = saved = 0
    for module in model.quantizable_linears().values():
        weight = module.weight
        if module.quant is not None or weight is None or weight.dtype != torch.float32 or not weight.is_cpu:
            continue
        half = exact_half(weight.data)
        if half is None:
            continue
        module.weight = nn.Parameter(half, requires_grad=False)
        changed += 1
        saved += weight.numel() * (weight.element_size() - half.element_size())
    return changed, saved


def keep_half_head(model, dtype: torch.dtype) -> int:
    """Give `model` (float32, unsharded) an exact 2-byte copy of its LM head as `half_head`, which
    compute_logits reads for decode rows. Returns the bytes saved per decode step (0: none)."""
    if (dtype != torch.float32 or not hasattr(model, "half_head") or model.tp is not None
            or model.packed_head is not None or not model.config.generates):
        return 0
    head = model.head_weight()
    if head.dtype != torch.float32 or not head.is_cpu:
        return 0
    half = exact_half(head.data)
    if half is None:
        return 0
    model.half_head = half
    return head.numel() * (head.element_size() - half.element_size())
