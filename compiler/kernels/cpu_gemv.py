"""Weight-streaming linear layers for the CPU, in C++ (templates/cpu_gemv.cpp and cpu_gemv_isa.inc).

At decode a linear layer multiplies a few activation rows by a weight matrix that does not fit
in any cache, so its cost is the bytes of the weights: these kernels read each weight once, in
the format it is kept in (dense float32 / bfloat16 / float16, GGUF Q4_0 / Q4_1 / Q5_0 / Q5_1 /
Q8_0 / Q4_K / Q5_K / Q6_K blocks as in the file, kiln's int4 / int8 layouts for GPTQ / AWQ /
compressed-tensors), and split the output rows over the intra-op threads.

One library holds every instruction-set level (generic C++, AVX2, AVX2 + AVX-VNNI, AVX-512,
AVX-512 + VNNI), each compiled under its own `#pragma GCC target`; the CPU's best level is picked
at run time (`GEMV.level`; tests and the benchmark run the others by name). So the build flags
carry no ISA (unlike the fused ops and the attention, which follow torch's capability): one
binary runs on every x86-64 CPU.

Built with torch.utils.cpp_extension (compiler/kernels/cpu_extension.py) into the compile cache under a
key of the sources, flags and torch version: the first use compiles it (~1-2 min on 2 cores),
later ones load it in milliseconds. Never skipped silently: when it cannot be built the error is
logged once with the path taken instead (dense layers: F.linear / oneDNN; quantised layers:
dequantise on the fly).
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import torch

from compiler.kernels import cpu_extension

logger = logging.getLogger(__name__)

TEMPLATES = Path(__file__).resolve().parents[2] / "templates"
SOURCE = TEMPLATES / "cpu_gemv.cpp"
INCLUDES = (TEMPLATES / "cpu_gemv_isa.inc", TEMPLATES / "cpu_bits.inc")

# No -march and no -m ISA flags: each level's code carries its own target (see the module doc).
FLAGS = ["-O3", "-std=c++17", "-fopenmp", "-fno-math-errno", "-fno-trapping-math", "-Wno-psabi"]

LEVELS = ("generic", "avx2", "avx2_vnni", "avx512", "avx512_vnni")

# ggml type ids of the GGUF formats the kernels read, and kiln's own integer layouts.
GGUF_FORMATS = {"Q4_0": 2, "Q4_1": 3, "Q5_0": 6, "Q5_1": 7, "Q8_0": 8, "Q4_K": 12, "Q5_K": 13, "Q6_K": 14}
INT4, INT8 = 1004, 1008

DENSE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

# Rows of x (by its dtype) up to which a dense projection goes through the kernel; above, oneDNN
# (float32 from 32 rows) or F.linear (compiler/kernels/cpu_linear.py). oneDNN's bfloat16 GEMM (AVX-512
# BF16) catches up with the kernel from ~16 rows in a GEMM alone (tools/bench_cpu_gemv.py), but
# the kernels' row limit is also the decoder stack's (engine/models/cpu_stack.py): SmolLM2 bf16
# decodes 1.3-1.5x faster at batch 16 and 1.15x at batch 24 with the stack than op by op on oneDNN.
MAX_DENSE_ROWS = {torch.float32: 31, torch.bfloat16: 31}


class GemvLibrary:
    """templates/cpu_gemv.cpp, built once per cache key and loaded once per process. `ensure()`
    loads it on first use (or says why not, once); `level` is the ISA level the kernels run at
    (default: the best this CPU has); `builds` counts this process's builds."""

    def __init__(self) -> None:
        self.cache_dir: Path | None = None
        self.state = "unloaded"  # "ready" | "failed"
        self.error = ""
        self.level = 0
        self.levels: tuple[int, ...] = ()
        self.max_level = len(LEVELS) - 1  # (limit: KILN_CPU_ISA)
        self.builds = 0

    def configure(self, cache_dir: Path | None) -> None:
        """Where the library is cached (kiln's compile cache); unset: a per-user temp dir."""
        self.cache_dir = Path(cache_dir) if cache_dir is not None else None

    def limit(self, name: str | None) -> None:
        """Run no higher than the level `name` (one of LEVELS; None: the best this CPU has), from
        the next load on, or now where loaded."""
        self.max_level = len(LEVELS) - 1 if name is None else LEVELS.index(name)
        if self.state == "ready":
            self.level = self._best()

    def _best(self) -> int:
        return max(v for v in self.levels if v <= self.max_level)

    @staticmethod
    def key() -> str:
        # (not torch's CPU capability, as the other libraries: this one holds every level, whatever
        # torch runs at, e.g. below a KILN_CPU_ISA limit)
        return cpu_extension.cache_key(SOURCE, FLAGS, capability="every level", includes=INCLUDES)

    def library_path(self) -> Path:
        return cpu_extension.find_library(self.cache_dir, "cpu-gemv", self.key())

    def load(self) -> float:
        """Load the library (build it on the first use). Returns the seconds spent; raises when it
        cannot be built."""
        t0 = time.perf_counter()
        if self.state == "ready":
            return 0.0
        if not loaded():
            path = self.library_path()
            if not path.is_file():
                cpu_extension.log_runtime_build("the CPU weight-streaming kernels", path)
                cpu_extension.build(path, SOURCE, FLAGS)
                self.builds += 1
            if not loaded():
                torch.ops.load_library(str(path))
        self.levels = tuple(int(v) for v in torch.ops.kiln_cpu_gemv.levels())
        self.level = self._best()
        self.state = "ready"
        logger.info("CPU weight-streaming kernels: %s", LEVELS[self.level])
        return time.perf_counter() - t0

    def ensure(self) -> bool:
        """Whether the kernels can run (loading them on the first call). A failure is logged once,
        with the path that runs instead, and not retried."""
        if self.state == "ready":
            return True
        if self.state == "failed":
            return False
        try:
            self.load()
        except Exception as exc:  # (a compiler missing or failing: the layers keep their torch paths)
            self.state, self.error = "failed", f"{type(exc).__name__}: {exc}"
            logger.warning(
                "CPU weight-streaming kernels unavailable (%s): dense layers use F.linear and "
                "quantised layers dequantise on the fly",
                self.error.splitlines()[0],
            )
            return False
        return True


