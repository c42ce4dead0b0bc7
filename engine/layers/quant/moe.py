"""Quantised experts of mixture-of-experts layers (Mixtral, Qwen2-MoE, Qwen3-MoE).

A quantised checkpoint quantises each expert's gate/up/down projection like any linear layer
(GPTQ, AWQ, compressed-tensors pack-quantized or FP8, or `--quantization fp8` at load). kiln keeps
them quantised, stacked per layer: SparseMoE's w13 [E, 2I, H] and w2 [E, H, I] become
`QuantExperts` modules holding the buffers of engine/layers/quant/linear.py's layouts with a leading
expert dimension:
  int   qweight uint8 [E, out, in / 2 (4 bits) | in], zeros uint8 and scales float32
        [E, out, groups], g_idx int32 [E, in] (GPTQ act-order: each expert its own permutation,
        shared by its gate and up projections);
  fp8   weight_fp8 e4m3 [E, out, in], weight_scale float32 [E, out] (a per-tensor checkpoint
        scale repeated over the rows).
The router and Qwen2-MoE's shared-expert gate stay in full precision (every format leaves them
so; kiln never quantises them); the shared expert is an ordinary MLP whose projections are
quantised as the dense layers are.

The forward (`routed_experts`) dequantises on the fly and never loops in Python over experts:
  - fewer (token, expert) pairs than experts (decode): only the chosen experts' weights are
    dequantised, one copy per pair, and compiler/kernels/moe.py's `moe_experts_pairs` runs them as
    batched matrix-vector products;
  - otherwise (prefill, large batches): every expert is dequantised once into the activations'
    dtype (a transient of one layer's experts) and kiln::moe_experts runs as for a dense model.
  - int4 experts on the CPU whose model dtype torch's packed int4 kernel takes (bf16, or any with
    int4_kernel="packed"; the rules of engine/layers/quant/int4_packed.py) are repacked after loading
    into that kernel's layout, one packed weight per expert, and kiln::moe_experts_int4 runs each
    chosen expert's tokens through the kernel (compiler/kernels/moe.py): no dequantisation at all.
Experts of an FP8 W8A8 checkpoint run weight-only (activations not quantised, as vLLM's Marlin
fallback runs them on GPUs without fp8): their input_scale tensors are read and not used.
"""

from __future__ import annotations

import re

import torch
from torch import nn

import compiler.kernels.ops  # noqa: F401 - registers kiln::moe_experts
from compiler.kernels.moe import moe_experts_pairs
from engine.layers.quant import int4_packed, int_formats
from engine.layers.quant.config import QuantConfig
from engine.layers.quant.linear import FP8, Fp8Method, IntWeightMethod, make_method, quantize_fp8_rows


