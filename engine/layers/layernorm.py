"""RMSNorm: the norm of every Llama-family model (and of the EAGLE heads built on it)."""

from __future__ import annotations

import torch
from torch import nn

from compiler.kernels import cpu_fused


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
        if (
            self.fused
            and cpu_fused.usable(residual)
            and self.weight.dtype == residual.dtype
            and residual.is_contiguous()
        ):
            return residual, torch.ops.kiln_cpu_fused.add_rms_norm(
                residual, delta, self.weight, self.eps, self.weight_offset
            )
        residual = residual + delta
        return residual, self(residual)
