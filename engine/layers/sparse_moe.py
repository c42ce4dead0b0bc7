"""The mixture-of-experts block of Mixtral, Qwen2-MoE and Qwen3-MoE (its quantised experts:
engine/layers/quant/moe.py).

`config` below is a ModelConfig (engine/models/config.py), read by its fields only.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import compiler.kernels.ops  # noqa: F401 - registers every kiln:: op (kiln::moe_experts here)
from engine.distributed.parallel import TensorParallel, all_reduce
from engine.layers.mlp import MLP
from engine.layers.quant.moe import QuantExperts, routed_experts


class SparseMoE(nn.Module):
    """Router + top-k routed experts (kiln::moe_experts, compiler/kernels/moe.py), plus Qwen2-MoE's
    sigmoid-gated shared expert. Expert weights are stacked: w13 [E, 2I, H] (gate rows, then
    up rows), w2 [E, H, I]; in a quantised model both are QuantExperts (engine/layers/quant/moe.py).
    Under tp every expert (and the shared one) holds this rank's I/tp gate/up rows and down columns,
    the router is whole, and one all-reduce sums the block."""

    def __init__(self, config: Any, tp: TensorParallel | None = None) -> None:
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
