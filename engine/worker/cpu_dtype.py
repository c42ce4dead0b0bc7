"""What `dtype=auto` means on the CPU: the fastest dtype that is exact enough, on this CPU.

A decode step on the CPU streams every weight once, so two-byte weights halve its cost, but only
where the CPU multiplies them natively: with AVX512-BF16 or AMX, oneDNN's bf16 matmuls run at full
speed; without them every bf16 product is emulated (converted to float32 first), which is slower
than float32 weights would have been, and float32 holds bf16 and fp16 values exactly. So:

- a float32 checkpoint (or one that names no dtype) runs in float32: rounding its weights to bf16
  would change its outputs;
- a bf16 checkpoint runs in bf16 where the CPU has native bf16 dot products, else in float32
  (the same numbers, faster there);
- an fp16 checkpoint runs in bf16 where the CPU has native bf16 (fp16's 10-bit mantissa rounded to
  bf16's 7: vLLM's CPU backend does the same), else in float32 (exact; its weights stay in 2 bytes,
  engine/layers/linear.py "half"). Never in fp16, even where the CPU has AVX512-FP16: kiln's
  CPU kernels (weight streaming, paged attention, fused ops, the decoder stack) take float32 and
  bf16 activations, and an fp16 model would run on torch's own ops instead. On a Sapphire Rapids
  (AVX512-FP16, AMX-BF16), SmolLM2's F16 GGUF: fp16 27 tok/s at batch 1 and 186 at batch 16, bf16
  80 and 366 (float32 with 2-byte weights 68 and 323; benchmarks/2026-12-03.md, session 14);
- a quantised checkpoint (GGUF Q8_0, Q4_x, K-quants; GPTQ/AWQ) runs in float32, as llama.cpp
  does: its integer weights stream the same either way, and bf16 scales and activations were
  measured to change SmolLM2 Q4_1's greedy answers (tests/models/test_real_model.py) where float32 keeps
  them equal to transformers'.

`cpu_auto_dtype` is the rule (pure); `cpu_math` reads what this CPU has. The builder logs the
choice and why at start-up.
"""

from __future__ import annotations

import platform
from dataclasses import dataclass


@dataclass(frozen=True)
class CpuMath:
    """The reduced-precision arithmetic this CPU does natively."""

    bf16: bool  # AVX512-BF16 or AMX-BF16
    fp16: bool  # AVX512-FP16 or AMX-FP16
    isa: str  # torch's CPU capability, for the log (e.g. AVX512, AVX2)

    def describe(self) -> str:
        native = [name for name, on in (("bf16", self.bf16), ("fp16", self.fp16)) if on]
        return f"{self.isa}, native {' and '.join(native)}" if native else f"{self.isa}, no native bf16/fp16"


def cpu_math() -> CpuMath:
    """What this CPU does natively, as torch and oneDNN see it."""
    import torch

    probe = getattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False)
    amx = getattr(torch.cpu, "_is_amx_tile_supported", lambda: False)
    amx_fp16 = getattr(torch.cpu, "_is_amx_fp16_supported", lambda: False)
    mkldnn_fp16 = getattr(torch.ops.mkldnn, "_is_mkldnn_fp16_supported", lambda: False)
    isa = torch.backends.cpu.get_cpu_capability()
    if platform.machine().lower() in ("x86_64", "amd64") and not isa.startswith("AVX512"):
        # (an x86 CPU without AVX-512, or one run below it by KILN_CPU_ISA: neither is native)
        return CpuMath(bf16=False, fp16=False, isa=isa)
    return CpuMath(bf16=bool(probe() or amx()), fp16=bool(amx_fp16() or mkldnn_fp16()), isa=isa)


def cpu_auto_dtype(checkpoint: str | None, math: CpuMath) -> tuple[str, str]:
    """(dtype name, why in words) for dtype=auto on this CPU.

    checkpoint: the weights' own dtype: "float32", "bfloat16", "float16", "quantized" (weights kept
    in an integer format), or None when the checkpoint does not say."""
    if checkpoint in (None, "float32"):
        return "float32", ("the checkpoint's dtype" if checkpoint else "the checkpoint names no dtype")
    if checkpoint == "quantized":
        return "float32", (
            "a quantised checkpoint: its integer weights stream the same in any dtype, and "
            "float32 activations and scales keep its outputs those of the reference"
        )
    what = {"bfloat16": "a bf16 checkpoint", "float16": "an fp16 checkpoint"}[checkpoint]
    if math.bf16:
        why = f"{what}, and this CPU multiplies bf16 natively: half the bytes of float32 per step"
        if checkpoint == "float16":
            why += " (fp16 weights rounded to bf16: kiln's CPU kernels take float32 or bf16 activations)"
        return "bfloat16", why
    return "float32", (
        f"{what}, but this CPU has no native bf16/fp16 dot products: emulated half-precision "
        "matmuls are slower than float32, which holds them exactly"
    )
