"""oneDNN's own blocked copy of the dense weights, for the GEMM rows of CPU steps, where it pays.

Steps of more rows than the weight-streaming kernels take (compiler/kernels/cpu_gemv.py: MAX_DENSE_ROWS;
prefill chunks, decode batches of 32 and more) multiply through oneDNN (compiler/kernels/cpu_linear.py).
Handed the plain [out, in] weight, oneDNN reorders it into its blocked layout on every call; given
that layout once (`pack_for_gemm`), it does not. On a Sapphire Rapids (AMX-BF16), SmolLM2's
bfloat16 projections of 16-128 rows ran 1.5-2.5x faster that way, with the same bits; float32 ones
1.1-1.3x (float32 rounding differences from the plain path: another blocking), and SmolLM2 F32
served at concurrency 16 gave 1.10x the output tok/s and 0.92-0.94x the median inter-token latency
(two alternating pairs; benchmarks/2026-12-03.md, session 14). The copy costs the weights' bytes once more in
memory, and on a CPU memory decides which model a user can run at all (issue 40: a 1.7B F16 model
peaked at 2.18x llama.cpp's RSS with the copy). Measured on a Llama-3.2-1B-shaped bf16 model (2.47 GB
of weights; one process, copies on and off alternating, two rounds, a 2-core machine under heavy
load; benchmarks/2026-12-05.md, "One copy of the weights"): a 4096-token prefill ran at 0.91x without the
copy (1.03x and 0.81x: the per-call reorder is spread over 2048-row chunks), a 128-token one at 0.57x
(0.38x and 0.92x), decode at batch 1 and 16 takes the weight-streaming kernels either way (the same
code; the loaded machine's noise gave 0.82x and 0.98x). So the copy pays for short prefills and decode
batches past the kernels' rows, and costs as much memory as the model itself:

- `auto`: float32 and bfloat16 models on CPUs with AMX (Sapphire Rapids and later, where it was
  measured), only when the copy is small: at most AUTO_MEMORY_SHARE of the memory free now (a
  135M-360M model's copy, not a 1B model's: memory wins there);
- `on`: every float32 / bfloat16 model, when the copy fits in MEMORY_SHARE of the memory free now;
- `off`: never.

This module is the policy (which models keep the copies); the copies are the layers' post-load hook
(engine/layers/linear.py: Linear.process_weights_after_loading "gemm"; the LM head's, the model's):
the decoder layers' dense projections get `gemm_weight`, the LM head `model.gemm_head`; decode rows up
to the kernels' limit still read the plain weight. Quantised layers are untouched.
"""

from __future__ import annotations

import torch

CHOICES = ("auto", "on", "off")
MEMORY_SHARE = 0.25  # of the memory available now, at most, for the copies (`on`)
AUTO_MEMORY_SHARE = 0.08  # `auto`: only a small copy (1 GB of 12 GB free; a 1B bf16 model's is 2.5 GB)


def has_amx() -> bool:
    """AMX tiles, where torch runs at AVX-512 (not below a KILN_CPU_ISA limit)."""
    return bool(
        getattr(torch.cpu, "_is_amx_tile_supported", lambda: False)()
    ) and torch.backends.cpu.get_cpu_capability().startswith("AVX512")


def gemm_weights_choice(
    setting: str, dtype: torch.dtype, weight_bytes: float, amx: bool, available: float
) -> tuple[bool, str]:
    """(keep the copies?, why in words) for a model of `dtype` whose dense weights hold
    `weight_bytes`, on a CPU with or without AMX and `available` bytes of memory free."""
    if setting not in CHOICES:
        raise ValueError(f"cpu_gemm_packed_weights: {setting!r} is not one of {CHOICES}")
    if setting == "off":
        return False, "cpu_gemm_packed_weights=off"
    if dtype not in (torch.float32, torch.bfloat16):
        return False, f"a {str(dtype).removeprefix('torch.')} model (oneDNN's packed GEMM takes float32 / bfloat16)"
    if setting == "auto" and not amx:
        return False, "auto: only on CPUs with AMX"
    share = AUTO_MEMORY_SHARE if setting == "auto" else MEMORY_SHARE
    if weight_bytes > share * available:
        return False, (
            f"the copy ({weight_bytes / 1e9:.2f} GB) would take more than {share:.0%} of the "
            f"{available / 1e9:.1f} GB free" + ("; cpu_gemm_packed_weights=on keeps it" if setting == "auto" else "")
        )
    return True, f"cpu_gemm_packed_weights={setting}" + (" (an AMX CPU)" if setting == "auto" else "")


def _dense_linears(model) -> list:
    """The model's projections with a `gemm_weight` slot (engine/layers/linear.py: Linear) and a dense weight."""
    return [
        m
        for m in model.modules()
        if hasattr(m, "gemm_weight") and getattr(m, "quant", None) is None and getattr(m, "weight", None) is not None
    ]


def dense_weight_bytes(model, dtype: torch.dtype) -> int:
    """Bytes of the weights the "gemm" hook may copy (the memory check's side of the choice)."""
    weights = [m.weight for m in _dense_linears(model)] + ([model.head_weight()] if hasattr(model, "gemm_head") else [])
    return sum(w.numel() * w.element_size() for w in weights if w is not None and w.dtype == dtype and w.is_cpu)


def packed_copy_bytes(model) -> int:
    """Bytes of the packed copies the model holds now (the second copy /metrics reports; 0 for a
    model without kiln's layers, e.g. a tensor-parallel wrapper)."""
    if not hasattr(model, "modules"):
        return 0
    copies = [m.gemm_weight for m in model.modules() if getattr(m, "gemm_weight", None) is not None]
    head = getattr(model, "gemm_head", None)
    return sum(t.numel() * t.element_size() for t in copies + ([head] if head is not None else []))