class QuantExperts(nn.Module):
    """One stacked expert weight of a SparseMoE (w13 or w2), kept quantised."""

    def __init__(self, num_experts: int, out_features: int, in_features: int, method, device) -> None:
        super().__init__()
        self.num_experts, self.out_features, self.in_features = num_experts, out_features, in_features
        self.quant = method
        e, out, inp = num_experts, out_features, in_features
        if isinstance(method, Fp8Method):
            self.register_buffer("weight_fp8", torch.zeros(e, out, inp, dtype=FP8, device=device))
            self.register_buffer("weight_scale", torch.ones(e, out, dtype=torch.float32, device=device))
            self.act_order = False
        else:
            cols = inp // 2 if method.bits == 4 else inp
            groups = method.num_groups(inp)
            self.register_buffer("qweight", torch.zeros(e, out, cols, dtype=torch.uint8, device=device))
            self.register_buffer("zeros", torch.zeros(e, out, groups, dtype=torch.uint8, device=device))
            self.register_buffer("scales", torch.zeros(e, out, groups, dtype=torch.float32, device=device))
            g_idx = int_formats.default_g_idx(inp, method.group_size, device)
            self.register_buffer("g_idx", g_idx.expand(e, inp).contiguous())
            # (a ragged last group is not a run of group_size columns: the per-column gather)
            self.act_order = method.group_size > 0 and inp % method.group_size != 0
        self.rows_seen: dict[int, int] = {}  # expert -> rows filled (loading)
        self.int4_group = 0  # set once repacked for torch's int4 kernel (buffers int4_packed, ...)

    @property
    def shape(self) -> tuple[int, int, int]:
        """The dense stacked weight's shape (the loader reads it to place an expert's gate/up rows)."""
        return self.num_experts, self.out_features, self.in_features

    def weight(self, experts: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
        """The dense weights [n, out, in] of the experts at indices `experts` (repeats allowed),
        or [E, out, in] of all of them (None)."""

        def pick(b: torch.Tensor) -> torch.Tensor:
            return b if experts is None else b.index_select(0, experts)

        if self.int4_group:  # packed: each expert's weight back out of the kernel (tests, baselines)
            chosen = range(self.num_experts) if experts is None else experts.tolist()
            return torch.stack([int4_packed.PACKED.weight(_PackedExpert(self, e), dtype) for e in chosen])

        if isinstance(self.quant, Fp8Method):
            return (pick(self.weight_fp8).float() * pick(self.weight_scale)[..., None]).to(dtype)
        g_idx = pick(self.g_idx) if self.act_order else None
        return int_formats.dequantize(
            pick(self.qweight), pick(self.zeros), pick(self.scales), g_idx, self.quant.bits, dtype
        )

    @torch.no_grad()
    def fill(self, index: tuple, canon: dict[str, torch.Tensor], hf_name: str) -> None:
        """One expert's projection in kiln's layout (engine/models/loader/quant_loading.py's canonical form)
        into its slot: index (expert,) or (expert, rows) as the loader's target says."""
        e = index[0]
        rows = index[1] if len(index) > 1 else slice(None)
        for key, value in canon.items():
            if key == "input_scale":
                continue  # (experts run weight-only: see the module docstring)
            if key == "g_idx":  # gate and up share the expert's input: one permutation
                default = int_formats.default_g_idx(self.in_features, self.quant.group_size, value.device)
                if self.rows_seen.get(e) and not torch.equal(self.g_idx[e], value.to(self.g_idx.device)):
                    raise ValueError(
                        f"quantization: {hf_name} has a g_idx unlike its expert's other projection "
                        "(act-order permutations of gate and up must match)"
                    )
                self.g_idx[e].copy_(value)
                self.act_order = self.act_order or not torch.equal(value.to(default.device), default)
                continue
            dest = getattr(self, key)[e][rows]
            if tuple(dest.shape) != tuple(value.shape):
                raise ValueError(
                    f"quantization: {hf_name} gives {key} of shape {tuple(value.shape)}, expected {tuple(dest.shape)}"
                )
            dest.copy_(value.to(dest.dtype))
        part = canon["weight_fp8" if "weight_fp8" in canon else "qweight"].shape[0]
        self.rows_seen[e] = self.rows_seen.get(e, 0) + part

    def weight_bytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.buffers(recurse=False))

    def packable(self, dtype: torch.dtype) -> str | None:
        """Why these experts cannot move to torch's packed int4 CPU kernel (None: they can)."""
        if not isinstance(self.quant, IntWeightMethod) or self.int4_group:
            return "not unpacked int4 experts"
        if self.qweight.device.type != "cpu":  # (the op reads the routing on the host)
            return "experts on a GPU (the packed expert path is CPU only)"
        reason = int4_packed.unsupported(
            self.out_features, self.in_features, self.quant.bits, self.quant.group_size, self.qweight.device, dtype
        )
        if reason is None and self.act_order and any(p is None for p in self._perms()):
            return "act-order groups that are not runs of one group size"
        return reason

    def _perms(self) -> list[torch.Tensor | None]:
        """Each expert's act-order column permutation (None each without act-order)."""
        group = int4_packed.packed_group(self.in_features, self.quant.group_size)
        if not self.act_order:
            return [None] * self.num_experts
        return [int4_packed.act_order_perm(self.g_idx[e], group) for e in range(self.num_experts)]

    @torch.no_grad()
    def repack(self, dtype: torch.dtype) -> None:
        """Move every expert to the packed layout for activations of `dtype` (packable first)."""
        group = int4_packed.packed_group(self.in_features, self.quant.group_size)
        perms = self._perms()
        packed, sz = [], []
        for e in range(self.num_experts):
            offsets = -self.zeros[e].float() * self.scales[e].float()
            sz.append(int4_packed.scales_and_zeros(self.scales[e], offsets, group, self.in_features, dtype))
            packed.append(int4_packed.convert(self.qweight[e], perms[e], self.qweight.device))
        for name in ("qweight", "zeros", "scales", "g_idx"):
            self._buffers.pop(name)
        self.register_buffer("int4_packed", torch.stack(packed))
        self.register_buffer("int4_scales_zeros", torch.stack(sz))
        self.register_buffer("int4_perm", torch.stack(perms) if self.act_order else None)
        self.int4_group = group


