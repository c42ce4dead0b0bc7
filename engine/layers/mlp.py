"""The gated MLP of a Llama-family decoder: fused gate/up, SiLU (or Gemma's tanh GELU), down.

`config` below is a ModelConfig (engine/models/config.py), read by its fields only.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from compiler.kernels import cpu_fused
from engine.distributed.parallel import TensorParallel
from engine.layers.linear import Linear, row_parallel
from engine.layers.quant import cpu_packed


class MLP(nn.Module):
    def __init__(
        self, config: Any, intermediate_size: int | None = None, tp: TensorParallel | None = None, reduce: bool = True
    ) -> None:
        """tp: this rank's gate/up rows and down columns; reduce=False leaves down's partial sum."""
        super().__init__()
        world = 1 if tp is None else tp.world_size
        self.intermediate = (intermediate_size or config.intermediate_size) // world
        self.gate_up_proj = Linear(
            config.hidden_size, 2 * self.intermediate, config.mlp_bias, parts=(self.intermediate, self.intermediate)
        )
        self.down_proj = row_parallel(self.intermediate, config.hidden_size, config.mlp_bias, tp, reduce)
        self.tanh_gelu = config.hidden_act == "gelu_pytorch_tanh"
        self.fused = False  # kiln_cpu_fused::silu_and_mul on the CPU (LlamaForCausalLM.use_cpu_fused_ops)

    def forward(self, x: torch.Tensor, lora: torch.Tensor | None = None) -> torch.Tensor:
        if lora is None and isinstance(self.gate_up_proj.quant, cpu_packed.CpuPackedMethod):
            # (a prefill's rows on a packed layer: gate/up and the activation slice by slice through
            # the GEMM, or on the kernels a few hundred rows at a time)
            act = cpu_packed.gated_in_slices(self.gate_up_proj, x, self.intermediate, self._act)
            if act is not None:
                return self.down_proj(act, lora)
            rows = x.shape[0] if x.dim() == 2 else 0
            if cpu_packed.on_kernels(self.gate_up_proj, rows) and cpu_packed.on_kernels(self.down_proj, rows):
                y = cpu_packed.gated_rows_in_pieces(self.gate_up_proj, self.down_proj, self._act, x)
                if y is not None:
                    return y
        return self.down_proj(self._act(self.gate_up_proj(x, lora)), lora)

    def _act(self, gate_up: torch.Tensor) -> torch.Tensor:
        """[..., gate | up] -> act(gate) * up."""
        if self.fused and cpu_fused.usable(gate_up) and gate_up.dim() == 2:
            return torch.ops.kiln_cpu_fused.silu_and_mul(gate_up, self.tanh_gelu)
        gate, up = gate_up.split(gate_up.shape[-1] // 2, dim=-1)
        act = F.gelu(gate, approximate="tanh") if self.tanh_gelu else F.silu(gate)
        return act * up
