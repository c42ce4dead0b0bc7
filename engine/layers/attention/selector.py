"""Which attention backend serves a model: `get_attention_backend` resolves the `attention_backend`
setting (auto, torch or cutlass) for a BackendSpec (engine/layers/attention/base.py).

Importing this module registers every `kiln::` op (compiler/kernels/ops.py), whatever the backend.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Protocol

import torch

import compiler.kernels.ops  # noqa: F401  (registers every torch.ops.kiln.* op)
from engine.layers.attention.base import AttentionBackend, BackendSpec

logger = logging.getLogger(__name__)


class BackendSettings(Protocol):
    """The settings a model's backend is chosen by (EngineSettings; layers/ does not import config)."""

    @property
    def attention_backend(self) -> str: ...
    @property
    def block_size(self) -> int: ...
    @property
    def enforce_eager(self) -> bool: ...
    @property
    def decode_kernel(self) -> str: ...
    @property
    def prefill_kernel(self) -> str: ...
    def resolved_kernel_cache_dir(self) -> Path: ...


class AttentionShape(Protocol):
    """What of a model's config the backend must support (engine/models/config.py ModelConfig)."""

    @property
    def head_dim(self) -> int: ...
    @property
    def layer_windows(self) -> tuple[int, ...]: ...
    @property
    def attn_softcap(self) -> float: ...


def attention_backend_for(
    s: BackendSettings,
    shape: AttentionShape,
    device: torch.device,
    dtype: torch.dtype,
    kv_cache_dtype: torch.dtype | None = None,
) -> AttentionBackend:
    """The backend of one model (the target on every rank, a draft model or EAGLE head), as the
    settings choose it for the model's attention layers."""
    return get_attention_backend(
        s.attention_backend,
        BackendSpec(
            device=device,
            dtype=dtype,
            head_dim=shape.head_dim,
            block_size=s.block_size,
            kernel_cache_dir=s.resolved_kernel_cache_dir(),
            compile=not s.enforce_eager,
            decode_kernel=s.decode_kernel,
            prefill_kernel=s.prefill_kernel,
            windowed_or_capped=any(shape.layer_windows) or shape.attn_softcap > 0,
            kv_cache_dtype=kv_cache_dtype,
        ),
    )


def get_attention_backend(name: str, spec: BackendSpec) -> AttentionBackend:
    """Resolve the `attention_backend` setting (auto/torch/cutlass)."""
    if name == "auto":
        name = "torch"
        if spec.device.type == "cuda":
            from engine.layers.attention.cutlass_backend import cutlass_unavailable_reason

            reason = cutlass_unavailable_reason(spec)
            if reason is None:
                name = "cutlass"
            else:
                logger.info("attention_backend=auto: using the torch backend (%s)", reason)
    if name == "torch":
        from engine.layers.attention.torch_backend import TorchAttentionBackend

        return TorchAttentionBackend(compiled_cpu_decode=spec.compile and spec.device.type == "cpu")
    if name == "cutlass":
        if spec.device.type != "cuda":
            raise ValueError("attention_backend='cutlass' needs device='cuda' (a CUDA GPU)")
        from engine.layers.attention.cutlass_backend import CutlassAttentionBackend

        return CutlassAttentionBackend(spec)
    raise ValueError(f"attention_backend: unknown value {name!r} (expected auto, torch or cutlass)")
