"""Packed integer weights (GPTQ, AWQ, compressed-tensors pack-quantized) -> kiln's one layout.

kiln's layout, output rows first so that fused projections (q/k/v, gate/up) are row slices:
  qweight  uint8 [out, in // 2] for 4 bits (column 2k in the low nibble, 2k+1 in the high one),
           uint8 [out, in] for 8 bits; unsigned values 0 .. 2**bits - 1
  zeros    uint8 [out, groups]  the unsigned zero point (2**(bits-1) when symmetric)
  scales   float32 [out, groups]
  g_idx    int32 [in]  each input column's group (act-order permutes it; else column // group_size)
and the weight is W[o, i] = (q[o, i] - zeros[o, g_idx[i]]) * scales[o, g_idx[i]].

Each checkpoint format, as its writer defines it:
  GPTQ (AutoGPTQ / GPTQModel): qweight int32 [in * bits / 32, out], packed along the input
    dimension, value k of a word at bits k*bits; qzeros int32 [groups, out * bits / 32] packed
    along the output dimension; scales [groups, out]; g_idx [in]. The original ("gptq") format
    stores zero points minus one; "gptq_v2" stores them as they are.
  AWQ (AutoAWQ GEMM): qweight int32 [in, out / 8] packed along the output dimension with its
    interleaved order: nibble k holds column 8j + [0, 2, 4, 6, 1, 3, 5, 7][k]; qzeros int32
    [groups, out / 8] the same way; scales [groups, out].
  compressed-tensors pack-quantized: weight_packed int32 [out, in * bits / 32] packed along the
    input dimension, values offset by 2**(bits-1) (signed -> unsigned); weight_zero_point (when
    asymmetric) signed, packed along the output dimension [out * bits / 32, groups];
    weight_scale [out, groups]; weight_g_idx [in] with group act-order.
"""

from __future__ import annotations

import torch

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


def unpack_int32(packed: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """int32 words -> their 32/bits values each, laid out along `dim` (value k at bits k*bits)."""
    per = 32 // bits
    p = packed.to(torch.int32).movedim(dim, -1)
    vals = torch.empty(*p.shape, per, dtype=torch.uint8, device=packed.device)  # [..., words, per]
    for k in range(per):  # (one value at a time: temporaries of the packed size, not 4 bytes a value)
        vals[..., k] = ((p >> (k * bits)) & ((1 << bits) - 1)).to(torch.uint8)
    return vals.reshape(*p.shape[:-1], p.shape[-1] * per).movedim(-1, dim)


def pack_nibbles(q: torch.Tensor) -> torch.Tensor:
    """uint8 [out, in] values 0..15 -> uint8 [out, in // 2] (kiln's 4-bit layout)."""
    return q[:, 0::2] | (q[:, 1::2] << 4)


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [..., in // 2] -> [..., in] (any leading dimensions: stacked experts too)."""
    return torch.stack([packed & 0x0F, packed >> 4], dim=-1).reshape(*packed.shape[:-1], -1)


def default_g_idx(in_features: int, group_size: int, device=None) -> torch.Tensor:
    if group_size <= 0:
        return torch.zeros(in_features, dtype=torch.int32, device=device)
    return (torch.arange(in_features, dtype=torch.int32, device=device) // group_size).to(torch.int32)


def _store(q: torch.Tensor, bits: int) -> torch.Tensor:
    return pack_nibbles(q) if bits == 4 else q


def from_gptq(t: dict[str, torch.Tensor], bits: int, group_size: int, v1_zeros: bool) -> dict[str, torch.Tensor]:
    q = unpack_int32(t["qweight"], bits, dim=0).t().contiguous()  # [out, in]
    zeros = unpack_int32(t["qzeros"], bits, dim=1)[:, : q.shape[0]].t().to(torch.int32)
    if v1_zeros:
        zeros = zeros + 1
    scales = t["scales"].float().t().contiguous()
    g_idx = t["g_idx"].to(torch.int32) if "g_idx" in t else default_g_idx(q.shape[1], group_size)
    return dict(qweight=_store(q, bits), zeros=zeros.to(torch.uint8).contiguous(), scales=scales, g_idx=g_idx)


def _awq_unorder(vals: torch.Tensor) -> torch.Tensor:
    """[rows, out] in AWQ's packed order -> natural column order."""
    rows, out = vals.shape
    order = torch.tensor(AWQ_ORDER)
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(8)
    return vals.reshape(rows, out // 8, 8)[:, :, inverse].reshape(rows, out)


def from_awq(t: dict[str, torch.Tensor], group_size: int) -> dict[str, torch.Tensor]:
    q = _awq_unorder(unpack_int32(t["qweight"], 4, dim=1)).t().contiguous()  # [out, in]
    zeros = _awq_unorder(unpack_int32(t["qzeros"], 4, dim=1)).t().contiguous()
    scales = t["scales"].float().t().contiguous()
    return dict(qweight=pack_nibbles(q), zeros=zeros, scales=scales, g_idx=default_g_idx(q.shape[1], group_size))


def from_compressed_tensors(t: dict[str, torch.Tensor], bits: int, group_size: int) -> dict[str, torch.Tensor]:
    out, inp = (int(s) for s in t["weight_shape"].tolist())
    q = unpack_int32(t["weight_packed"], bits, dim=1)[:, :inp].contiguous()  # unsigned already
    scales = t["weight_scale"].float().reshape(out, -1).contiguous()
    offset = 1 << (bits - 1)
    if "weight_zero_point" in t:
        zp = unpack_int32(t["weight_zero_point"], bits, dim=0)[:out].to(torch.int32)
        zeros = zp.reshape(out, -1)  # (already offset: stored as signed + 2**(bits-1))
    else:
        zeros = torch.full_like(scales, offset, dtype=torch.int32)
    g_idx = t["weight_g_idx"].to(torch.int32) if "weight_g_idx" in t else default_g_idx(inp, group_size)
    return dict(qweight=_store(q, bits), zeros=zeros.to(torch.uint8).contiguous(), scales=scales, g_idx=g_idx)


def dequantize(
    qweight: torch.Tensor,
    zeros: torch.Tensor,
    scales: torch.Tensor,
    g_idx: torch.Tensor | None,
    bits: int,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """kiln's layout -> the dense weight [out, in] in `dtype` (computed in float32). g_idx None:
    groups are runs of consecutive columns (no act-order), which skips the per-column gather.
    Stacked experts work the same with a leading dimension: qweight [E, out, ...], zeros and
    scales [E, out, groups], g_idx [E, in] (each expert its own act-order)."""
    q = unpack_nibbles(qweight) if bits == 4 else qweight
    if g_idx is None:
        qg = q.reshape(*scales.shape, -1).float()
        return ((qg - zeros.float()[..., None]) * scales[..., None]).reshape(q.shape).to(dtype)
    idx = g_idx.long().unsqueeze(-2).expand(q.shape)  # each column's group, per row
    w = (q.float() - zeros.float().gather(-1, idx)) * scales.gather(-1, idx)
    return w.to(dtype)