class _PackedExpert:
    """One packed expert seen as a packed linear layer (int4_packed.Int4PackedMethod.weight)."""

    def __init__(self, experts: QuantExperts, e: int) -> None:
        self.in_features = experts.in_features
        self.int4_packed = experts.int4_packed[e]
        self.int4_scales_zeros = experts.int4_scales_zeros[e]
        self.int4_perm = None if experts.int4_perm is None else experts.int4_perm[e]
        self.int4_group = experts.int4_group


def routed_experts(
    w13: QuantExperts, w2: QuantExperts, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, activation: str
) -> torch.Tensor:
    """SparseMoE's routed experts over quantised weights (see the module docstring)."""
    if w13.int4_group:
        return torch.ops.kiln.moe_experts_int4(
            x,
            weights,
            ids,
            w13.int4_packed,
            w13.int4_scales_zeros,
            w2.int4_packed,
            w2.int4_scales_zeros,
            w13.int4_perm,
            w2.int4_perm,
            w13.int4_group,
            w2.int4_group,
            activation,
        )
    if ids.numel() < w13.num_experts:
        flat = ids.reshape(-1)
        return moe_experts_pairs(x, weights, ids, w13.weight(flat, x.dtype), w2.weight(flat, x.dtype), activation)
    return torch.ops.kiln.moe_experts(x, weights, ids, w13.weight(None, x.dtype), w2.weight(None, x.dtype), activation)


def _replace(moe: nn.Module, method, device) -> None:
    """A SparseMoE's dense w13/w2 parameters -> QuantExperts of the same logical shape."""
    for name in ("w13", "w2"):
        e, out, inp = getattr(moe, name).shape
        del moe._parameters[name]
        setattr(moe, name, QuantExperts(e, out, inp, method, device))


def prepare(moe_layers: list[nn.Module], config: QuantConfig) -> None:
    """On the meta-built model: every MoE layer's experts get quantised buffers instead of dense
    weights (nothing dense is allocated for them)."""
    method = make_method(config)
    for moe in moe_layers:
        _replace(moe, method, "meta")


_HF_PARTS = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


def _matches(hf_module: str, patterns: tuple[str, ...]) -> bool:
    """compressed-tensors' rule: an exact module name, or "re:" and a regex matched from the start."""
    return any(re.match(p[3:], hf_module) if p.startswith("re:") else p == hf_module for p in patterns)


