"""QuantConfig: how a checkpoint's linear layers are quantised, read from `quantization_config`
(config.json) or forced with the `quantization` setting ("fp8": quantise a bf16/fp32 checkpoint
at load)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# (quant_method "fp8", transformers' block-wise weight_scale_inv checkpoints, is not read yet)
METHODS = ("gptq", "awq", "compressed-tensors")


@dataclass(frozen=True)
class QuantConfig:
    # "int": packed integer weights (GPTQ, AWQ, compressed-tensors pack-quantized), with a
    # checkpoint layout "gptq" | "awq" | "ct"; "fp8": float8 e4m3 weights with float scales.
    kind: str
    layout: str
    bits: int = 4
    group_size: int = -1  # -1: one scale per output channel
    sym: bool = True
    desc_act: bool = False  # GPTQ act-order: columns grouped by g_idx, not by position
    gptq_v1_zeros: bool = True  # GPTQ's original format stores zero points minus one
    # fp8: "tensor" | "channel" weight scales; activations "static" (a checkpoint scale),
    # "dynamic" (per token, at run time) or None (weight-only)
    weight_strategy: str = "channel"
    activations: str | None = None
    quantize_at_load: bool = False  # fp8 from a full-precision checkpoint
    ignore: tuple[str, ...] = ("lm_head",)

    @property
    def name(self) -> str:
        return f"{self.layout}-{'fp8' if self.kind == 'fp8' else f'int{self.bits}'}"


def from_hf(raw: dict[str, Any]) -> QuantConfig:
    """Parse an HF `quantization_config`."""
    method = raw.get("quant_method")
    if method == "gptq":
        bits = int(raw.get("bits", 4))
        if bits not in (4, 8):
            raise ValueError(f"quantization: GPTQ with {bits} bits is not supported (4 or 8)")
        fmt = raw.get("checkpoint_format", "gptq")
        if fmt not in ("gptq", "gptq_v2"):
            raise ValueError(f"quantization: GPTQ checkpoint_format {fmt!r} is not supported (gptq, gptq_v2)")
        return QuantConfig(
            "int",
            "gptq",
            bits,
            int(raw.get("group_size", 128)),
            bool(raw.get("sym", True)),
            bool(raw.get("desc_act", False)),
            gptq_v1_zeros=fmt == "gptq",
        )
    if method == "awq":
        version = str(raw.get("version", "gemm")).lower()
        if int(raw.get("bits", raw.get("w_bit", 4))) != 4 or version != "gemm":
            raise ValueError(
                f"quantization: AWQ {raw.get('bits')}-bit version {version!r} is not supported (4-bit GEMM layout)"
            )
        return QuantConfig(
            "int",
            "awq",
            4,
            int(raw.get("group_size", raw.get("q_group_size", 128))),
            sym=not raw.get("zero_point", True),
        )
    if method == "compressed-tensors":
        return _compressed_tensors(raw)
    raise ValueError(f"quantization: quant_method {method!r} is not supported (kiln reads {', '.join(METHODS)})")


def _compressed_tensors(raw: dict[str, Any]) -> QuantConfig:
    groups = raw.get("config_groups") or {}
    if len(groups) != 1:
        raise ValueError("quantization: compressed-tensors with several config groups is not supported")
    group = next(iter(groups.values()))
    targets = group.get("targets") or []
    if targets and targets != ["Linear"]:
        raise ValueError(f"quantization: compressed-tensors targets {targets} are not supported (['Linear'])")
    w = group.get("weights") or {}
    a = group.get("input_activations")
    fmt = group.get("format") or raw.get("format")
    ignore = tuple(raw.get("ignore") or ())
    if w.get("type") == "float":
        if w.get("num_bits") != 8:
            raise ValueError("quantization: compressed-tensors float weights must be 8-bit (fp8)")
        strategy = w.get("strategy", "tensor")
        if strategy not in ("tensor", "channel"):
            raise ValueError(f"quantization: fp8 weight strategy {strategy!r} is not supported (tensor, channel)")
        acts = None
        if a:
            acts = "dynamic" if a.get("dynamic") else "static"
            if acts == "static" and a.get("strategy", "tensor") != "tensor":
                raise ValueError("quantization: static fp8 activation scales must be per tensor")
        return QuantConfig("fp8", "ct", 8, weight_strategy=strategy, activations=acts, ignore=ignore)
    if fmt != "pack-quantized":
        raise ValueError(
            f"quantization: compressed-tensors format {fmt!r} is not supported (pack-quantized, float-quantized)"
        )
    if a:
        raise ValueError("quantization: compressed-tensors integer activations (W8A8 int) are not supported")
    bits = int(w.get("num_bits", 4))
    strategy = w.get("strategy", "group")
    group_size = int(w.get("group_size") or -1) if strategy == "group" else -1
    return QuantConfig(
        "int",
        "ct",
        bits,
        group_size,
        bool(w.get("symmetric", True)),
        desc_act=w.get("actorder") == "group",
        ignore=ignore,
    )


def forced(name: str, dummy: bool = False) -> QuantConfig:
    """The `quantization` setting for a full-precision checkpoint (or, with dummy weights, any
    layout: random weights in it, for benchmarks)."""
    if name == "fp8":
        return QuantConfig("fp8", "fp8", 8, weight_strategy="channel", activations="dynamic", quantize_at_load=True)
    if dummy and name in ("gptq", "awq", "compressed-tensors"):
        return QuantConfig("int", {"compressed-tensors": "ct"}.get(name, name), 4, 128, sym=True)
    raise ValueError(
        f"quantization: {name!r} cannot be applied at load (only 'fp8'); the checkpoint's own "
        "quantization_config selects gptq, awq or compressed-tensors"
    )
