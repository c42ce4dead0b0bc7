"""The FP8 KV cache's element format: how K/V rows are stored and read back.

An fp8 cache holds e4m3 elements (torch.float8_e4m3fn) with one float scale per layer for K and
one for V, kept in a float32 tensor [layers, 2] (vLLM's `k_scale` / `v_scale`): a row x is
stored as x / scale saturated to ±448 (e4m3's largest finite value; NaN stays NaN) and read
back as element * scale. Every implementation (the reference, the CPU decode kernel, the
CUTLASS kernels) follows these definitions; the scales stay on the device, so calibrating them
never syncs with the host and captured graphs read the current values.

Some CPU kernels (index_copy_, index_select) do not take float8 tensors: the cache is moved
through a uint8 view of the same bytes (`byte_view`), which is exact.
"""

from __future__ import annotations

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype == FP8_DTYPE


def byte_view(t: torch.Tensor) -> torch.Tensor:
    """The same storage as uint8 when `t` is fp8 (ops without float8 kernels), else `t`."""
    return t.view(torch.uint8) if is_fp8(t.dtype) else t


def quantize_fp8(x: torch.Tensor, scale: torch.Tensor | float | None) -> torch.Tensor:
    """x / scale, saturated to ±448, as e4m3 (round to nearest even)."""
    y = x.float() if scale is None else x.float() / scale
    return y.clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def to_cache(x: torch.Tensor, cache_dtype: torch.dtype, scale: torch.Tensor | None) -> torch.Tensor:
    """Rows as the cache stores them: quantized for an fp8 cache, else cast."""
    return quantize_fp8(x, scale) if is_fp8(cache_dtype) else x.to(cache_dtype)


def from_cache(x: torch.Tensor, dtype: torch.dtype, scale: torch.Tensor | None) -> torch.Tensor:
    """Cache elements as `dtype` values: dequantized (element * scale) for an fp8 cache."""
    if not is_fp8(x.dtype):
        return x.to(dtype)
    if scale is None:
        return x.to(dtype)  # exact: every e4m3 value is a bf16 / fp16 / fp32 value
    # The product in float32, rounded to `dtype` once, as the kernels do in registers: a scale
    # cast to bf16 first would be off by up to 2^-9 for the whole layer, and the product
    # rounded twice.
    return (x.float() * scale.float()).to(dtype)


def layer_scales(kv_scales: torch.Tensor | None, layer: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(k_scale, v_scale) of one layer as 0-d tensors, or (None, None): scale 1."""
    if kv_scales is None:
        return None, None
    return kv_scales[layer, 0], kv_scales[layer, 1]


def calibrate_kv_scales(
    k: torch.Tensor,
    v: torch.Tensor,
    slot_mapping: torch.Tensor,
    kv_scales: torch.Tensor,
    calibrated: torch.Tensor,
    layer: int,
) -> None:
    """Set layer `layer`'s scales to amax / 448 of the K and V rows this step writes, the first
    time the layer writes any (calibrated[layer] is then set and later calls change nothing);
    what vLLM's `calculate_kv_scales` does on the first forward. Device tensors only: no host
    sync, so it is safe inside torch.compile and CUDA graphs (rows with slot < 0 are ignored,
    which makes padding and capture steps no-ops)."""
    if k.shape[0] == 0:
        return
    valid = (slot_mapping >= 0)[:, None, None]
    amax = torch.stack(
        [torch.where(valid, k.float().abs(), 0.0).amax(), torch.where(valid, v.float().abs(), 0.0).amax()]
    )
    fresh = torch.where(amax > 0, amax / FP8_MAX, 1.0)  # an all-zero layer keeps scale 1
    take = valid.any() & ~calibrated[layer]
    kv_scales[layer] = torch.where(take, fresh, kv_scales[layer])
    calibrated[layer] = calibrated[layer] | valid.any()
