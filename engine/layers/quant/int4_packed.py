"""int4 weights in torch's packed ("tinygemm") layout, multiplied by torch's int4 kernels.

After a checkpoint's int4 layers are filled in kiln's layout (int_formats.py), `repack_model`
turns each one it can into the layout of
  CPU:  torch.ops.aten._weight_int4pack_mm_for_cpu   (weights from _convert_weight_to_int4pack_for_cpu)
  CUDA: torch.ops.aten._weight_int4pack_mm           (weights from _convert_weight_to_int4pack)
whose weight is W[n, k] = (q[n, k] - 8) * scale[g, n] + zero[g, n], g = k // group, with the
scales and zeros interleaved in one tensor [K / group, N, 2] of the activations' dtype. kiln's
W = (q - z) * s becomes zero = (8 - z) * s (exact in float32: z and 8 are small integers and s a
checkpoint fp16/bf16/fp32 value); GGUF's d * q + m becomes scale d, zero m + 8 d.

What the kernels take, and so what stays on the dequantise-on-the-fly reference path
(IntWeightMethod), each layer for its own reason (`unsupported`):
  - 8-bit weights (torch ships no int8-weight/bf16-activation kernel of this kind);
  - group sizes other than 32, 64, 128, 256 (per-channel weights use the largest of these that
    divides the input width, with the one scale repeated), or an input width the group does not divide;
  - activations other than bf16 (the CUDA kernel takes only bf16; the CPU one takes float32 and
    float16 too but through a scalar path measured ~500x slower than its bf16 one, slower than
    dequantising on the fly: kiln's float32 CPU default keeps the reference path), unless
    int4_kernel is "packed": then a float32/float16 model's int4 layers are packed with bf16
    scales and zeros and each call rounds its activations to bf16 around the kernel and the
    output back (`kernel_dtype`; benchmarks/2026-11-30.md, quantmoe: on a quiet CPU 150-190x faster than the
    reference at batch 1 and 3-8x faster than the dense float32 matmul; the numerics of a bf16
    model's int4 layers);
  - output widths not a multiple of 16 (CPU) or 8 (CUDA); on CUDA input widths not a multiple of
    inner_k_tiles * 16, GPUs before sm_80;
  - act-order (g_idx) whose groups are not `group` columns each: GPTQ's act-order is, so its
    columns are permuted at load (groups made contiguous) and each call gathers x's columns by the
    same permutation (one index_select of the activations).
"""

from __future__ import annotations

import torch
from torch import nn

from engine.layers.quant import int_formats

GROUPS = (32, 64, 128, 256)  # the group sizes both kernels take
INNER_K_TILES = 8  # CUDA tinygemm: input widths a multiple of 128; smaller ones fall back to 4, 2
ROW_CHUNK = 1024  # packing converts this many output rows at a time (a multiple of the CPU layout's 64-row blocks)
BUFFERS = ("int4_packed", "int4_scales_zeros", "int4_perm")


def kernel_dtype(dtype: torch.dtype, int4_kernel: str) -> torch.dtype:
    """The activation dtype a model of `dtype` sends the int4 kernels: its own, or bfloat16 when
    int4_kernel is "packed" (float32/float16 models then round activations to bf16 per call)."""
    return torch.bfloat16 if int4_kernel == "packed" and dtype in (torch.float32, torch.float16) else dtype


def packed_group(in_features: int, group_size: int) -> int | None:
    """The kernel group size for a layer, or None when its grouping cannot be expressed."""
    if group_size <= 0:  # per channel: any group that divides the width repeats the one scale
        return next((g for g in reversed(GROUPS) if in_features % g == 0), None)
    return group_size if group_size in GROUPS and in_features % group_size == 0 else None


def inner_k_tiles(in_features: int) -> int | None:
    return next((t for t in (INNER_K_TILES, 4, 2) if in_features % (t * 16) == 0), None)


def unsupported(
    out_features: int, in_features: int, bits: int, group_size: int, device: torch.device, dtype: torch.dtype
) -> str | None:
    """Why a layer must stay on the reference path (None: it can be packed)."""
    if bits != 4:
        return f"{bits}-bit weights"
    if packed_group(in_features, group_size) is None:
        return f"group size {group_size} with {in_features} input columns (kernels take {GROUPS})"
    if device.type == "cuda":
        if dtype != torch.bfloat16:
            return f"{dtype} activations (the CUDA kernel takes bfloat16)"
        if torch.cuda.get_device_capability(device) < (8, 0):
            return "a GPU before sm_80"
        if out_features % 8:
            return f"{out_features} output rows (CUDA: a multiple of 8)"
        if inner_k_tiles(in_features) is None:
            return f"{in_features} input columns (CUDA: a multiple of 32)"
        return None
    if device.type != "cpu":
        return f"device {device.type}"
    if dtype != torch.bfloat16:  # (measured: float32/float16 take a scalar path ~500x slower than bf16)
        return f"{dtype} activations on the CPU (torch's int4 kernel is vectorised for bfloat16 only)"
    if out_features % 16:
        return f"{out_features} output rows (CPU: a multiple of 16)"
    return None


