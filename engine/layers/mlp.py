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
        gate_up = self.gate_up_proj(x, lora)
        if self.fused and cpu_fused.usable(gate_up) and gate_up.dim() == 2:
            return self.down_proj(torch.ops.kiln_cpu_fused.silu_and_mul(gate_up, self.tanh_gelu), lora)
        gate, up = gate_up.split(self.intermediate, dim=-1)
        act = F.gelu(gate, approximate="tanh") if self.tanh_gelu else F.silu(gate)
        return self.down_proj(act * up, lora)
