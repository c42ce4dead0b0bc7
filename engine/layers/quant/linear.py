"""Quantised linear layers: the weights stay quantised in memory (kiln's layouts, see
int_formats.py and below) and a linear layer's forward goes through its method's `apply`.

Methods hold no tensors: the module owns its buffers, so `model.to()`, state inspection and CUDA
graph capture see ordinary module state. Every path is plain torch ops (capturable):
  IntWeightMethod  packed int4/int8 weights with group scales/zeros (GPTQ, AWQ,
                   compressed-tensors): dequantise on the fly, then one matmul in x's dtype.
  Fp8Method        float8 e4m3 weights [out, in] with a float32 scale per output row; activations
                   unquantised (weight-only), or quantised to e4m3 per tensor with a static scale
                   or per token at run time. On a GPU with fp8 support: torch._scaled_mm with
                   row-wise scales; elsewhere the same arithmetic emulated (quantise, dequantise,
                   matmul).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.layers.quant import int_formats
from engine.layers.quant.config import QuantConfig

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max


class IntWeightMethod:
    def __init__(self, config: QuantConfig) -> None:
        self.bits = config.bits
        self.group_size = config.group_size
        self.repack_dtype: torch.dtype | None = None  # set: each layer moves to int4_packed.py once loaded
        self.cpu_kernels = False  # set: on the CPU each layer moves to cpu_packed.py once loaded (first)
        self.cpu_float_acts = True  # there: the float path (cpu_packed.float_acts_for the model's dtype)

    def num_groups(self, in_features: int) -> int:
        return 1 if self.group_size <= 0 else -(-in_features // self.group_size)

    def create(self, module: nn.Module, device) -> None:
        out, inp = module.out_features, module.in_features
        cols = inp // 2 if self.bits == 4 else inp
        groups = self.num_groups(inp)
        module.register_buffer("qweight", torch.zeros(out, cols, dtype=torch.uint8, device=device))
        module.register_buffer("zeros", torch.zeros(out, groups, dtype=torch.uint8, device=device))
        module.register_buffer("scales", torch.zeros(out, groups, dtype=torch.float32, device=device))
        module.register_buffer("g_idx", int_formats.default_g_idx(inp, self.group_size, device))
        # True when groups are not runs of consecutive columns (GPTQ act-order g_idx, or a ragged last group)
        module.act_order = self.group_size > 0 and inp % self.group_size != 0

    def weight(self, module: nn.Module, dtype: torch.dtype) -> torch.Tensor:
        g_idx = module.g_idx if module.act_order else None
        return int_formats.dequantize(module.qweight, module.zeros, module.scales, g_idx, self.bits, dtype)

    def apply(self, module: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight(module, x.dtype), module.bias)

    def weight_bytes(self, module: nn.Module) -> int:
        return sum(b.numel() * b.element_size() for b in (module.qweight, module.zeros, module.scales, module.g_idx))


def quantize_fp8_rows(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A full-precision weight [out, in] -> (e4m3 weight, float32 scale per row): amax / 448."""
    scale = (w.abs().amax(dim=1).float() / FP8_MAX).clamp(min=1e-12)
    q = (w.float() / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q, scale


def quantize_fp8_acts(x: torch.Tensor, scale: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Activations [T, in] -> (e4m3, float32 scale [T, 1]): the static scale, or per token."""
    if scale is None:
        scale = (x.abs().amax(dim=-1, keepdim=True).float() / FP8_MAX).clamp(min=1e-12)
    else:
        scale = scale.reshape(1, 1).expand(x.shape[0], 1).contiguous()  # (_scaled_mm wants [T, 1] rows)
    q = (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q, scale


class Fp8Method:
    def __init__(self, config: QuantConfig) -> None:
        self.activations = config.activations  # None | "static" | "dynamic"
        self.at_load = config.quantize_at_load  # weights quantised from a full-precision checkpoint as read

    def create(self, module: nn.Module, device) -> None:
        out, inp = module.out_features, module.in_features
        module.register_buffer("weight_fp8", torch.zeros(out, inp, dtype=FP8, device=device))
        module.register_buffer("weight_scale", torch.ones(out, dtype=torch.float32, device=device))
        if self.activations == "static":
            module.register_buffer("input_scale", torch.ones((), dtype=torch.float32, device=device))

    def weight(self, module: nn.Module, dtype: torch.dtype) -> torch.Tensor:
        return (module.weight_fp8.float() * module.weight_scale[:, None]).to(dtype)

    def apply(self, module: nn.Module, x: torch.Tensor) -> torch.Tensor:
        if self.activations is None:
            return F.linear(x, self.weight(module, x.dtype), module.bias)
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        xq, xs = quantize_fp8_acts(x2, module.input_scale if self.activations == "static" else None)
        if x.is_cuda and torch.cuda.get_device_capability(x.device) >= (8, 9):  # (untested here: no GPU)
            y = torch._scaled_mm(
                xq,
                module.weight_fp8.t(),
                scale_a=xs,
                scale_b=module.weight_scale[None, :],
                out_dtype=x.dtype,
                bias=module.bias,
            )
        else:
            xd = (xq.float() * xs).to(x.dtype)
            y = F.linear(xd, self.weight(module, x.dtype), module.bias)
        return y.reshape(*shape[:-1], -1)

    def weight_bytes(self, module: nn.Module) -> int:
        return module.weight_fp8.numel() + module.weight_scale.numel() * 4


def make_method(config: QuantConfig):
    return Fp8Method(config) if config.kind == "fp8" else IntWeightMethod(config)


def attach(module: nn.Module, method, device) -> None:
    """Make a (meta-built) linear layer quantised: drop its dense weight, give it the method's buffers."""
    del module.weight
    module.register_parameter("weight", None)
    method.create(module, device)
    module.quant = method
