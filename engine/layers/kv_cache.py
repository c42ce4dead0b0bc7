"""The KV tensors: one allocation [layers, 2, num_blocks, block_size, kv_heads, head_dim].

A single tensor lets a block be copied or swapped for every layer at once. With
`kv_cache_dtype = "fp8"` the elements are e4m3 (1 byte) and the cache also holds the per-layer
K/V scales (`scales`, float32 [layers, 2], on the cache's device; compiler/kernels/kv_quant.py).
"""

from __future__ import annotations

import math
import mmap

import torch

from compiler.kernels.kv_quant import FP8_DTYPE, is_fp8

# kv_cache_dtype values (engine/config/settings.py validates them) that name an element type; "auto" is
# the model's dtype (but see CPU_AUTO_KV_DTYPE). vLLM's "fp8" is e4m3 on NVIDIA GPUs, as here.
KV_CACHE_DTYPES = {
    "fp8": FP8_DTYPE,
    "fp8_e4m3": FP8_DTYPE,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float32": torch.float32,
}

# "auto" for a float32 model on the CPU (one process): a half-precision cache. Decode at long
# context streams the whole cache every step, so 2-byte elements halve what it reads; greedy
# answers agree with a float32 cache on >= 99% of tokens (tests/layers/test_half_kv.py measures it).
CPU_AUTO_KV_DTYPE = torch.float16


def resolve_kv_cache_dtype(
    setting: str, model_dtype: torch.dtype, device_type: str = "cuda", tensor_parallel_size: int = 1
) -> torch.dtype:
    """The cache's element type for a kv_cache_dtype setting. "auto" is the model dtype, except
    for a float32 model on the CPU without tensor parallelism (whose ranks keep the model dtype):
    CPU_AUTO_KV_DTYPE. The GPU's "auto" is always the model dtype."""
    if setting == "auto":
        if device_type == "cpu" and model_dtype == torch.float32 and tensor_parallel_size == 1:
            return CPU_AUTO_KV_DTYPE
        return model_dtype
    try:
        return KV_CACHE_DTYPES[setting]
    except KeyError:
        raise ValueError(
            f"kv_cache_dtype: unknown value {setting!r} (expected auto, {', '.join(KV_CACHE_DTYPES)})"
        ) from None


def untouched_zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zeroed CPU tensor whose pages are not touched until written: an anonymous mapping of its
    own, zero pages from the OS, so the reservation costs no time at start and resident memory
    grows with the KV actually written (torch.zeros writes every byte). On 4 KB pages, never
    transparent huge pages: a block written then costs its own pages, not the 2 MB around it (numpy's
    zeros, used before, advises huge pages on large arrays, and the first token written to each
    layer's K and V made 2 MB of it resident: SmolLM2's whole cache on its first step, issue 40)."""
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if nbytes == 0:
        return torch.zeros(shape, dtype=dtype)
    pages = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_NOHUGEPAGE"):  # (Linux; also under transparent_hugepage=always)
        pages.madvise(mmap.MADV_NOHUGEPAGE)
    # (the tensor keeps the mapping alive)
    return torch.frombuffer(pages, dtype=torch.uint8, count=nbytes).view(dtype).view(shape)


class KVCache:
    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
        pin_memory: bool = False,
        model_dtype: torch.dtype | None = None,
    ) -> None:
        shape = (num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim)
        if torch.device(device).type == "cpu" and not pin_memory:
            self.tensor = untouched_zeros(shape, dtype)
        else:
            self.tensor = torch.zeros(shape, dtype=dtype, device=device, pin_memory=pin_memory)
        self.num_blocks = num_blocks
        self.block_size = block_size
        # The dtype of the rows the model writes and reads back (the cache's own unless fp8).
        self.model_dtype = model_dtype or (torch.bfloat16 if is_fp8(dtype) else dtype)
        # fp8: K and V scales per layer (1 until the checkpoint's or calibrated ones are set).
        self.scales = torch.ones(num_layers, 2, dtype=torch.float32, device=device) if is_fp8(dtype) else None

    @property
    def dtype(self) -> torch.dtype:
        return self.tensor.dtype

    def set_scales(self, scales: torch.Tensor) -> None:
        """Use these [layers, 2] K/V scales (an fp8 cache only), copied in place so every holder
        of `self.scales` (backends, captured graphs) sees them."""
        if self.scales is None:
            raise ValueError("KV scales apply to an fp8 KV cache only (kv_cache_dtype = fp8)")
        if tuple(scales.shape) != tuple(self.scales.shape):
            raise ValueError(f"KV scales: expected shape {tuple(self.scales.shape)}, got {tuple(scales.shape)}")
        if not bool(torch.isfinite(scales).all()) or bool((scales <= 0).any()):
            raise ValueError("KV scales must be finite and positive")
        self.scales.copy_(scales.to(torch.float32))

    @staticmethod
    def bytes_per_block(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        """Bytes of one block of every layer's K and V in a cache of element type `dtype` (1 for
        fp8, 2 for bf16/fp16, 4 for fp32: at a fixed budget fp8 holds twice the blocks of bf16
        and four times those of fp32)."""
        return num_layers * 2 * block_size * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()


class KVScales:
    """An fp8 cache's K/V scales as the attention backends read them: `tensor` is the cache's
    [layers, 2] scales (shared, updated in place); with `calibrate`, each layer's first write of
    real rows sets its scales first (compiler/kernels/kv_quant.py calibrate_kv_scales: device-only,
    safe in compiled code and CUDA graphs)."""

    def __init__(self, scales: torch.Tensor, calibrate: bool = False) -> None:
        self.tensor = scales
        self.calibrated = torch.zeros(scales.shape[0], dtype=torch.bool, device=scales.device) if calibrate else None

    def before_write(
        self, k: torch.Tensor, v: torch.Tensor, layer: int, slot_mapping: torch.Tensor, eager: bool = False
    ) -> torch.Tensor:
        """Calibrate if asked (the op, or its implementation directly when `eager`); returns the
        scales the write and the attention use."""
        if self.calibrated is not None:
            if eager:
                from compiler.kernels.kv_quant import calibrate_kv_scales

                calibrate_kv_scales(k, v, slot_mapping, self.tensor, self.calibrated, layer)
            else:
                torch.ops.kiln.calibrate_kv_scales(k, v, slot_mapping, self.tensor, self.calibrated, layer)
        return self.tensor
