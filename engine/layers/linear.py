"""kiln's projection layer (dense, quantised through engine/layers/quant/, LoRA-capable) and the
row-parallel choice for o_proj / down_proj, with its post-load weight work on the CPU.

Post-load weight work (`Linear.process_weights_after_loading`; the model walks its layers, the builder
decides which copies: engine/runtime/builder.py, engine/worker/cpu_gemm_weights.py):

- "half": an fp16 or bf16 checkpoint runs in float32 on a CPU without native bf16/fp16 dot products
  (engine/worker/cpu_dtype.py), and its weights are then float32 copies of 2-byte values: a decode
  step streams twice the bytes the checkpoint holds. The weight-streaming kernels multiply float32
  activations by float16 / bfloat16 weights widened in registers (templates/cpu_gemv_isa.inc), which
  gives exactly the products of the float32 copy, so a weight whose every value is a 2-byte value
  (checked weight by weight) keeps that form: half the bytes per decode step, the same outputs. The
  GEMM of a prefill's rows widens the weight per call (compiler/kernels/cpu_linear.py).
- "gemm": oneDNN's own blocked copy of a dense weight for the GEMM rows of CPU steps (more rows than
  the weight-streaming kernels take): handed the plain [out, in] weight, oneDNN reorders it on every
  call; given that layout once, it does not (why and where it pays: engine/worker/cpu_gemm_weights.py).
  Decode rows up to the kernels' limit still read the plain weight.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from compiler.kernels.cpu_linear import linear, pack_for_gemm
from engine.distributed.parallel import TensorParallel
from engine.distributed.parallel_layers import RowParallelLinear

HALF_DTYPES = (torch.float16, torch.bfloat16)
WEIGHT_COPIES = ("half", "gemm")  # the post-load work process_weights_after_loading does


def exact_half(weight: torch.Tensor) -> torch.Tensor | None:
    """`weight` (float32) in the first 2-byte dtype that holds every value exactly, else None."""
    for dtype in HALF_DTYPES:
        half = weight.to(dtype)
        if torch.equal(half.float(), weight):
            return half
    return None


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
        self.gemm_weight = None  # oneDNN's blocked copy of weight for GEMM rows (process_weights_after_loading)

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

    def process_weights_after_loading(self, dtype: torch.dtype, copy: str) -> int:
        """The loaded dense weight of a model of `dtype` on the CPU, reworked (module docstring):
        "half" keeps a float32 weight that holds only 2-byte values in 2 bytes (returns the bytes
        saved), "gemm" gives a weight of the model's dtype oneDNN's blocked copy (returns its bytes).
        0: nothing done (a quantised layer, another dtype, values that need float32, no packing)."""
        if copy not in WEIGHT_COPIES:
            raise ValueError(f"process_weights_after_loading: {copy!r} is not one of {WEIGHT_COPIES}")
        weight = self.weight
        if self.quant is not None or weight is None:
            return 0
        if copy == "half":
            if dtype != torch.float32 or weight.dtype != torch.float32 or not weight.is_cpu:
                return 0
            half = exact_half(weight.data)
            if half is None:
                return 0
            self.weight = nn.Parameter(half, requires_grad=False)
            return weight.numel() * (weight.element_size() - half.element_size())
        if weight.dtype != dtype or (packed := pack_for_gemm(weight.data)) is None:
            return 0
        self.gemm_weight = packed
        return weight.numel() * weight.element_size()


def row_parallel(
    in_features: int, out_features: int, bias: bool, tp: TensorParallel | None, reduce: bool = True
) -> nn.Module:
    """o_proj / down_proj: kiln's Linear, or this rank's columns of it (all-reduced) under tp."""
    if tp is None:
        return Linear(in_features, out_features, bias)
    return RowParallelLinear(in_features, out_features, bias, tp, reduce)
