"""Attention backends: `torch` (reference, CPU and CUDA) and `cutlass` (kiln's kernels, CUDA)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from engine.attention.base import AttentionBackend, AttentionMetadata

__all__ = ["AttentionBackend", "AttentionMetadata", "BackendSpec", "get_attention_backend"]


@dataclass(frozen=True)
class BackendSpec:
    """What a backend must support for one model: decided at start-up, before serving."""

    device: torch.device
    dtype: torch.dtype
    head_dim: int
    block_size: int
    kernel_cache_dir: Path
    compile: bool = False  # compilation allowed (not enforce_eager)


def get_attention_backend(name: str, spec: BackendSpec) -> AttentionBackend:
    """Resolve the `attention_backend` setting (auto/torch/cutlass)."""
    if name == "auto":
        name = "torch"
        if spec.device.type == "cuda":
            from engine.attention.cutlass_backend import cutlass_available

            if cutlass_available(spec):
                name = "cutlass"
    if name == "torch":
        from engine.attention.torch_backend import TorchAttentionBackend

        return TorchAttentionBackend(compiled_cpu_decode=spec.compile and spec.device.type == "cpu")
    if name == "cutlass":
        if spec.device.type != "cuda":
            raise ValueError("attention_backend='cutlass' needs device='cuda' (a CUDA GPU)")
        from engine.attention.cutlass_backend import CutlassAttentionBackend

        return CutlassAttentionBackend(spec)
    raise ValueError(f"attention_backend: unknown value {name!r} (expected auto, torch or cutlass)")
