"""Attention backends: `torch` (reference, CPU and CUDA) and `cutlass` (kiln's kernels, CUDA).

Importing this package registers every `kiln::` op (compiler/ops.py), whatever the backend.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch

import compiler.ops  # noqa: F401  (registers every torch.ops.kiln.* op)
from engine.attention.base import AttentionBackend, AttentionMetadata

__all__ = ["AttentionBackend", "AttentionMetadata", "BackendSpec", "get_attention_backend"]

logger = logging.getLogger(__name__)


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


def get_attention_backend(name: str, spec: BackendSpec) -> AttentionBackend:
    """Resolve the `attention_backend` setting (auto/torch/cutlass)."""
    if name == "auto":
        name = "torch"
        if spec.device.type == "cuda":
            from engine.attention.cutlass_backend import cutlass_unavailable_reason

            reason = cutlass_unavailable_reason(spec)
            if reason is None:
                name = "cutlass"
            else:
                logger.info("attention_backend=auto: using the torch backend (%s)", reason)
    if name == "torch":
        from engine.attention.torch_backend import TorchAttentionBackend

        return TorchAttentionBackend(compiled_cpu_decode=spec.compile and spec.device.type == "cpu")
    if name == "cutlass":
        if spec.device.type != "cuda":
            raise ValueError("attention_backend='cutlass' needs device='cuda' (a CUDA GPU)")
        from engine.attention.cutlass_backend import CutlassAttentionBackend

        return CutlassAttentionBackend(spec)
    raise ValueError(f"attention_backend: unknown value {name!r} (expected auto, torch or cutlass)")
