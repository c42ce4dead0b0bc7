"""The model's Linear under torch.compile(dynamic=True): no row-count guard, so no recompile as the
batch grows, on the path a GPU takes (inputs on the meta device: the non-CPU branch, run here) and
on the CPU's compiled path. compiler/kernels/cpu_linear.py decides the device before any shape test."""

from __future__ import annotations

import pytest
import torch
import torch._dynamo
from torch._dynamo.testing import CompileCounter

from engine.layers.linear import Linear

ROWS = (3, 40, 2048)  # under, across and far past cpu_gemv.MAX_DENSE_ROWS / MIN_ONEDNN_ROWS


def _compiles(device: str, bias: bool) -> tuple[int, list[tuple[int, ...]]]:
    torch._dynamo.reset()
    layer = Linear(64, 96, bias=bias).to(device=device, dtype=torch.bfloat16)
    counter = CompileCounter()  # counts the graphs Dynamo hands the backend (each recompile is one)
    compiled = torch.compile(layer, dynamic=True, backend=counter)
    shapes = []
    with torch.inference_mode():
        for rows in ROWS:
            shapes.append(tuple(compiled(torch.zeros(rows, 64, device=device, dtype=torch.bfloat16)).shape))
    return counter.frame_count, shapes


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("device", ["meta", "cpu"])
def test_one_compile_across_row_counts(device, bias):
    frames, shapes = _compiles(device, bias)
    assert shapes == [(rows, 96) for rows in ROWS]
    assert frames == 1, f"{frames} compiles for rows {ROWS} on {device}: a shape guard in the projection"
