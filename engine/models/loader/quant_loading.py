"""Build quantised linear layers and fill them from a checkpoint, one HF module at a time.

The model is built on the meta device; `prepare` swaps the dense weight of every quantised
linear layer for its method's buffers before anything is allocated, so loading never holds the
full-precision model (peak: the quantised model plus one module's checkpoint tensors). With
--quantization fp8 each full-precision weight is quantised as it is read (`quantize_rows_into`).
"""

from __future__ import annotations

import logging
from contextlib import contextmanager
from typing import Callable

import torch
from torch import nn

from engine.layers.quant import cpu_packed, int4_packed, int_formats
from engine.layers.quant import moe as quant_moe
from engine.layers.quant.config import QuantConfig
from engine.layers.quant.linear import FP8, IntWeightMethod, attach, make_method, quantize_fp8_rows

logger = logging.getLogger(__name__)

# The checkpoint tensors of one quantised HF module, by layout.
SUFFIXES = {
    "gptq": ("qweight", "qzeros", "scales", "g_idx"),
    "awq": ("qweight", "qzeros", "scales"),
    "ct-int": ("weight_packed", "weight_scale", "weight_zero_point", "weight_shape", "weight_g_idx"),
    "fp8": ("weight", "weight_scale", "input_scale"),
}
QUANT_BUFFERS = (
    "qweight",
    "zeros",
    "scales",
    "g_idx",
    "weight_fp8",
    "weight_scale",
    "input_scale",
    *int4_packed.BUFFERS,
    *cpu_packed.BUFFERS,
)


def suffixes(config: QuantConfig) -> tuple[str, ...]:
    if config.kind == "fp8":
        return SUFFIXES["fp8"]
    return SUFFIXES["ct-int" if config.layout == "ct" else config.layout]


def prepare(
    model: nn.Module,
    config: QuantConfig,
    dtype: torch.dtype | None = None,
    int4_kernel: str = "auto",
    activations: str = "auto",
) -> None:
    """On the meta-built model: quantised layers get their buffers instead of a dense weight.
    int4_kernel "auto": int4 and int8 layers on the CPU move to the weight-streaming kernels'
    layout (engine/layers/quant/cpu_packed.py) as soon as each is loaded; elsewhere (dtype given,
    "auto" or "packed") int4 layers move to torch's packed int4 layout the same way (so the
    unpacked and packed forms never coexist for the whole model)."""
    if not config.quantize_at_load:  # (--quantization fp8 quantises loaded experts: quantize_loaded_experts)
        quant_moe.prepare(model.moe_layers(), config)  # MoE layers: their experts stay quantised too
    method = make_method(config)
    if isinstance(method, IntWeightMethod):
        method.cpu_kernels = int4_kernel == "auto"
        method.cpu_float_acts = cpu_packed.float_acts_for(dtype, activations)
    if isinstance(method, IntWeightMethod) and method.bits == 4 and int4_kernel in ("auto", "packed"):
        method.repack_dtype = dtype if dtype is None else int4_packed.kernel_dtype(dtype, int4_kernel)
    linears = model.quantizable_linears()
    dense = quant_moe.ignored_linears(linears, config)  # e.g. a shared expert the ignore list names
    for name, module in linears.items():
        if name not in dense:
            attach(module, method, "meta")


def cast_except_quantized(model: nn.Module, dtype: torch.dtype) -> None:
    """model.to(dtype) for everything but the quantised buffers (fp8 and float32 scales keep theirs)."""
    for module in model.modules():
        quantized = getattr(module, "quant", None) is not None
        for name, p in module._parameters.items():
            if p is not None and p.is_floating_point():
                p.data = p.data.to(dtype)
        for name, b in module._buffers.items():
            if b is not None and b.is_floating_point() and not (quantized and name in QUANT_BUFFERS):
                module._buffers[name] = b.to(dtype)


