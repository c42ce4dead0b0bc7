"""int4 linear layers on kiln's own W4A16 GEMM (templates/w4a16_gemm.cu.j2, launched by
compiler/kernels/w4a16_gemm.py: W4A16Gemm, called through the kiln::w4a16_gemm op).

Which int4 kernel runs (setting `int4_kernel`), decided once per engine by `choose_int4_kernel`:
  auto       CUDA sm_90 with the w4a16_gemm cubin built -> kiln; otherwise tinygemm (on the CPU
             that is torch's CPU int4 kernel, as before)
  kiln       kiln's kernel; an error where it cannot run (no sm_90, cubin not built)
  tinygemm   torch's _weight_int4pack_mm (engine/layers/quant/int4_packed.py)
  reference  dequantise on the fly (engine/layers/quant/linear.py: IntWeightMethod)
  packed     tinygemm for float32/float16 models too, activations rounded to bf16 around it
             (int4_packed.kernel_dtype)
With kiln, the model loads in kiln's unpacked int4 layout (the loader does not repack it for
tinygemm) and `install` then moves each layer into the kernel's layout, one layer at a time (the
unpacked and packed forms of the whole model never coexist). A layer the kernel cannot take
(group 32, a ragged last group, output rows not a multiple of 16, non-bf16 activations) goes to
tinygemm, else stays on the reference path; each reason is logged once with its layers.

Act-order (GPTQ desc_act): the weight's columns are permuted at load so that each group is a run
of `group` columns (int4_packed.act_order_perm), and each call gathers x's columns the same way.
Per-channel scales are repeated over groups of 128 (or 64) columns: the kernel's groups.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from torch import nn

from compiler.kernels.loader import missing_variants
from compiler.kernels.w4a16_gemm import W4A16_VARIANT, W4A16Gemm, pack_w4a16, unpack_w4a16, w4a16_unsupported
from engine.layers.quant import int4_packed, int_formats
from engine.layers.quant.linear import IntWeightMethod

logger = logging.getLogger(__name__)

KERNELS = ("auto", "kiln", "tinygemm", "reference", "packed")
BUFFERS = ("w4a16_packed", "w4a16_scales", "w4a16_zeros", "w4a16_perm")
ROW_CHUNK = 2048  # rows packed at a time (a multiple of 16): bounds the temporaries of a load


def choose_int4_kernel(setting: str, device_type: str, capability: tuple[int, int] | None, cubin_built: bool) -> str:
    """The int4 kernel for `setting` on a device of this type and compute capability, with the
    w4a16_gemm cubin built or not: "kiln", "tinygemm", "reference" or "packed"."""
    if setting not in KERNELS:
        raise ValueError(f"int4_kernel: {setting!r} is not one of {KERNELS}")
    if setting in ("tinygemm", "reference", "packed"):
        return setting
    reason = None
    if device_type != "cuda":
        reason = f"the device is {device_type}, not CUDA"
    elif capability != (9, 0):
        reason = f"the GPU is sm_{capability[0]}{capability[1]} and kiln's cubins are sm_90a"
    elif not cubin_built:
        reason = f"the {W4A16_VARIANT} cubin is not built (kiln build-kernels --variants {W4A16_VARIANT})"
    if setting == "kiln":
        if reason is not None:
            raise ValueError(f"int4_kernel=kiln: {reason}; use int4_kernel=auto or tinygemm")
        return "kiln"
    return "kiln" if reason is None else "tinygemm"


def resolve_int4_kernel(setting: str, device: torch.device, kernel_cache_dir: Path) -> str:
    """choose_int4_kernel for this process's device and kernel cache."""
    cuda = device.type == "cuda"
    capability = torch.cuda.get_device_capability(device) if cuda else None
    built = cuda and setting in ("auto", "kiln") and not missing_variants(kernel_cache_dir, [W4A16_VARIANT])
    return choose_int4_kernel(setting, device.type, capability, built)


def loader_int4_kernel(kernel: str) -> str:
    """The int4_kernel value the model loader takes for a chosen kernel ("auto" there repacks every
    int4 layer for tinygemm while loading; "kiln" leaves them for `install`)."""
    return "auto" if kernel == "tinygemm" else kernel