def act_order_perm(g_idx: torch.Tensor, group: int) -> torch.Tensor | None:
    """The column order that makes act-order groups contiguous runs of `group` columns (None when
    the groups are not that: the layer stays on the reference path)."""
    perm = torch.argsort(g_idx.long(), stable=True)
    if not torch.equal(g_idx.long()[perm], torch.arange(g_idx.numel(), device=g_idx.device) // group):
        return None
    return perm


def scales_and_zeros(
    scales: torch.Tensor, offsets: torch.Tensor, group: int, in_features: int, dtype: torch.dtype
) -> torch.Tensor:
    """W = q * scales + offsets per (row, checkpoint group) -> the kernels' [K / group, N, 2]
    (scale, zero) with zero = offset + 8 * scale; a per-channel scale repeats over the groups."""
    s, b = scales.float(), offsets.float()
    reps = in_features // group // s.shape[1]
    if reps > 1:
        s, b = s.repeat_interleave(reps, dim=1), b.repeat_interleave(reps, dim=1)
    return torch.stack([s, b + 8 * s], dim=-1).transpose(0, 1).to(dtype).contiguous()


def convert(qweight: torch.Tensor, perm: torch.Tensor | None, device: torch.device) -> torch.Tensor:
    """kiln's 4-bit weight (uint8 [N, K / 2], two values a byte), its columns permuted by perm
    when given -> the kernel's packed weight on `device`. Row chunks at a time (the CPU layout is
    made of 64-row blocks), so the temporaries stay a few times one chunk."""
    chunks = []
    for r in range(0, qweight.shape[0], ROW_CHUNK):
        q = int_formats.unpack_nibbles(qweight[r : r + ROW_CHUNK])
        if perm is not None:
            q = q.index_select(1, perm)
        if device.type == "cuda":
            chunks.append(((q[:, 0::2] << 4) | q[:, 1::2]).to(device))  # (tinygemm: even column in the high nibble)
        else:
            chunks.append(torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32), 1))
    packed = chunks[0] if len(chunks) == 1 else torch.cat(chunks)
    if device.type == "cuda":
        return torch.ops.aten._convert_weight_to_int4pack(packed.contiguous(), inner_k_tiles(qweight.shape[1] * 2))
    return packed


class Int4PackedMethod:
    """A linear layer whose int4 weight lives in the packed layout (buffers int4_packed,
    int4_scales_zeros and int4_perm, None unless act-order; int4_group on the module)."""

    bits = 4

    def apply(self, module: nn.Module, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        # (int4_kernel "packed" on a float32/float16 model: the kernel's dtype is bf16, see kernel_dtype)
        x2 = x.reshape(-1, shape[-1]).to(module.int4_scales_zeros.dtype)
        if module.int4_perm is not None:
            x2 = x2.index_select(1, module.int4_perm)
        x2 = x2.contiguous()
        if x.is_cuda:
            y = torch.ops.aten._weight_int4pack_mm(x2, module.int4_packed, module.int4_group, module.int4_scales_zeros)
        else:
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(
                x2, module.int4_packed, module.int4_group, module.int4_scales_zeros
            )
        y = y.to(x.dtype)
        if module.bias is not None:
            y = y + module.bias
        return y.reshape(*shape[:-1], -1)

    @torch.no_grad()
    def weight(self, module: nn.Module, dtype: torch.dtype, chunk: int = 1024) -> torch.Tensor:
        """The dense weight [out, in] (the kernel applied to identity rows, a chunk at a time)."""
        k = module.in_features
        sz = module.int4_scales_zeros
        mm = torch.ops.aten._weight_int4pack_mm if sz.is_cuda else torch.ops.aten._weight_int4pack_mm_for_cpu
        cols = []
        for c in range(0, k, chunk):
            eye = torch.zeros(min(chunk, k - c), k, dtype=sz.dtype, device=sz.device)
            eye[:, c : c + eye.shape[0]].fill_diagonal_(1)
            cols.append(mm(eye, module.int4_packed, module.int4_group, sz).t())
        wp = torch.cat(cols, dim=1)
        if module.int4_perm is None:
            return wp.to(dtype)
        w = torch.empty_like(wp)
        w[:, module.int4_perm] = wp
        return w.to(dtype)

    def weight_bytes(self, module: nn.Module) -> int:
        return sum(b.numel() * b.element_size() for n, b in module.named_buffers(recurse=False) if n in BUFFERS)


PACKED = Int4PackedMethod()


def install(module: nn.Module, packed: torch.Tensor, sz: torch.Tensor, perm: torch.Tensor | None, group: int) -> None:
    """Give a linear layer the packed buffers (and drop kiln's unpacked ones)."""
    for name in ("qweight", "zeros", "scales", "g_idx"):
        module._buffers.pop(name, None)
    module.register_buffer("int4_packed", packed)
    module.register_buffer("int4_scales_zeros", sz)
    module.register_buffer("int4_perm", perm)
    module.int4_group = group
    module.quant = PACKED


@torch.no_grad()
def repack(module: nn.Module, dtype: torch.dtype) -> str | None:
    """One int4 layer in kiln's layout -> packed in place. Returns why not (it stays as it is)."""
    out, inp = module.out_features, module.in_features
    method = module.quant
    device = module.qweight.device
    reason = unsupported(out, inp, method.bits, method.group_size, device, dtype)
    if reason:
        return reason
    group = packed_group(inp, method.group_size)
    perm = None
    if module.act_order:  # (permuted column j is in group j // group: the groups keep their order)
        perm = act_order_perm(module.g_idx, group)
        if perm is None:
            return "act-order groups that are not runs of one group size"
    offsets = -module.zeros.float() * module.scales.float()
    sz = scales_and_zeros(module.scales, offsets, group, inp, dtype)
    install(module, convert(module.qweight, perm, device), sz, perm, group)
    return None
