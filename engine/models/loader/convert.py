"""A checkpoint tensor copied into its parameter of another dtype, at load."""

from __future__ import annotations

import torch

HALVES = {torch.float16, torch.bfloat16}
# float32 elements of the scratch a half -> half copy goes through (4 MB: stays in the L2 cache)
SCRATCH_ELEMENTS = 1 << 20


def copy_into(dest: torch.Tensor, src: torch.Tensor) -> None:
    """dest.copy_(src). Between float16 and bfloat16 on the CPU it goes through a float32 scratch a
    slice at a time: torch converts one half type to the other element by element (0.4-0.9 GB/s on
    2 Zen 4 cores, most of an F16 GGUF's load into a bfloat16 model), and both float32 conversions
    vectorised (2.5-3x that: tools/bench_startup.py). The same values: float16 -> float32 is exact
    and float32 -> bfloat16 rounds to nearest even, as the direct copy does (a NaN stays a NaN; the
    direct copy makes every NaN the same one)."""
    if (
        {dest.dtype, src.dtype} != HALVES
        or dest.device.type != "cpu"
        or src.device.type != "cpu"
        or dest.shape != src.shape
        or not dest.is_contiguous()
        or not src.is_contiguous()
    ):
        dest.copy_(src)
        return
    d, s = dest.view(-1), src.view(-1)
    scratch = torch.empty(min(SCRATCH_ELEMENTS, d.numel()), dtype=torch.float32)
    for a in range(0, d.numel(), scratch.numel()):
        n = min(scratch.numel(), d.numel() - a)
        part = scratch[:n]
        part.copy_(s[a : a + n])
        d[a : a + n].copy_(part)
