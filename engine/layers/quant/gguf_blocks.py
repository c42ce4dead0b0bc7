"""GGUF (ggml) block formats, dequantised with torch ops.

Each quantised row is a run of fixed-size blocks of bytes; these functions take the raw bytes
as a uint8 tensor [..., n_blocks * block_bytes] and return float32 values [..., n_blocks * block].
The layouts follow ggml's reference C (ggml-quants.c, dequantize_row_*): plain torch ops, so
they run on the CPU and on a GPU alike, and keep no state.
"""

from __future__ import annotations

from typing import Callable

import torch

QK = 32  # values per block of the basic formats
QK_K = 256  # values per super-block of the k-quants

# ggml type id -> (name, values per block, bytes per block); the types kiln reads.
BLOCK_TYPES: dict[int, tuple[str, int, int]] = {
    0: ("F32", 1, 4),
    1: ("F16", 1, 2),
    30: ("BF16", 1, 2),
    2: ("Q4_0", QK, 18),
    3: ("Q4_1", QK, 20),
    6: ("Q5_0", QK, 22),
    7: ("Q5_1", QK, 24),
    8: ("Q8_0", QK, 34),
    12: ("Q4_K", QK_K, 144),
    13: ("Q5_K", QK_K, 176),
    14: ("Q6_K", QK_K, 210),
}


def _f16(raw: torch.Tensor) -> torch.Tensor:
    """[..., 2k] little-endian bytes -> [..., k] float32."""
    return raw.contiguous().view(torch.float16).float()


def _blocks(raw: torch.Tensor, block_bytes: int) -> torch.Tensor:
    return raw.reshape(-1, block_bytes)


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """[B, 16] bytes -> [B, 32]: the low nibbles are values 0..15, the high ones 16..31."""
    return torch.cat([qs & 0x0F, qs >> 4], dim=-1)


def _fifth_bit(qh: torch.Tensor) -> torch.Tensor:
    """[B, 4] bytes of a little-endian uint32 -> [B, 32]: bit j of it, as 0 or 16, for value j."""
    bits = torch.arange(8, device=qh.device, dtype=torch.uint8)
    return (((qh[:, :, None] >> bits) & 1) << 4).reshape(-1, 32)


def dequant_q4_0(raw: torch.Tensor) -> torch.Tensor:
    b = _blocks(raw, 18)
    d = _f16(b[:, :2])
    return d * (_nibbles(b[:, 2:]).float() - 8)


def dequant_q4_1(raw: torch.Tensor) -> torch.Tensor:
    b = _blocks(raw, 20)
    d, m = _f16(b[:, :2]), _f16(b[:, 2:4])
    return d * _nibbles(b[:, 4:]).float() + m


def dequant_q5_0(raw: torch.Tensor) -> torch.Tensor:
    b = _blocks(raw, 22)
    d = _f16(b[:, :2])
    q = _nibbles(b[:, 6:]) | _fifth_bit(b[:, 2:6])
    return d * (q.float() - 16)


def dequant_q5_1(raw: torch.Tensor) -> torch.Tensor:
    b = _blocks(raw, 24)
    d, m = _f16(b[:, :2]), _f16(b[:, 2:4])
    q = _nibbles(b[:, 8:]) | _fifth_bit(b[:, 4:8])
    return d * q.float() + m


def dequant_q8_0(raw: torch.Tensor) -> torch.Tensor:
    b = _blocks(raw, 34)
    return _f16(b[:, :2]) * b[:, 2:].contiguous().view(torch.int8).float()