def _int_canonical(config: QuantConfig, t: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    if config.layout == "gptq":
        return int_formats.from_gptq(t, config.bits, config.group_size, config.gptq_v1_zeros)
    if config.layout == "awq":
        return int_formats.from_awq(t, config.group_size)
    return int_formats.from_compressed_tensors(t, config.bits, config.group_size)


def _fp8_canonical(t: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    w = t["weight"]
    if w.dtype != FP8:
        raise ValueError(f"quantization: fp8 checkpoint weight has dtype {w.dtype}, expected float8_e4m3fn")
    scale = t["weight_scale"].float().reshape(-1)
    out = dict(weight_fp8=w, weight_scale=scale.expand(w.shape[0]) if scale.numel() == 1 else scale)
    if "input_scale" in t:
        out["input_scale"] = t["input_scale"].float().reshape(())
    return out


@torch.no_grad()
def fill_module(
    module: nn.Module,
    rows: slice | None,
    config: QuantConfig,
    tensors: dict[str, torch.Tensor],
    hf_name: str,
    seen: dict,
) -> None:
    """Convert one HF module's checkpoint tensors to kiln's layout and copy them into its rows of
    the (possibly fused) kiln module. seen counts the rows each kiln module received (and notes
    which already hold a g_idx)."""
    canon = _fp8_canonical(tensors) if config.kind == "fp8" else _int_canonical(config, tensors)
    for key, value in canon.items():
        if key == "g_idx":  # one per input column: fused projections must agree
            if (id(module), key) in seen and not torch.equal(module.g_idx, value.to(module.g_idx.device)):
                raise ValueError(
                    f"quantization: {hf_name} has a g_idx unlike the other projections fused "
                    "with it (act-order permutations of q/k/v or gate/up must match)"
                )
            module.g_idx.copy_(value)
            seen[(id(module), key)] = 1
            default = int_formats.default_g_idx(module.in_features, module.quant.group_size, value.device)
            module.act_order = module.act_order or not torch.equal(value.to(default.device), default)
        elif key == "input_scale":  # one per fused module: the largest, as vLLM does
            module.input_scale.copy_(torch.maximum(module.input_scale, value) if rows and rows.start else value)
        else:
            dest = getattr(module, key)
            dest = dest if rows is None else dest[rows]
            if tuple(dest.shape) != tuple(value.shape):
                raise ValueError(
                    f"quantization: {hf_name} gives {key} of shape {tuple(value.shape)}, expected {tuple(dest.shape)}"
                )
            dest.copy_(value.to(dest.dtype))
    part = canon["weight_fp8" if config.kind == "fp8" else "qweight"].shape[0]
    seen[id(module)] = seen.get(id(module), 0) + part


def load_quantized(
    model: nn.Module,
    config: QuantConfig,
    names: list[str],
    read: Callable[[str], torch.Tensor],
    target: Callable[[str], tuple[str, tuple] | None],
    on_tensor: Callable[[torch.Tensor], None] | None = None,
) -> set[str]:
    """Fill every quantised layer from the checkpoint; names: its tensors, read(name) one of them.
    Returns the tensor names consumed (the rest load as usual). on_tensor sees each tensor read
    (progress)."""
    linears = {n: m for n, m in model.quantizable_linears().items() if m.quant is not None}  # (not ignored ones)
    wanted = suffixes(config)
    groups: dict[str, dict[str, str]] = {}
    for name in names:
        prefix, _, suffix = name.rpartition(".")
        if suffix in wanted:
            groups.setdefault(prefix, {})[suffix] = name
    consumed: set[str] = set()
    seen: dict = {}
    left: dict[str, list[str]] = {}
    for prefix, names in groups.items():
        hit = target(prefix + ".weight")
        if hit is None:
            continue
        kiln_name, idx = hit
        module = linears.get(kiln_name.removesuffix(".weight")) or quant_moe.experts_named(model, kiln_name)
        if module is None:  # e.g. an unquantised lm_head stored as "weight": loads as usual
            continue
        tensors = {}
        for suffix, name in names.items():
            tensors[suffix] = read(name)
            if on_tensor is not None:
                on_tensor(tensors[suffix])
        if isinstance(module, quant_moe.QuantExperts):  # one expert's projection (engine/layers/quant/moe.py)
            module.fill(
                idx, _fp8_canonical(tensors) if config.kind == "fp8" else _int_canonical(config, tensors), prefix
            )
            consumed.update(names.values())
            continue
        fill_module(module, idx[0] if idx else None, config, tensors, prefix, seen)
        del tensors
        consumed.update(names.values())
        if seen[id(module)] == module.out_features and _repackable(module):
            _repack(module, kiln_name.removesuffix(".weight"), left)
        elif _on_cpu(module):
            _return_freed_memory()  # (this module's checkpoint tensors and conversion temporaries)
    missing = [n for n, m in linears.items() if seen.get(id(m), 0) != m.out_features] + quant_moe.unfilled(model)
    if missing:
        raise ValueError(
            f"quantization: the checkpoint lacks quantised weights for {missing[:4]}"
            f"{' ...' if len(missing) > 4 else ''} ({config.name})"
        )
    _log_left(left)
    return consumed


def quantized_at_load(model: nn.Module) -> dict[str, nn.Module]:
    """The layers --quantization fp8 quantises from the full-precision checkpoint's weights."""
    return {
        n: m for n, m in model.quantizable_linears().items() if getattr(getattr(m, "quant", None), "at_load", False)
    }


FP8_ROW_CHUNK = 1024  # rows quantised at a time: the float32 temporaries stay a few times a chunk


@torch.no_grad()
def quantize_rows_into(
    module: nn.Module, rows: slice | None, w: torch.Tensor, hf_name: str, dtype: torch.dtype | None = None
) -> None:
    """--quantization fp8: one checkpoint weight (all the layer's rows, or its `rows` of a fused
    layer) -> e4m3 rows with a scale per row, written into the layer. dtype: the model's, which
    the weight is rounded to first (as if loaded dense and then quantised)."""
    q_dest = module.weight_fp8 if rows is None else module.weight_fp8[rows]
    s_dest = module.weight_scale if rows is None else module.weight_scale[rows]
    if tuple(w.shape) != tuple(q_dest.shape):
        raise ValueError(f"model: {hf_name} has shape {tuple(w.shape)}, expected {tuple(q_dest.shape)}")
    for r in range(0, w.shape[0], FP8_ROW_CHUNK):
        part = w[r : r + FP8_ROW_CHUNK].to(q_dest.device)
        q, scale = quantize_fp8_rows(part if dtype is None else part.to(dtype))
        q_dest[r : r + FP8_ROW_CHUNK].copy_(q)
        s_dest[r : r + FP8_ROW_CHUNK].copy_(scale)
    if _on_cpu(module):
        _return_freed_memory()


@torch.no_grad()
def init_dummy(model: nn.Module, seed: int) -> None:
    """Random weights (about N(0, 0.02) once dequantised) for quantised layers with load_format=dummy."""
    gen = torch.Generator(device=next(model.buffers()).device).manual_seed(seed + 1)
    left: dict[str, list[str]] = {}
    for name, module in model.quantizable_linears().items():
        if getattr(module, "quant", None) is None:
            continue
        if hasattr(module, "qweight"):
            module.qweight.random_(0, 256, generator=gen)
            module.zeros.fill_(1 << (module.quant.bits - 1))
            module.scales.fill_(0.02 / (1 << (module.quant.bits - 2)))
            module.g_idx.copy_(int_formats.default_g_idx(module.in_features, module.quant.group_size))
            if _repackable(module):  # (one layer unpacked at a time)
                _repack(module, name, left)
        elif module.quant.at_load:  # N(0, 0.02) dense weights, as without quantisation, quantised
            for r in range(0, module.out_features, FP8_ROW_CHUNK):
                rows = min(FP8_ROW_CHUNK, module.out_features - r)
                w = torch.empty(rows, module.in_features, device=gen.device).normal_(0.0, 0.02, generator=gen)
                quantize_rows_into(module, slice(r, r + rows), w, "(dummy)")
        else:
            module.weight_fp8.copy_(torch.randn(module.weight_fp8.shape, generator=gen).clamp(-8, 8).to(FP8))
            module.weight_scale.fill_(0.02)
            if hasattr(module, "input_scale"):
                module.input_scale.fill_(0.05)
    quant_moe.init_dummy(model.moe_layers(), seed)
    _log_left(left)


def _on_cpu(module: nn.Module) -> bool:
    return next(module.buffers()).device.type == "cpu"


def _cpu_kernels(module: nn.Module) -> bool:
    return module.quant.cpu_kernels and cpu_packed.usable(module.qweight.device)


def _repackable(module: nn.Module) -> bool:
    """Whether a loaded int layer in kiln's layout moves to a kernel's layout (CPU kernels, or
    torch's packed int4)."""
    return (
        isinstance(getattr(module, "quant", None), IntWeightMethod)
        and not getattr(module, "kept_reference", False)
        and (module.quant.repack_dtype is not None or _cpu_kernels(module))
    )


def _repack(module: nn.Module, name: str, left: dict[str, list[str]]) -> None:
    """One int layer, all loaded -> the CPU kernels' layout (on the CPU), else torch's packed int4
    layout; a layer neither takes stays on dequantise-on-the-fly (its reason collected in left)."""
    method = module.quant
    reason = cpu_packed.pack_int(module, method.cpu_float_acts) if _cpu_kernels(module) else "not on the CPU kernels"
    if reason is not None and method.repack_dtype is not None:
        reason = int4_packed.repack(module, method.repack_dtype)
        if reason:
            method.repack_dtype = None  # (stays on the reference path: not tried again)
    if reason:
        module.kept_reference = True  # (not tried again)
        left.setdefault(reason, []).append(name)
    elif _on_cpu(module):
        _return_freed_memory()


def _glibc():
    """glibc through ctypes (None where the C library is another one)."""
    global _LIBC
    if _LIBC is None:
        import ctypes

        try:
            _LIBC = ctypes.CDLL("libc.so.6")
            _LIBC.malloc_trim, _LIBC.mallopt
        except (OSError, AttributeError):
            _LIBC = False
    return _LIBC or None


def _return_freed_memory() -> None:
    """Hand the heap memory freed by a layer's temporaries back to the OS (glibc keeps freed
    blocks under its dynamic mmap threshold, up to 32 MB each, for reuse; without this the
    resident size of a CPU load grows by the unpacked model). A no-op where libc has no malloc_trim."""
    if _glibc():
        _LIBC.malloc_trim(0)


M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # mallopt parameters (malloc.h)
LOAD_MMAP_THRESHOLD = 256 * 1024
GLIBC_MMAP_THRESHOLD_MAX = 32 * 1024 * 1024  # where glibc's dynamic threshold stops growing (64-bit)


@contextmanager
def heap_returned_while_loading():
    """While a model loads, every allocation over 256 KB gets its own mapping, which goes back to
    the OS when freed. Without this, glibc's dynamic threshold rises to the size of the first
    large tensor freed and the later temporaries (checkpoint tensors, unpacking, repacking) come
    from its heap, where freed blocks stay resident and fragment: the peak of an int4 load varied
    between 1.27x and 1.60x the quantised model from run to run, against 1.18x with this
    (benchmarks/2026-11-30.md, quantload). Afterwards the threshold is left where glibc's own dynamic rule ends up
    once tensors of 32 MB or more were freed (its maximum), and the trim threshold at twice it,
    as glibc sets them (fixing the threshold turns the dynamic rule off for the process)."""
    libc = _glibc()
    if libc:
        libc.mallopt(M_MMAP_THRESHOLD, LOAD_MMAP_THRESHOLD)
    try:
        yield
    finally:
        if libc:
            libc.mallopt(M_MMAP_THRESHOLD, GLIBC_MMAP_THRESHOLD_MAX)
            libc.mallopt(M_TRIM_THRESHOLD, 2 * GLIBC_MMAP_THRESHOLD_MAX)
            libc.malloc_trim(0)


_LIBC = None  # ctypes handle of glibc once looked up (False: none)


def _log_left(left: dict[str, list[str]]) -> None:
    for reason, names in left.items():
        logger.info("int: %d layers stay on the dequantise-on-the-fly path (%s), e.g. %s", len(names), reason, names[0])


def finish(model: nn.Module, dtype: torch.dtype, int4_kernel: str = "auto") -> dict[str, list[str]]:
    """After the weights are in: int layers not moved while loading (dummy weights, or prepare()
    without a dtype) move to the CPU kernels (on the CPU, int4_kernel "auto") or torch's packed
    int4 kernels (int4_packed.py) unless int4_kernel is "reference"; each one that cannot stays
    on dequantise-on-the-fly. Returns {reason: [layer names]} for those (logged)."""
    left: dict[str, list[str]] = {}
    if int4_kernel == "reference":
        return left
    quant_moe.repack(model, int4_packed.kernel_dtype(dtype, int4_kernel), left)  # int4 MoE experts (CPU)
    for name, module in model.quantizable_linears().items():
        if _repackable(module):
            _repack(module, name, left)
    _log_left(left)
    return left