GEMV = GemvLibrary()


def loaded() -> bool:
    return hasattr(torch.ops, "kiln_cpu_gemv") and hasattr(torch.ops.kiln_cpu_gemv, "linear_quant_out")


def dense(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    level: int | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """x [M, K] (float32 / bfloat16, contiguous rows) @ weight [N, K]^T + bias, weight float32,
    bfloat16 or float16; the result in x's dtype (or written into out)."""
    level = GEMV.level if level is None else level
    if out is None:
        return torch.ops.kiln_cpu_gemv.linear_dense.default(x, weight, bias, level)
    torch.ops.kiln_cpu_gemv.linear_dense_out.default(x, weight, bias, level, out)
    return out


def pack(
    data: torch.Tensor,
    fmt: int,
    k: int,
    scales: torch.Tensor | None = None,
    zeros: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Quantised weights -> the kernels' layout (templates/cpu_gemv.cpp): `data` the GGUF file's
    blocks [N, row bytes] for a GGUF_FORMATS id, or for INT4 / INT8 the values [N, K] (uint8) with
    scales (float32) and zero points (uint8) [N, groups], w = s * (q - z). out: written there
    instead (uint8, contiguous, of `packed_shape`)."""
    if out is None:
        return torch.ops.kiln_cpu_gemv.pack(data, fmt, k, scales, zeros)
    torch.ops.kiln_cpu_gemv.pack_out(data, fmt, k, scales, zeros, out)
    return out


def packed_shape(fmt: int, n: int, k: int, groups: int = 0) -> tuple[int, int]:
    """The shape of `pack`'s output for N rows of K columns in `fmt` (uint8: row groups of 16, bytes of each)."""
    return -(-n // 16), int(torch.ops.kiln_cpu_gemv.packed_group_bytes(fmt, k, groups))


def dequantize(
    packed: torch.Tensor,
    fmt: int,
    n: int,
    k: int,
    groups: int = 0,
    dtype: torch.dtype = torch.float32,
    level: int | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Packed weights -> [N, K] float32 or bfloat16 (w = fma(q, d, m), as the float path computes
    them; bfloat16 rounded from that). `packed` may be whole row groups of a layer (its rows
    16 g0 .. 16 g0 + N: `packed[g0:g1]`); out: written there instead (its dtype, not `dtype`)."""
    level = GEMV.level if level is None else level
    if out is None:
        return torch.ops.kiln_cpu_gemv.dequantize.default(packed, fmt, n, k, groups, dtype, level)
    torch.ops.kiln_cpu_gemv.dequantize_out.default(packed, fmt, n, k, groups, level, out)
    return out


def quant(
    x: torch.Tensor,
    packed: torch.Tensor,
    fmt: int,
    n: int,
    k: int,
    groups: int = 0,
    bias: torch.Tensor | None = None,
    int_acts: bool = True,
    level: int | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """x [M, K] (float32 / bfloat16, contiguous rows) @ W^T + bias for W packed by `pack`; the
    result in x's dtype (or written into out). int_acts: activations quantised to int8 per block
    of 32, else kept float."""
    level = GEMV.level if level is None else level
    if out is None:
        return torch.ops.kiln_cpu_gemv.linear_quant.default(x, packed, fmt, n, k, groups, bias, level, int_acts)
    torch.ops.kiln_cpu_gemv.linear_quant_out.default(x, packed, fmt, n, k, groups, bias, level, int_acts, out)
    return out


def dense_usable(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """Whether a dense projection of x goes through the kernel: CPU, float dtypes, no autograd or
    torch.compile, the library loaded (loading it the first time). The caller bounds the rows."""
    return (
        x.is_cpu
        and x.dtype in (torch.float32, torch.bfloat16)
        and x.dim() == 2
        and x.stride(-1) == 1
        and (weight.dtype == x.dtype or (x.dtype == torch.float32 and weight.dtype in DENSE_DTYPES))
        and weight.dim() == 2
        and weight.is_contiguous()
        and weight.is_cpu
        and (bias is None or bias.is_cpu)
        and not torch.is_grad_enabled()
        and not torch.compiler.is_compiling()
        and GEMV.ensure()
    )
