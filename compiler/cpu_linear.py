"""The dense projection (x @ W^T + b) on the CPU through oneDNN instead of torch's default GEMM.

Measured on the shared 2-core AMD EPYC (Zen 5, AVX-512) machine, float32, one thread:
`F.linear` (torch's CPU default, MKL's sgemm) runs at ~50-100 GFLOP/s whatever the size,
while oneDNN's matmul (`torch.ops.mkldnn._linear_pointwise`, the op Inductor emits for a
frozen CPU linear) runs the same product 1.7x faster at 64 rows and 2.3-2.6x faster at a
prefill's thousands of rows; below a few dozen rows oneDNN's fixed cost per call (~15 µs)
makes it slower, so small products keep `F.linear` (`BENCH_loop.md`). Results agree with
`F.linear` to float32 rounding (the same products, summed in another order).

Nothing changes on a GPU, under `torch.compile` (Inductor picks its own kernels) or for other
dtypes and shapes.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

# Rows from which oneDNN beats the default GEMM (measured crossover 16-32 rows at 128-512 wide).
MIN_ONEDNN_ROWS = 32

_ONEDNN = torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias), through oneDNN for 2-D float32 CPU inputs of MIN_ONEDNN_ROWS rows or more."""
    if (_ONEDNN and x.dim() == 2 and x.shape[0] >= MIN_ONEDNN_ROWS and x.device.type == "cpu"
            and x.dtype == torch.float32 and weight.dtype == torch.float32 and x.stride(-1) == 1
            and weight.is_contiguous() and not torch.is_grad_enabled() and not torch.compiler.is_compiling()):
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
    return F.linear(x, weight, bias)
