"""The attention backend protocol and the metadata every backend reads.

Metadata is passed explicitly, as an argument, through the model's forward: no
module-level state.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch


@dataclass
class AttentionMetadata:
    """Per-step attention inputs, flattened over a mixed batch of prefill chunks and decodes.

    slot_mapping     int64 [num_tokens]       cache slot (block * block_size + offset) per token; -1 = skip
    query_start_loc  int32 [num_seqs + 1]     offsets of each sequence's tokens in the batch
    seq_lens         int32 [num_seqs]         context length including this step's tokens (0 = padding)
    block_tables     int32 [num_seqs, max_blocks_per_seq]
    max_query_len / max_seq_len: host-side bounds for this step (size padding, pick kernels).
    num_decodes: how many leading sequences have exactly one query token (the scheduler puts
    decodes first); 0 when unknown.
    (Other features' per-step inputs travel in engine/layers/forward_context.py's ForwardContext.)
    """

    slot_mapping: torch.Tensor
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_tables: torch.Tensor
    max_query_len: int
    max_seq_len: int
    num_decodes: int = 0


class AttentionBackend(Protocol):
    name: str

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        layer: int,
        meta: AttentionMetadata,
        scale: float,
        sliding_window: int = 0,
        softcap: float = 0.0,
    ) -> torch.Tensor:
        """Write k/v [T, Hkv, D] into layer `layer` of the whole cache
        [layers, 2, blocks, block_size, Hkv, D], then attend q [T, Hq, D]; returns [T, Hq, D].
        q/k/v may be strided views (head_dim contiguous). The torch backend also takes q with
        padding rows past k's (the eager CPU forward's row bucket): they come out as zeros.
        sliding_window > 0: each query sees only the last `sliding_window` positions.
        softcap > 0: scores are softcap * tanh(scores / softcap) (Gemma 2)."""
        ...

    def use_kv_scales(self, kv_scales) -> None:
        """An fp8 KV cache's scales (engine/layers/kv_cache.py KVScales; None: scale 1)."""
        ...


@dataclass(frozen=True)
class BackendSpec:
    """What a backend must support for one model: decided at start-up, before serving."""

    device: torch.device
    dtype: torch.dtype
    head_dim: int
    block_size: int
    kernel_cache_dir: Path
    compile: bool = False  # compilation allowed (not enforce_eager)
    decode_kernel: str = "v1"  # cutlass decode generation (EngineSettings.decode_kernel)
    prefill_kernel: str = "mma"  # cutlass prefill generation (EngineSettings.prefill_kernel)
    # The model has sliding-window or soft-capped attention layers, which kiln's kernels do not do.
    windowed_or_capped: bool = False
    # The KV cache's element type when it differs from `dtype` (kv_cache_dtype = fp8); None: dtype.
    kv_cache_dtype: torch.dtype | None = None