class KilnInt4Method:
    """A linear layer whose int4 weight lives in the w4a16_gemm kernel's layout (buffers
    w4a16_packed, w4a16_scales, w4a16_zeros; w4a16_perm None unless act-order). Holds the loaded
    kernel (no tensors); the layer's forward calls it through the kiln::w4a16_gemm op."""

    bits = 4

    def __init__(self, gemm: W4A16Gemm) -> None:
        self.gemm = gemm
        self.handle = gemm.handle

    def apply(self, module: nn.Module, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        if module.w4a16_perm is not None:
            x2 = x2.index_select(1, module.w4a16_perm)
        y = torch.ops.kiln.w4a16_gemm(x2, module.w4a16_packed, module.w4a16_scales, module.w4a16_zeros, self.handle)
        if module.bias is not None:
            y = y + module.bias
        return y.reshape(*shape[:-1], -1)

    @torch.no_grad()
    def weight(self, module: nn.Module, dtype: torch.dtype) -> torch.Tensor:
        """The dense weight [out, in] in the checkpoint's column order."""
        w = unpack_w4a16(module.w4a16_packed, module.w4a16_scales, module.w4a16_zeros)
        if module.w4a16_perm is not None:
            dense = torch.empty_like(w)
            dense[:, module.w4a16_perm] = w
            w = dense
        return w.to(dtype)

    def weight_bytes(self, module: nn.Module) -> int:
        return sum(b.numel() * b.element_size() for n, b in module.named_buffers(recurse=False) if n in BUFFERS)


def kernel_group(in_features: int, group_size: int) -> int:
    """The kernel's group for a layer: the checkpoint's, or for per-channel scales 128 (64) columns."""
    if group_size > 0:
        return group_size
    return next((g for g in (128, 64) if in_features % g == 0), 0)


def unsupported(module: nn.Module, dtype: torch.dtype) -> str | None:
    """Why a layer in kiln's unpacked int4 layout cannot take the kernel (None: it can)."""
    if dtype != torch.bfloat16:
        return f"{dtype} activations (the kernel takes bfloat16)"
    group = kernel_group(module.in_features, module.quant.group_size)
    reason = w4a16_unsupported(module.out_features, module.in_features, group)
    if reason is None and module.act_order and int4_packed.act_order_perm(module.g_idx, group) is None:
        reason = "act-order groups that are not runs of one group size"
    return reason


@torch.no_grad()
def pack_layer(module: nn.Module) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """A layer's unpacked int4 buffers -> (packed, scales, zeros, perm) in the kernel's layout."""
    inp = module.in_features
    group = kernel_group(inp, module.quant.group_size)
    scales, zeros = module.scales, module.zeros
    if scales.shape[1] == 1 and inp // group > 1:  # per channel: the one scale over every kernel group
        scales, zeros = scales.expand(-1, inp // group), zeros.expand(-1, inp // group)
    perm = int4_packed.act_order_perm(module.g_idx, group) if module.act_order else None
    parts = []
    for r in range(0, module.out_features, ROW_CHUNK):
        q = module.qweight[r : r + ROW_CHUNK]
        if perm is not None:
            q = int_formats.pack_nibbles(int_formats.unpack_nibbles(q).index_select(1, perm))
        parts.append(
            pack_w4a16(q, zeros[r : r + ROW_CHUNK].contiguous(), scales[r : r + ROW_CHUNK].contiguous(), group)
        )
    packed = torch.cat([p[0] for p in parts])
    scales_t = torch.cat([p[1] for p in parts], dim=1).contiguous()
    zeros_t = torch.cat([p[2] for p in parts], dim=1).contiguous()
    return packed, scales_t, zeros_t, perm


def repack(module: nn.Module, gemm: W4A16Gemm, dtype: torch.dtype) -> str | None:
    """One int4 layer in kiln's unpacked layout -> the kernel's layout in place. Returns why not."""
    reason = unsupported(module, dtype)
    if reason is not None:
        return reason
    packed, scales, zeros, perm = pack_layer(module)
    for name in ("qweight", "zeros", "scales", "g_idx"):
        module._buffers.pop(name, None)
    module.register_buffer("w4a16_packed", packed)
    module.register_buffer("w4a16_scales", scales)
    module.register_buffer("w4a16_zeros", zeros)
    module.register_buffer("w4a16_perm", perm)
    module.quant = KilnInt4Method(gemm)
    return None


def install(
    model: nn.Module, kernel_cache_dir: Path, device: torch.device, dtype: torch.dtype, load_gemm=W4A16Gemm
) -> dict[str, list[str]]:
    """After loading with int4_kernel "kiln" (the model on its CUDA device): every int4 layer to the
    kiln kernel (loaded once, by `load_gemm(kernel_cache_dir, device)`), or (when it cannot take the
    layer) to tinygemm, or else left dequantising on the fly. Returns {reason: [layers]} of the
    layers not on the kiln kernel (logged)."""
    layers = [
        (n, m)
        for n, m in model.quantizable_linears().items()
        if isinstance(getattr(m, "quant", None), IntWeightMethod) and m.quant.bits == 4 and hasattr(m, "qweight")
    ]
    left: dict[str, list[str]] = {}
    if not layers:
        return left
    gemm = load_gemm(kernel_cache_dir, device)
    done = 0
    for name, module in layers:
        reason = repack(module, gemm, dtype)
        if reason is None:
            done += 1
            continue
        fallback = int4_packed.repack(module, dtype)
        left.setdefault(f"{reason}: " + ("tinygemm" if fallback is None else f"dequantised ({fallback})"), []).append(
            name
        )
    logger.info("int4: %d of %d layers on kiln's w4a16 GEMM", done, len(layers))
    for reason, names in left.items():
        logger.info("int4: %d layers not on kiln's kernel (%s), e.g. %s", len(names), reason, names[0])
    return left
