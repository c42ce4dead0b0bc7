"""Quantised linear layers on the CPU through kiln's weight-streaming kernels (compiler/kernels/cpu_gemv.py).

A layer's weight lives in the kernels' packed layout (templates/cpu_gemv.cpp: 16 rows interleaved,
the file's block scales kept) as one or more runs of output rows, each its own buffer
`gemv_packed<i>` with its format: GGUF blocks (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K) as
the file has them, a fused projection whose parts differ (Q4_K_M's q/k in Q4_K, v in Q6_K) as one
run per format; or kiln's int4 / int8 layouts (GPTQ, AWQ, compressed-tensors: w = s * (q - z)
per group), act-order columns permuted so that each group is contiguous (`gemv_perm`, the
activations gathered the same way per call).

Which activation path (`activations_choice`, setting cpu_quant_activations): a float32 model keeps
its activations float on AMD Zen 5 (the products of dequantise-then-matmul, so its greedy
output is the dense model's); elsewhere that float path is compute-bound, so there (and always for
a bfloat16 or float16 model, whose activations are rounded to 8 bits of mantissa anyway) the
activations are quantised to int8 per block of 32 for integer dot products, as llama.cpp does
(1.3-2.4x faster: tools/bench_cpu_gemv.py).
From a layer's `gemm_rows` rows on (prefill chunks) it is instead dequantised into a dense weight in
the activations' dtype and multiplied by the GEMM of compiler/kernels/cpu_linear.py (oneDNN), where
that arithmetic beats the kernels' per-row work. Where that is depends on the machine, the format
and the activations' path: cpu_crossover.py measures it once per machine (`kiln build-kernels
--cpu`) and the builder gives each layer its row count; GEMM_ROWS are the defaults where nothing
was measured (on an Intel Sapphire Rapids the int8 kernels win at every row count up to 2048:
docs/benchmarks.md). It is dequantised in
slices of output rows (GEMM_SLICE_BYTES each) into one scratch reused slice after slice, each slice
a GEMM of its own columns of the output: never a whole float copy of the weight (gate_up of a 1B
model is 134 MB in float32; a 128k-row LM head 1 GB; issue 40).
Tolerances against dequantise-then-matmul: docs/models.md.
"""

from __future__ import annotations

import functools
from typing import Callable

import torch
from torch import nn

from compiler.kernels import cpu_gemv, cpu_linear
from engine.layers.quant import int4_packed, int_formats

BUFFER = "gemv_packed"
MAX_RUNS = 3  # runs per layer: at most one per fused part (q / k / v)
BUFFERS = (*(f"{BUFFER}{i}" for i in range(MAX_RUNS)), "gemv_perm")
# Rows from which the GEMM on the dequantised weight runs instead (float path, int path), where this
# machine's crossover was not measured (cpu_crossover.py); `default_gemm_rows` says which applies
GEMM_ROWS = {True: 64, False: 128}
GEMM_NEVER = 1 << 40  # "from this many rows": never, the kernels take every row count
# Above this many rows on the kernels a gated MLP runs its rows in pieces of this many
# (gated_rows_in_pieces): the [rows, 2 x intermediate] product never exists whole
MLP_PIECE_ROWS = 256
# The dequantised weight's bytes per GEMM slice: 1,024 rows of K = 2048 in float32
GEMM_SLICE_BYTES = 8 << 20
ROW_GROUP = 16  # output rows per group of the packed layout (templates/cpu_gemv.cpp): slices are whole groups


def default_gemm_rows(float_acts: bool) -> int:
    """Rows from which a packed layer runs the GEMM where this machine's crossover was not measured:
    GEMM_ROWS per path, except the int8 path on kernels with VNNI (vpdpbusd), which beat the GEMM at
    every row count measured up to 2048 rows wherever they ran (Intel Sapphire Rapids: docs/benchmarks.md;
    AMD Zen 4, session 26: 8.8 against 27 µs per row at 128 rows, 9.1 against 20.5 at 2048), so
    never there: a 128-token prompt of the 1.2B model's Q4_K_M in float32 ran at 0.7x llama.cpp
    through the GEMM."""
    if not float_acts and cpu_gemv.GEMV.ensure() and cpu_gemv.LEVELS[cpu_gemv.GEMV.level].endswith("_vnni"):
        return GEMM_NEVER
    return GEMM_ROWS[float_acts]


