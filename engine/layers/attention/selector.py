"""Which attention backend serves a model: `get_attention_backend` resolves the `attention_backend`
setting (auto, torch or cutlass) for a BackendSpec (engine/layers/attention/base.py).

Importing this module registers every `kiln::` op (compiler/kernels/ops.py), whatever the backend.
"""

from __future__ import annotations

import logging

import compiler.kernels.ops  # noqa: F401  (registers every torch.ops.kiln.* op)
from engine.layers.attention.base import AttentionBackend, BackendSpec

logger = logging.getLogger(__name__)


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
