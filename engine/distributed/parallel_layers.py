"""The sharded layers of a tensor-parallel model (Megatron-style splits).

- column-parallel (q/k/v, gate/up): each rank holds some output rows; no communication. These
  are plain `Linear`s of the local width (engine/layers/attention/layer.py and engine/layers/mlp.py
  build them that size).
- RowParallelLinear (o_proj, down_proj): each rank holds some input columns and computes a
  partial sum; one all-reduce makes the full output. The bias is added by rank 0 only, so the
  sum carries it once.
- VocabParallelEmbedding: each rank holds a contiguous range of vocabulary rows; ids outside it
  embed to zero, and an all-reduce assembles every token's row.
- ParallelLMHead: each rank computes the logits of its vocabulary rows; an all-gather makes the
  full logits on every rank. The vocabulary is padded to a multiple of the ranks
  (engine/distributed/parallel.py `vocab_rows_per_rank`): padding rows are zero and their logits dropped.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.distributed.parallel import TensorParallel, all_gather_last_dim, all_reduce


class RowParallelLinear(nn.Linear):
    """y = all_reduce(x_local @ W_local^T) + b. reduce=False leaves the partial sum (the MoE block
    sums its routed and shared experts first and reduces once). Takes no LoRA adapters (a sharded
    model refuses enable_lora); `lora` is accepted for the call signature of kiln's Linear."""

    def __init__(
        self, in_features: int, out_features: int, bias: bool, tp: TensorParallel, reduce: bool = True
    ) -> None:
        super().__init__(in_features, out_features, bias=bias)
        self.tp = tp
        self.reduce = reduce

    def forward(self, x: torch.Tensor, lora: torch.Tensor | None = None) -> torch.Tensor:
        bias = self.bias if self.tp.rank == 0 else None
        y = F.linear(x, self.weight, bias)
        return all_reduce(y, self.tp) if self.reduce else y


class VocabParallelEmbedding(nn.Module):
    """Rows [first, first + rows) of the (padded) vocabulary's embedding table."""

    def __init__(self, rows_per_rank: int, hidden_size: int, tp: TensorParallel) -> None:
        super().__init__()
        self.tp = tp
        self.first = tp.rank * rows_per_rank
        self.rows = rows_per_rank
        self.weight = nn.Parameter(torch.empty(rows_per_rank, hidden_size))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.first
        mine = (local >= 0) & (local < self.rows)
        x = F.embedding(torch.where(mine, local, 0), self.weight)
        x = x * mine.unsqueeze(-1).to(x.dtype)
        return all_reduce(x, self.tp)


class ParallelLMHead(nn.Module):
    """The LM head's rows for this rank's vocabulary range (same split as VocabParallelEmbedding)."""

    def __init__(self, rows_per_rank: int, hidden_size: int, tp: TensorParallel) -> None:
        super().__init__()
        self.tp = tp
        self.weight = nn.Parameter(torch.empty(rows_per_rank, hidden_size))


def parallel_logits(hidden: torch.Tensor, weight: torch.Tensor, vocab_size: int, tp: TensorParallel) -> torch.Tensor:
    """Full logits [T, vocab_size] on every rank from this rank's vocabulary rows of the head."""
    local = F.linear(hidden, weight)
    return all_gather_last_dim(local, tp)[..., :vocab_size]