def ignored_linears(linears: dict[str, nn.Module], config: QuantConfig) -> set[str]:
    """The kiln linear layers (names as in `linears`) a compressed-tensors `ignore` list keeps in
    full precision, e.g. Qwen2-MoE's shared expert; a fused layer (q/k/v, gate/up) is ignored only
    whole. (Routers and shared-expert gates are never quantised by kiln: nothing to check.)"""
    patterns = tuple(p for p in config.ignore if p != "lm_head")
    dense = set()
    for name in linears if patterns else ():
        prefix, _, leaf = name.rpartition(".")
        hits = [_matches(f"model.{prefix}.{part}", patterns) for part in _HF_PARTS.get(leaf, (leaf,))]
        if all(hits):
            dense.add(name)
        elif any(hits):
            raise ValueError(
                f"quantization: the ignore list leaves only some of the projections fused in {name} "
                "unquantised (kiln fuses them: all or none)"
            )
    return dense


def experts_named(model: nn.Module, name: str) -> QuantExperts | None:
    """The QuantExperts at kiln parameter name `name` (layers.N.mlp.w13 / w2), else None."""
    try:
        module = model.get_submodule(name)
    except AttributeError:
        return None
    return module if isinstance(module, QuantExperts) else None


def unfilled(model: nn.Module) -> list[str]:
    """The quantised expert weights the checkpoint did not fill completely (names)."""
    return [
        f"{name} expert {e}"
        for name, m in model.named_modules()
        if isinstance(m, QuantExperts)
        for e in range(m.num_experts)
        if m.rows_seen.get(e, 0) != m.out_features
    ]


def repack(model: nn.Module, dtype: torch.dtype, left: dict[str, list[str]]) -> None:
    """After loading: each MoE layer's int4 experts (w13 and w2 both, or neither) move to torch's
    packed int4 kernel for activations of `dtype`; left collects {reason: [layer names]}."""
    for name, moe in model.named_modules():
        experts = (getattr(moe, "w13", None), getattr(moe, "w2", None))
        if not all(isinstance(w, QuantExperts) and isinstance(w.quant, IntWeightMethod) for w in experts):
            continue
        reason = experts[0].packable(dtype) or experts[1].packable(dtype)
        if reason:
            left.setdefault(reason, []).append(f"{name} experts")
            continue
        for w in experts:
            w.repack(dtype)


@torch.no_grad()
def quantize_loaded(moe_layers: list[nn.Module], config: QuantConfig) -> None:
    """--quantization fp8: each MoE layer's loaded experts -> e4m3 with a scale per expert row."""
    method = make_method(config)
    for moe in moe_layers:
        dense = {name: getattr(moe, name).data for name in ("w13", "w2")}
        _replace(moe, method, dense["w13"].device)
        for name, w in dense.items():
            q, scale = quantize_fp8_rows(w.reshape(-1, w.shape[-1]))
            experts = getattr(moe, name)
            experts.weight_fp8.copy_(q.view(w.shape))
            experts.weight_scale.copy_(scale.view(w.shape[:2]))
            experts.rows_seen = {e: w.shape[1] for e in range(w.shape[0])}


@torch.no_grad()
def init_dummy(moe_layers: list[nn.Module], seed: int) -> None:
    """Random quantised experts (about N(0, 0.02) once dequantised) for load_format=dummy."""
    for i, moe in enumerate(moe_layers):
        gen = torch.Generator(device=moe.gate.weight.device).manual_seed(seed + 1000 + i)
        for experts in (moe.w13, moe.w2):
            if not isinstance(experts, QuantExperts):
                continue
            if isinstance(experts.quant, IntWeightMethod):
                experts.qweight.random_(0, 256, generator=gen)
                experts.zeros.fill_(1 << (experts.quant.bits - 1))
                experts.scales.fill_(0.02 / (1 << (experts.quant.bits - 2)))
                experts.g_idx.copy_(
                    int_formats.default_g_idx(experts.in_features, experts.quant.group_size).expand(
                        experts.num_experts, -1
                    )
                )
            else:
                experts.weight_fp8.copy_(torch.randn(experts.weight_fp8.shape, generator=gen).clamp(-8, 8).to(FP8))
                experts.weight_scale.fill_(0.02)
            experts.rows_seen = {e: experts.out_features for e in range(experts.num_experts)}