def _k_scales_mins(sc: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K/Q5_K: 12 bytes -> 8 six-bit scales and 8 six-bit mins (ggml's get_scale_min_k4)."""
    lo, hi = sc[:, :4], sc[:, 4:8]
    tail = sc[:, 8:12]
    scales = torch.cat([lo & 63, (tail & 0x0F) | ((lo >> 6) << 4)], dim=-1)
    mins = torch.cat([hi & 63, (tail >> 4) | ((hi >> 6) << 4)], dim=-1)
    return scales.float(), mins.float()


def _k_apply(q: torch.Tensor, d: torch.Tensor, dmin: torch.Tensor, sc: torch.Tensor) -> torch.Tensor:
    """q [B, 8, 32] sub-block values -> d * scale * q - dmin * min, flattened to [B, 256]."""
    scales, mins = _k_scales_mins(sc)
    out = (d * scales)[:, :, None] * q.float() - (dmin * mins)[:, :, None]
    return out.reshape(-1, QK_K)


def _k_low_nibbles(qs: torch.Tensor) -> torch.Tensor:
    """[B, 128] bytes -> [B, 8, 32]: each 32-byte chunk gives a sub-block of low nibbles, then one of high."""
    chunks = qs.reshape(-1, 4, 1, 32)
    return torch.cat([chunks & 0x0F, chunks >> 4], dim=2).reshape(-1, 8, 32)


def dequant_q4_k(raw: torch.Tensor) -> torch.Tensor:
    b = _blocks(raw, 144)
    d, dmin = _f16(b[:, 0:2]), _f16(b[:, 2:4])
    return _k_apply(_k_low_nibbles(b[:, 16:]), d, dmin, b[:, 4:16])


def dequant_q5_k(raw: torch.Tensor) -> torch.Tensor:
    b = _blocks(raw, 176)
    d, dmin = _f16(b[:, 0:2]), _f16(b[:, 2:4])
    qh = b[:, 16:48]  # sub-block i takes bit i of each of these 32 bytes as its fifth bit
    bits = torch.arange(8, device=raw.device, dtype=torch.uint8)
    high = ((qh[:, None, :] >> bits[None, :, None]) & 1) << 4  # [B, 8, 32]
    return _k_apply(_k_low_nibbles(b[:, 48:]) | high, d, dmin, b[:, 4:16])


def dequant_q6_k(raw: torch.Tensor) -> torch.Tensor:
    b = _blocks(raw, 210)
    ql, qh = b[:, :128].reshape(-1, 2, 2, 32), b[:, 128:192].reshape(-1, 2, 1, 32)
    scales = b[:, 192:208].contiguous().view(torch.int8).float()  # 16 sub-blocks of 16
    d = _f16(b[:, 208:210])
    # Per half of 128 values: four runs of 32, low nibbles of ql[0:32], ql[32:64], then high
    # nibbles; the top two bits come from qh bits 0-1, 2-3, 4-5, 6-7.
    low = torch.cat([ql & 0x0F, ql >> 4], dim=2)  # [B, 2, 4, 32]
    shifts = torch.tensor([0, 2, 4, 6], device=raw.device, dtype=torch.uint8)[None, None, :, None]
    high = ((qh >> shifts) & 3) << 4
    q = (low | high).float() - 32
    return (d[:, :, None] * scales.reshape(-1, 16, 1) * q.reshape(-1, 16, 16)).reshape(-1, QK_K)


_DEQUANT: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "Q4_0": dequant_q4_0,
    "Q4_1": dequant_q4_1,
    "Q5_0": dequant_q5_0,
    "Q5_1": dequant_q5_1,
    "Q8_0": dequant_q8_0,
    "Q4_K": dequant_q4_k,
    "Q5_K": dequant_q5_k,
    "Q6_K": dequant_q6_k,
}


def dequantize(raw: torch.Tensor, type_id: int, shape: tuple[int, ...]) -> torch.Tensor:
    """raw: a tensor's bytes (uint8, any shape) or its values (F32/F16/BF16 stored as such) ->
    float32 values of `shape` (row-major, torch order: the last dimension is ggml's first)."""
    if type_id not in BLOCK_TYPES:
        raise ValueError(
            f"gguf: tensor type {type_id} is not supported (kiln reads "
            f"{', '.join(n for n, _, _ in BLOCK_TYPES.values())})"
        )
    name, block, block_bytes = BLOCK_TYPES[type_id]
    if name in ("F32", "F16", "BF16"):
        dtype = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}[name]
        values = raw.contiguous().view(torch.uint8).view(dtype) if raw.dtype == torch.uint8 else raw.to(dtype)
        return values.float().reshape(shape)
    numel = 1
    for s in shape:
        numel *= s
    if shape[-1] % block or raw.numel() != numel // block * block_bytes:
        raise ValueError(f"gguf: {name} tensor of shape {shape} does not fill whole blocks of {block}")
    return _DEQUANT[name](raw.reshape(-1)).reshape(shape)
