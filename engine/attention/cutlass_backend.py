"""The `cutlass` attention backend: kiln's AOT-built CUTLASS/CuTe kernels (CUDA only).

Kernels are loaded from the build cache (`kiln build-kernels`) in the constructor; the
backend never compiles. Forward = write_kv_cutlass then paged_attention_cutlass, both
opaque custom ops (safe inside torch.compile(fullgraph=True) and CUDA graphs).
"""

from __future__ import annotations

import torch

from engine.attention import BackendSpec
from engine.attention.base import AttentionMetadata


def _required(spec: BackendSpec) -> list[str]:
    from compiler.kernels.manifest import attention_variant_names

    return list(attention_variant_names(spec.dtype, spec.head_dim, spec.block_size).values())


def cutlass_available(spec: BackendSpec) -> bool:
    """CUDA present, cuda-python importable, and this shape's kernels built in the cache."""
    if spec.device.type != "cuda" or not torch.cuda.is_available():
        return False
    try:
        from cuda.bindings import driver  # noqa: F401

        from compiler.kernels.loader import KernelLibrary

        KernelLibrary(spec.kernel_cache_dir, _required(spec))
    except Exception:  # noqa: BLE001 - any failure means "not available": auto falls back to torch
        return False
    return True


class CutlassAttentionBackend:
    name = "cutlass"

    def __init__(self, spec: BackendSpec):
        from compiler import cutlass_ops

        self.spec = spec
        # Raises MissingKernelError (naming `kiln build-kernels --variants ...`) if not built.
        self.kernels = cutlass_ops.load_attention_kernels(
            spec.kernel_cache_dir, spec.device, spec.dtype, spec.head_dim, spec.block_size)

    def forward(self, q, k, v, kv_cache, layer: int, meta: AttentionMetadata, scale: float,
                sliding_window: int = 0, softcap: float = 0.0) -> torch.Tensor:
        torch.ops.kiln.write_kv_cutlass(k, v, kv_cache, layer, meta.slot_mapping)
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        if sliding_window > 0 or softcap > 0:
            # kiln's kernels attend the whole context, uncapped: the reference op masks and caps
            torch.ops.kiln.paged_attention(out, q, kv_cache, layer, meta.query_start_loc, meta.seq_lens,
                                           meta.block_tables, scale, meta.max_query_len, meta.max_seq_len,
                                           meta.num_decodes, sliding_window, softcap)
            return out
        torch.ops.kiln.paged_attention_cutlass(
            out, q, kv_cache, layer, meta.query_start_loc, meta.seq_lens, meta.block_tables,
            scale, meta.max_query_len, meta.max_seq_len,
        )
        return out