class CpuPackedMethod:
    """A linear layer whose weight is in the CPU kernels' layout: runs (first output row, rows,
    format, groups) on the module (`gemv_runs`), buffers gemv_packed0.. and gemv_perm (act-order
    column order, or None). From `gemm_rows` rows a call runs the GEMM on the dequantised weight
    (default `default_gemm_rows`; the builder sets this machine's: cpu_crossover.apply)."""

    def __init__(self, float_acts: bool, gemm_rows: int | None = None) -> None:
        self.float_acts = float_acts
        self.gemm_rows = default_gemm_rows(float_acts) if gemm_rows is None else gemm_rows

    def apply(self, module: nn.Module, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        if module.gemv_perm is not None:
            x2 = x2.index_select(1, module.gemv_perm)
        dtype = x2.dtype
        if dtype not in (torch.float32, torch.bfloat16):
            x2 = x2.float()
        if x2.stride(-1) != 1:
            x2 = x2.contiguous()
        k = module.in_features
        runs = module.gemv_runs
        if x2.shape[0] >= self.gemm_rows:
            y = gemm_in_slices(module, x2)
        elif len(runs) == 1:
            _, n, fmt, groups = runs[0]
            y = cpu_gemv.quant(x2, module.gemv_packed0, fmt, n, k, groups, module.bias, not self.float_acts)
        else:
            y = x2.new_empty(x2.shape[0], module.out_features)
            for i, (start, n, fmt, groups) in enumerate(runs):
                bias = None if module.bias is None else module.bias[start : start + n]
                cpu_gemv.quant(
                    x2,
                    getattr(module, f"{BUFFER}{i}"),
                    fmt,
                    n,
                    k,
                    groups,
                    bias,
                    not self.float_acts,
                    out=y[:, start : start + n],
                )
        if y.dtype != dtype:
            y = y.to(dtype)
        return y.reshape(*shape[:-1], -1)

    @staticmethod
    def packed_order_weight(module: nn.Module, dtype: torch.dtype) -> torch.Tensor:
        """The dense weight [out, in] in float32 or bfloat16, its columns in the packed order
        (act-order: permuted, as the activations are gathered)."""
        wdtype = torch.bfloat16 if dtype == torch.bfloat16 else torch.float32
        parts = [
            cpu_gemv.dequantize(getattr(module, f"{BUFFER}{i}"), fmt, n, module.in_features, groups, wdtype)
            for i, (_, n, fmt, groups) in enumerate(module.gemv_runs)
        ]
        return torch.cat(parts) if len(parts) > 1 else parts[0]

    def weight(self, module: nn.Module, dtype: torch.dtype) -> torch.Tensor:
        """The dense weight [out, in] (each value as the float path dequantises it)."""
        w = self.packed_order_weight(module, torch.float32)
        if module.gemv_perm is not None:
            dense = torch.empty_like(w)
            dense[:, module.gemv_perm] = w
            w = dense
        return w.to(dtype)

    def weight_bytes(self, module: nn.Module) -> int:
        return sum(getattr(module, f"{BUFFER}{i}").numel() for i in range(len(module.gemv_runs)))


def slice_rows(k: int, element_size: int, budget: int = GEMM_SLICE_BYTES) -> int:
    """Output rows per GEMM slice of a layer of `k` input columns: whole row groups within `budget`
    bytes of dequantised weight (at least one group)."""
    return max(1, budget // (k * element_size * ROW_GROUP)) * ROW_GROUP


def gemm_in_slices(module: nn.Module, x: torch.Tensor, budget: int = GEMM_SLICE_BYTES) -> torch.Tensor:
    """x [M, K] (float32 / bfloat16, columns in the packed order) @ W^T + bias through the GEMM,
    the packed weight dequantised slice by slice of output rows into one scratch of at most
    `budget` bytes: the same values as the whole dense weight (packed_order_weight), each output
    column from the same row of it."""
    wdtype = torch.bfloat16 if x.dtype == torch.bfloat16 else torch.float32
    k, bias = module.in_features, module.bias
    step = slice_rows(k, wdtype.itemsize, budget)
    runs = module.gemv_runs
    if len(runs) == 1 and runs[0][1] <= step:  # (one slice: the layer's own output, no column copies)
        return cpu_linear.linear(x, CpuPackedMethod.packed_order_weight(module, wdtype), bias)
    y = x.new_empty(x.shape[0], module.out_features)
    scratch = torch.empty(min(step, max(r[1] for r in runs)), k, dtype=wdtype)
    for i, (start, n, fmt, groups) in enumerate(runs):
        packed = getattr(module, f"{BUFFER}{i}")
        for first in range(0, n, step):
            rows = min(step, n - first)
            w = cpu_gemv.dequantize(
                packed[first // ROW_GROUP : -(-(first + rows) // ROW_GROUP)], fmt, rows, k, groups, out=scratch[:rows]
            )
            cols = slice(start + first, start + first + rows)
            y[:, cols] = cpu_linear.linear(x, w, None if bias is None else bias[cols])
    return y


def gated_in_slices(
    module: nn.Module,
    x: torch.Tensor,
    half: int,
    act: Callable[[torch.Tensor], torch.Tensor],
    budget: int = GEMM_SLICE_BYTES,
) -> torch.Tensor | None:
    """A fused gate/up layer's GEMM rows with the activation applied slice by slice: act(g | u)
    [M, half] where g, u are x's products with the gate's rows [0, half) and the up's [half, 2 half)
    (act: gate | up columns -> act(gate) * up). Each slice dequantises a run of gate rows and the
    same run of up rows into one scratch, multiplies them in one GEMM and keeps only act's output:
    the [M, 2 half] product never exists whole (a 2048-row step of a 1B model: 134 MB in float32).
    None where it does not apply (fewer than the layer's gemm_rows rows, a bias, act-order, runs that
    do not split at the gate/up boundary, a half not of whole row groups): the layer then runs as it is."""
    if (
        x.dim() != 2
        or x.dtype not in (torch.float32, torch.bfloat16)
        or x.shape[0] < module.quant.gemm_rows
        or module.bias is not None
        or module.gemv_perm is not None
        or half % ROW_GROUP
        or any(edge not in (0, half, 2 * half) for start, n, _, _ in module.gemv_runs for edge in (start, start + n))
    ):
        return None
    x = x if x.stride(-1) == 1 else x.contiguous()
    k = module.in_features
    step = min(half, slice_rows(k, x.element_size(), budget // 2))  # (a slice of gate rows and one of up rows)
    scratch = torch.empty(2 * step, k, dtype=x.dtype)
    out = x.new_empty(x.shape[0], half)
    for first in range(0, half, step):
        rows = min(step, half - first)
        w = scratch[: 2 * rows]
        _dequantize_rows(module, first, w[:rows])
        _dequantize_rows(module, half + first, w[rows:])
        out[:, first : first + rows] = act(cpu_linear.linear(x, w))
    return out


def on_kernels(module: nn.Module, rows: int) -> bool:
    """Whether `module` is a packed layer that runs `rows` rows on the kernels (below its gemm_rows)."""
    quant = getattr(module, "quant", None)
    return isinstance(quant, CpuPackedMethod) and rows < quant.gemm_rows


def gated_rows_in_pieces(
    gate_up: Callable[[torch.Tensor], torch.Tensor],
    down: Callable[[torch.Tensor], torch.Tensor],
    act: Callable[[torch.Tensor], torch.Tensor],
    x: torch.Tensor,
    piece: int = MLP_PIECE_ROWS,
) -> torch.Tensor | None:
    """down(act(gate_up(x))) for a step of more than `piece` rows on the kernels (on_kernels for
    both layers: the caller checks), `piece` rows at a time: each row's output is its own (the
    kernels compute every row alone, so the result is the same bits), and the
    [rows, 2 x intermediate] product of a 2048-row prefill step (134 MB for a 1B model in float32)
    is never whole. None for `piece` rows or fewer (the caller runs it in one go)."""
    if x.dim() != 2 or x.shape[0] <= piece:
        return None
    parts = [down(act(gate_up(x[at : at + piece]))) for at in range(0, x.shape[0], piece)]
    return torch.cat(parts)


def _dequantize_rows(module: nn.Module, first: int, out: torch.Tensor) -> None:
    """Rows [first, first + len(out)) of a packed layer (within one run, from a row group's start)
    dequantised into out."""
    k = module.in_features
    for i, (start, n, fmt, groups) in enumerate(module.gemv_runs):
        if start <= first < start + n:
            at = first - start
            packed = getattr(module, f"{BUFFER}{i}")[at // ROW_GROUP : -(-(at + out.shape[0]) // ROW_GROUP)]
            cpu_gemv.dequantize(packed, fmt, out.shape[0], k, groups, out=out)
            return
    raise ValueError(f"cpu_packed: row {first} is outside the layer's {module.out_features} rows")


def float_acts_for(dtype: torch.dtype | None, activations: str = "auto") -> bool:
    """Whether a model of `dtype` runs its quantised layers on the float path (the setting
    cpu_quant_activations: see `activations_choice`)."""
    return activations_choice(dtype, activations)[0]


def activations_choice(
    dtype: torch.dtype | None,
    activations: str = "auto",
    isa: str | None = None,
    vendor: str | None = None,
    family: int | None = None,
) -> tuple[bool, str]:
    """(float path?, why in words) for a model of `dtype` and the setting cpu_quant_activations, on a
    CPU of torch capability `isa`, /proc/cpuinfo `vendor` and `cpu family` (default: this one's).

    Only a float32 model has the choice (bf16/fp16 activations are rounded to 8 bits of mantissa
    anyway: int8 always). auto: the float path only where dequantising in registers was measured to
    keep up with memory: AMD Zen 5 (family 26 and later: full-width 512-bit conversions beside the
    FMAs; sessions 8-11). Everywhere else the float path's conversions make it compute-bound, so
    int8 there: Zen 3 (AVX2) q4_1 one row 4.0 against 9.4 GB/s; Sapphire Rapids 8.4 against 17.7
    (SmolLM2 Q4_1 batch 1 1.6x, batch 16 1.3x: benchmarks/2026-12-03.md, session 14); Zen 4 (family
    25, AVX-512 on 256-bit units) the 1.2B model's Q4_K_M 1.6x at batch 1 and 2.5x at batch 16, its
    Q8_0 1.5x and 2.3x (docs/benchmarks.md, session 26)."""
    if activations not in ACTIVATIONS:
        raise ValueError(f"cpu_quant_activations: {activations!r} is not one of {ACTIVATIONS}")
    if dtype not in (None, torch.float32):
        return False, "int8 activations (a reduced-precision model)"
    if activations != "auto":
        return activations == "float", f"{activations} activations (cpu_quant_activations={activations})"
    isa = torch.backends.cpu.get_cpu_capability() if isa is None else isa
    vendor = cpu_vendor() if vendor is None else vendor
    family = cpu_family() if family is None else family
    if isa == "AVX512" and vendor == "AuthenticAMD" and family >= ZEN5_FAMILY:
        return True, "float32 activations (auto: AMD Zen 5 AVX-512 here, dequantised in registers at memory speed)"
    where = f"{isa} on {vendor or 'an unknown CPU'}" + (f" family {family}" if family else "")
    return False, (
        f"int8 activations per block of 32, as llama.cpp (auto: {where}, "
        "where the float path is compute-bound; cpu_quant_activations=float keeps dequantise-then-"
        "matmul's products)"
    )


def cpuinfo_field(name: str) -> str:
    """The first `name` field of /proc/cpuinfo ('' where there is none, or no such file)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(name):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


@functools.cache
def cpu_vendor() -> str:
    """This CPU's vendor string (GenuineIntel, AuthenticAMD...) from /proc/cpuinfo; '' elsewhere."""
    return cpuinfo_field("vendor_id")


def cpu_family() -> int:
    """This CPU's /proc/cpuinfo `cpu family` (AMD: 25 Zen 3/4, 26 Zen 5); 0 where it says none."""
    field = cpuinfo_field("cpu family")
    return int(field) if field.isdigit() else 0


ZEN5_FAMILY = 26  # AMD's first family whose AVX-512 units are 512 bits wide


ACTIVATIONS = ("auto", "float", "int8")


def has_packed_layers(model: nn.Module) -> bool:
    """Whether any layer of `model` runs on these kernels."""
    return any(isinstance(getattr(m, "quant", None), CpuPackedMethod) for m in model.modules())


def usable(device: torch.device) -> bool:
    """Whether layers on `device` can move to the CPU kernels (loading them the first time; a
    failure is logged once by cpu_gemv with the path taken instead)."""
    return device.type == "cpu" and cpu_gemv.GEMV.ensure()


def install(
    module: nn.Module,
    runs: list[tuple[int, int, int, int]],
    packed: list[torch.Tensor],
    perm: torch.Tensor | None,
    float_acts: bool,
) -> None:
    """Give a linear layer its packed runs (and drop any other weight buffers it had)."""
    if len(runs) > MAX_RUNS:
        raise ValueError(f"cpu_packed: {len(runs)} runs of formats in one layer (at most {MAX_RUNS})")
    for name in ("qweight", "zeros", "scales", "g_idx", *int4_packed.BUFFERS):
        module._buffers.pop(name, None)
    if "weight" in module._parameters:
        del module.weight
        module.register_parameter("weight", None)
    for i, p in enumerate(packed):
        module.register_buffer(f"{BUFFER}{i}", p)
    module.register_buffer("gemv_perm", perm)
    module.gemv_runs = runs
    module.quant = CpuPackedMethod(float_acts)  # (the default row count: the builder gives this machine's)


def gguf_runs(
    parts: list[tuple[int, str, torch.Tensor]],
    k: int,
    on_allocated: Callable[[list[torch.Tensor]], None] | None = None,
) -> tuple[list, list[torch.Tensor]]:
    """A fused layer's GGUF parts (first row, format name, raw blocks [rows, row bytes]) in row
    order -> its runs and packed buffers: consecutive parts of one format packed together, each
    part straight into its row groups of the run's buffer where the parts before it are whole row
    groups (q, k and v of a fused projection: no concatenated copy of their blocks).
    on_allocated: called with each packed buffer before anything is written to it (the builder
    advises huge pages there, so the buffer faults in on them: no collapse copy later)."""
    runs, packed = [], []
    i = 0
    while i < len(parts):
        j = i
        while j + 1 < len(parts) and parts[j + 1][1] == parts[i][1]:
            j += 1
        group = parts[i : j + 1]
        fmt = cpu_gemv.GGUF_FORMATS[parts[i][1]]
        rows = sum(p[2].shape[0] for p in group)
        out = torch.empty(cpu_gemv.packed_shape(fmt, rows, k), dtype=torch.uint8)
        if on_allocated is not None:
            on_allocated([out])
        if all(p[2].shape[0] % ROW_GROUP == 0 for p in group[:-1]):
            at = 0
            for _, _, raw in group:
                n = -(-raw.shape[0] // ROW_GROUP)
                cpu_gemv.pack(raw.contiguous(), fmt, k, out=out[at : at + n])
                at += n
        else:
            cpu_gemv.pack(torch.cat([p[2] for p in group]).contiguous(), fmt, k, out=out)
        runs.append((parts[i][0], rows, fmt, 0))
        packed.append(out)
        i = j + 1
    return runs, packed


def _int_group(module: nn.Module) -> int:
    """The columns of one scale group (per channel, or a group wider than the row: the whole row)."""
    group, k = module.quant.group_size, module.in_features
    return k if group <= 0 or group >= k else group


def unsupported_int(module: nn.Module) -> str | None:
    """Why an int4 / int8 layer in kiln's layout (int_formats.py) cannot move to the CPU kernels."""
    bits, group, k = module.quant.bits, _int_group(module), module.in_features
    if bits not in (4, 8):
        return f"{bits}-bit weights"
    if k % group or group % 32:
        return (
            f"group size {module.quant.group_size} with {k} input columns (the CPU kernels take groups of a "
            "multiple of 32 columns that divide the row)"
        )
    return None


@torch.no_grad()
def pack_int(module: nn.Module, float_acts: bool) -> str | None:
    """An int4 / int8 layer in kiln's layout -> the CPU kernels' layout, in place. Returns why not
    (it stays as it is)."""
    reason = unsupported_int(module)
    if reason:
        return reason
    bits, group, k = module.quant.bits, _int_group(module), module.in_features
    perm = None
    if module.act_order:  # (permuted column j is in group j // group: the groups keep their order)
        perm = int4_packed.act_order_perm(module.g_idx, group)
        if perm is None:
            return "act-order groups that are not runs of one group size"
        if torch.equal(perm, torch.arange(k, device=perm.device)):
            perm = None  # (groups already in order: nothing to gather)
    q = int_formats.unpack_nibbles(module.qweight) if bits == 4 else module.qweight
    if perm is not None:
        q = q.index_select(1, perm)
    fmt = cpu_gemv.INT4 if bits == 4 else cpu_gemv.INT8
    scales, zeros = module.scales.float().contiguous(), module.zeros.contiguous()
    packed = cpu_gemv.pack(q.contiguous(), fmt, k, scales, zeros)
    install(module, [(0, module.out_features, fmt, scales.shape[1])], [packed], perm, float_acts)
    return None
