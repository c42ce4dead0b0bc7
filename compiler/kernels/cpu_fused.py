"""Fused element-wise ops of the Llama-family forward on the CPU, in C++ (templates/cpu_fused_ops.cpp).

The eager forward spends 3-10 µs per small torch op, ~30 of them a layer (RMSNorm alone is
float / pow / mean / add / rsqrt / mul / cast / mul); these ops do each group in one pass over
its rows: `rms_norm`, `add_rms_norm` (residual += delta in place, then its norm), `silu_and_mul`
(SiLU or tanh-GELU of the gate times up) and `rope_` (rotary embedding applied in place to q and
k, both Llama's halves and GLM's interleaved pairs, partial rotary too). float32 and bfloat16,
rounded where the eager ops round (see the source's header); the eager code in engine/layers/
(layernorm.py, mlp.py, rotary.py) stays the definition, used on a GPU, under torch.compile, with
autograd, before the library is loaded and for other dtypes.

The same library holds `DecoderStack` (templates/cpu_decoder_stack.inc, a torch custom class): a
model's whole decoder stack as one C++ call over these ops, the weight-streaming projections
(compiler/kernels/cpu_gemv.py) and the paged attention (compiler/kernels/cpu_attention.py), which it finds in the
dispatcher when it is built (engine/models/cpu_stack.py builds it from a model).

Built with torch.utils.cpp_extension into the compile cache (`compile_cache_dir`) under a key of
everything that changes the binary (source, flags, torch version, the CPU's vector ISA): the
first start compiles it (~30 s), later starts load the shared library in milliseconds. The
flags follow torch's CPU capability, never -march=native, so one cache serves every machine of
that capability.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import torch

from compiler.kernels import cpu_extension

logger = logging.getLogger(__name__)

TEMPLATES = Path(__file__).resolve().parents[2] / "templates"
SOURCE = TEMPLATES / "cpu_fused_ops.cpp"
INCLUDES = (TEMPLATES / "cpu_decoder_stack.inc", TEMPLATES / "cpu_bits.inc")

# -ffp-contract=off: no fused multiply-adds, so float32 results are the eager ops' own roundings.
_BASE_FLAGS = ["-O3", "-std=c++17", "-fopenmp", "-fno-math-errno", "-ffp-contract=off"]
DTYPES = (torch.float32, torch.bfloat16)


def cpu_flags(capability: str | None = None) -> list[str]:
    return _BASE_FLAGS + cpu_extension.isa_flags(capability)


class FusedOpsLibrary:
    """templates/cpu_fused_ops.cpp, built once per cache key and loaded once per process (a torch
    library namespace registers once). `ready` turns the fused path on in the model; `builds`
    counts this process's builds (tests check that serving adds none); `error` says why a build
    or load failed (`ensure`: then the eager ops run)."""

    def __init__(self) -> None:
        self.ready = False
        self.builds = 0
        self.error = ""

    @staticmethod
    def key(capability: str | None = None) -> str:
        return cpu_extension.cache_key(SOURCE, cpu_flags(capability), capability, includes=INCLUDES)

    @classmethod
    def library_path(cls, cache_dir: Path | None) -> Path:
        return cpu_extension.find_library(cache_dir, "cpu-fused", cls.key())

    def load(self, cache_dir: Path | None) -> float:
        """Make torch.ops.kiln_cpu_fused exist (build it on the first start) and turn the fused
        path on. Returns the seconds spent."""
        t0 = time.perf_counter()
        if not self.ready:
            path = self.library_path(cache_dir)
            if not path.is_file():
                cpu_extension.log_runtime_build("the CPU fused ops", path)
                self._build(path)
                self.builds += 1
            if not hasattr(torch.ops.kiln_cpu_fused, "rope_"):
                torch.ops.load_library(str(path))
            self.ready = True
        return time.perf_counter() - t0

    def ensure(self, cache_dir: Path | None) -> bool:
        """load(), or, where the library cannot be built or loaded (no compiler, a compile error),
        False: logged once with the path taken instead, and not retried in this process."""
        if self.ready:
            return True
        if self.error:
            return False
        try:
            self.load(cache_dir)
        except Exception as exc:  # (a compiler missing or failing: the model keeps its eager ops)
            self.error = f"{type(exc).__name__}: {exc}"
            logger.warning(
                "CPU fused ops unavailable (%s): norms, rotary embeddings and MLP activations run as "
                "eager torch ops, and the decoder layers without the C++ decoder stack",
                self.error.splitlines()[0],
            )
            return False
        return True

    @staticmethod
    def _build(path: Path) -> None:
        cpu_extension.build(path, SOURCE, cpu_flags())


FUSED = FusedOpsLibrary()


def usable(x: torch.Tensor) -> bool:
    """Whether the fused ops may replace the eager ones for activations x."""
    return (
        FUSED.ready
        and x.device.type == "cpu"
        and x.dtype in DTYPES
        and not torch.is_grad_enabled()
        and not torch.compiler.is_compiling()
    )
