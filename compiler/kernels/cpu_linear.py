"""The dense projection (x @ W^T + b) on the CPU: a few rows through kiln's weight-streaming kernel,
many float32 rows through oneDNN with a bounded set of shapes.

Up to cpu_gemv.MAX_DENSE_ROWS rows (decode; per dtype) a float32 / bfloat16 / float16 weight goes through
compiler/kernels/cpu_gemv.py, which reads the weight once at close to memory speed and splits its rows
over the threads (tools/bench_cpu_gemv.py: its ratio to F.linear per row count).

Measured on the shared 2-core AMD EPYC (Zen 5, AVX-512) machine (benchmarks/2026-11-30.md, BENCH_cpuops): torch's
default float32 GEMM (MKL sgemm) runs at ~100 GFLOP/s whatever the size; oneDNN's matmul
(`torch.ops.mkldnn._linear_pointwise`) runs a prefill's rows 2-3x faster, but it has a fixed
cost of ~10 µs a call, so a few dozen rows stay on `F.linear`. bfloat16 `F.linear` already goes
through oneDNN inside torch: only float32 is routed here.

oneDNN builds and caches a primitive (JIT code, ~0.6 MB) per input shape, so feeding it every
row count a server meets grows the process without bound (session 5 reverted this for that).
Here the row count is rounded up to a bucket (`row_bucket`: two per power of two, so at most a
third of the rows are padding) and the output sliced back, so a weight meets at most
~2 log2(max rows / MIN_ONEDNN_ROWS) shapes. Results agree with `F.linear` to float32 rounding;
padding rows never reach the caller. The eager CPU forward runs its activations in bucket-sized
tensors end to end (LlamaForCausalLM.padded_rows), so its projections take their input as is; a
row slice of such a tensor (the sampled rows) is read in place, past its end, instead of copied.

A weight may also come with oneDNN's own blocked copy of it (`pack_for_gemm`; float32 or bfloat16,
engine/worker/cpu_gemm_weights.py decides which models keep one): the GEMM rows then read that
copy instead of having oneDNN reorder the plain weight on every call, the same row buckets. On a
Sapphire Rapids (AMX), bfloat16 GEMMs of 16-128 rows run 1.5-2.5x faster that way, with the same
bits; float32 ones 1.1-1.3x.

Nothing changes on a GPU, under `torch.compile`, with autograd, or for other dtypes.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F

from compiler.kernels import cpu_gemv

# Rows from which oneDNN beats the default GEMM (measured crossover ~32 rows at one thread, lower
# at two: benchmarks/2026-11-30.md, BENCH_cpuops); decode batches of a few dozen rows gain too.
MIN_ONEDNN_ROWS = 32

_ONEDNN = torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def row_bucket(rows: int) -> int:
    """The row count oneDNN sees for `rows` rows: the next of 2^k and 1.5 * 2^k (k >= 5, and at
    least MIN_ONEDNN_ROWS)."""
    if rows <= MIN_ONEDNN_ROWS:
        return MIN_ONEDNN_ROWS
    power = 1 << (rows - 1).bit_length()  # smallest power of two >= rows
    three_quarters = power // 4 * 3
    return three_quarters if rows <= three_quarters else power


class ShapeLog:
    """The (rows, in, out, bias) shapes handed to oneDNN in this process: tests check it stays small."""

    def __init__(self) -> None:
        self.shapes: set[tuple[int, int, int, bool]] = set()

    def add(self, shape: tuple[int, int, int, bool]) -> None:
        self.shapes.add(shape)


SHAPES = ShapeLog()


def uses_onednn(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    # (the device and torch.compile before any row count: a shape test traced by Dynamo is a guard,
    # a recompile at every crossing; then the cheapest and likeliest-to-fail checks)
    return (
        _ONEDNN
        and x.is_cpu
        and not torch.compiler.is_compiling()
        and x.dim() == 2
        and x.shape[0] >= MIN_ONEDNN_ROWS
        and x.dtype == torch.float32
        and weight.dtype == torch.float32
        and weight.dim() == 2
        and weight.is_contiguous()
        and (bias is None or bias.dtype == torch.float32)
        and not torch.is_grad_enabled()
    )


def _rows_in_storage(x: torch.Tensor, rows: int) -> torch.Tensor | None:
    """x (contiguous 2-D) viewed with `rows` rows when its storage holds them past its own (a row
    slice of a bucket-sized tensor, e.g. the sampled rows of the forward's hidden states); else
    None. The extra rows hold whatever is there: each GEMM output row reads only its own input
    row, and the caller slices those rows off."""
    if not x.is_contiguous():
        return None
    width = x.shape[1]
    if x.untyped_storage().nbytes() < (x.storage_offset() + rows * width) * x.element_size():
        return None
    return x.as_strided((rows, width), (width, 1))


def pack_for_gemm(weight: torch.Tensor) -> torch.Tensor | None:
    """oneDNN's blocked copy of `weight` [out, in] (float32 / bfloat16, CPU) for the GEMM rows of
    `linear(..., gemm_weight=)`; None where oneDNN cannot make one here (the plain path stays)."""
    if not (
        _ONEDNN
        and weight.is_cpu
        and weight.dim() == 2
        and weight.is_contiguous()
        and weight.dtype in (torch.float32, torch.bfloat16)
    ):
        return None
    try:
        with torch.inference_mode():
            return torch.ops.mkldnn._reorder_linear_weight(weight.detach())
    except RuntimeError:  # (e.g. bfloat16 where this oneDNN build has no bf16 GEMM)
        return None


def _gemm_usable(x: torch.Tensor, gemm_weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    return (
        x.is_cpu
        and not torch.compiler.is_compiling()
        and x.dim() == 2
        and x.shape[0] >= MIN_ONEDNN_ROWS
        and x.dtype == gemm_weight.dtype
        and (bias is None or bias.dtype == x.dtype)
        and not torch.is_grad_enabled()
    )


def linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, gemm_weight: torch.Tensor | None = None
) -> torch.Tensor:
    """F.linear(x, weight, bias); 2-D CPU inputs of up to cpu_gemv.MAX_DENSE_ROWS rows go through
    the weight-streaming kernel, float32 ones of MIN_ONEDNN_ROWS rows or more through oneDNN with
    their row count padded to `row_bucket`; gemm_weight (`pack_for_gemm(weight)`): oneDNN reads
    that copy for those rows, float32 or bfloat16."""
    # The device (and torch.compile) is decided before any row count: under
    # torch.compile(dynamic=True) a shape test is a guard, and the graph recompiles where the row
    # count crosses it (a GPU's Linear would recompile at 32 rows).
    if not x.is_cpu:
        return F.linear(x, weight, bias)
    if torch.compiler.is_compiling():
        return F.linear(x, _widened(x, weight), bias)
    if (
        x.dim() == 2
        and x.shape[0] <= cpu_gemv.MAX_DENSE_ROWS.get(x.dtype, 0)
        and cpu_gemv.dense_usable(x, weight, bias)
    ):
        return cpu_gemv.dense(x, weight, bias)
    if gemm_weight is not None and _gemm_usable(x, gemm_weight, bias):
        return _onednn(x, gemm_weight, bias, weight.shape)
    weight = _widened(x, weight)
    if not uses_onednn(x, weight, bias):
        return F.linear(x, weight, bias)
    return _onednn(x, weight, bias, weight.shape)


def _widened(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """A 2-byte weight of a float32 model (engine/layers/linear.py: "half") widened for a GEMM's
    rows, exactly (it holds 2-byte values); the decode rows read it as is. (x is on the CPU.)"""
    if x.dtype == torch.float32 and weight.dtype != x.dtype and weight.dtype in cpu_gemv.DENSE_DTYPES:
        return weight.float()
    return weight


def _onednn(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, shape: torch.Size) -> torch.Tensor:
    """x @ weight^T + bias through oneDNN, x's rows padded to their bucket (shape: [out, in])."""
    rows, bucket = x.shape[0], row_bucket(x.shape[0])
    if bucket != rows and (view := _rows_in_storage(x, bucket)) is not None:
        x = view
    elif bucket != rows or x.stride(-1) != 1:
        padded = x.new_empty(bucket, x.shape[1])
        padded[:rows].copy_(x)
        padded[rows:].zero_()
        x = padded
    SHAPES.add((bucket, shape[1], shape[0], bias is not None))
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")[:rows]


def warm_buckets(layers: Iterable[tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]], max_rows: int) -> int:
    """Run every bucket up to max_rows once through each distinct (weight shape, bias, dtype) of
    `layers` ((weight, bias, gemm_weight or None)), so that oneDNN builds its primitives (~0.6 MB
    each) at start-up and a server's memory stays flat while it serves (and the weight-streaming
    kernels load, or build on the first start, now rather than at the first request). Returns the
    number of shapes built."""
    layers = list(layers)
    if any(w.is_cpu and w.dtype in cpu_gemv.DENSE_DTYPES for w, _, _ in layers):
        cpu_gemv.GEMV.ensure()
    seen: set[tuple[int, int, bool, torch.dtype]] = set()
    built = 0
    with torch.inference_mode():
        for weight, bias, gemm_weight in layers:
            dtype = gemm_weight.dtype if gemm_weight is not None else weight.dtype
            key = (weight.shape[0], weight.shape[1], bias is not None, dtype)
            probe = weight.new_zeros(MIN_ONEDNN_ROWS, weight.shape[1], dtype=dtype) if weight.dim() == 2 else None
            if (
                key in seen
                or probe is None
                or not (
                    uses_onednn(probe, weight, bias) if gemm_weight is None else _gemm_usable(probe, gemm_weight, bias)
                )
            ):
                continue
            seen.add(key)
            rows = MIN_ONEDNN_ROWS
            while True:
                linear(probe.new_zeros(rows, weight.shape[1]), weight, bias, gemm_weight)
                built += 1
                if rows >= max_rows:
                    break
                rows = row_bucket(rows + 1)
    return built
