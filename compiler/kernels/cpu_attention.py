"""Paged attention for the CPU: a hand-written C++ kernel built ahead of time.

templates/cpu_paged_attention.cpp attends decodes, prefill chunks and mixed steps straight
from the paged cache in one pass: one work item per (sequence, KV head, block of query rows),
every query head of a GQA group served by one read of each K/V row, online softmax (prefill
chunks as tiles: a block of keys widened once against all the item's query vectors,
templates/cpu_prefill_tiles.inc), float32 / bfloat16 / fp8 (e4m3, per-layer scales) caches,
sliding windows and logit soft-capping, padding rows (length 0) and unclaimed tokens written as
zeros. It registers `torch.ops.kiln_cpu.paged_attention`, a plain torch op (a few µs to call from Python, no Dynamo),
and `torch.ops.kiln_cpu.write_kv`, the cache write in one call.

It is built with torch.utils.cpp_extension into the compile cache (`compile_cache_dir`) under a
key of everything that changes the binary (the source, the flags, torch's version, the CPU's
vector ISA), so the first start compiles it (10-30 s on 2 cores) and later starts load the shared
library in milliseconds. The flags follow torch's own CPU capability (AVX2 / AVX-512), never -march=native:
a cache shared by machines of one capability runs on each of them. The reference
(compiler/kernels/reference_attention.py) stays the definition the kernel is tested against.
"""

from __future__ import annotations

import logging
import os
import shutil
import time
from pathlib import Path

import torch

from compiler.kernels import cpu_extension
from compiler.kernels.kv_quant import layer_scales

logger = logging.getLogger(__name__)

TEMPLATES = Path(__file__).resolve().parents[2] / "templates"
SOURCE = TEMPLATES / "cpu_paged_attention.cpp"
INCLUDES = (TEMPLATES / "cpu_prefill_tiles.inc",)  # (in the cache key: a change rebuilds)

# No -ffast-math: it would change NaN handling and rounding; these two change no result.
_BASE_FLAGS = ["-O3", "-fopenmp", "-fno-math-errno", "-fno-trapping-math", "-Wno-psabi"]


def cpu_flags(capability: str | None = None) -> list[str]:
    """Compiler flags for a CPU of torch's `capability` (default: this one's)."""
    return _BASE_FLAGS + cpu_extension.isa_flags(capability)


class CpuAttentionKernel:
    """The C++ kernel of templates/cpu_paged_attention.cpp, built once per cache key and loaded
    once per process (`torch.ops.kiln_cpu` can be registered only once). `builds` counts the
    builds of this instance (tests check that serving adds none)."""

    def __init__(self) -> None:
        self.cache_dir: Path | None = None
        self.builds = 0
        self.build_seconds = 0.0

    def configure(self, cache_dir: Path) -> None:
        self.cache_dir = Path(cache_dir)

    @staticmethod
    def key(capability: str | None = None) -> str:
        return cpu_extension.cache_key(SOURCE, cpu_flags(capability), capability, includes=INCLUDES)

    def library_path(self) -> Path:
        return cpu_extension.library_path(self.cache_dir, "cpu-attention", self.key())

    def load(self) -> None:
        """Make torch.ops.kiln_cpu.paged_attention exist: load the cached build, or build it
        (first start only). A process that already holds the library (from another cache
        directory) copies it into this one rather than building it again."""
        path = cpu_extension.find_library(self.cache_dir, "cpu-attention", self.key())
        if loaded():
            if not path.is_file():
                _copy_loaded_library(path)
            return
        if not path.is_file():
            t0 = time.perf_counter()
            cpu_extension.log_runtime_build("the CPU paged attention", path)
            self._build(path)
            self.builds += 1
            self.build_seconds += time.perf_counter() - t0
        if not loaded():
            torch.ops.load_library(str(path))

    @staticmethod
    def _build(path: Path) -> None:
        cpu_extension.build(path, SOURCE, cpu_flags())


def _copy_loaded_library(path: Path) -> None:
    """The library this process loaded, under the same name (the same key), copied to `path`."""
    found = [Path(p) for p in torch.ops.loaded_libraries if Path(p).name == path.name]
    if not found:
        return  # loaded from a build of other code (cannot happen within one version): nothing to share
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    shutil.copyfile(found[0], tmp)
    os.replace(tmp, path)  # atomic: a concurrent start sees a whole file or none


def loaded() -> bool:
    return hasattr(torch.ops, "kiln_cpu") and hasattr(torch.ops.kiln_cpu, "paged_attention")


KERNEL = CpuAttentionKernel()


def paged_attention_cpu_impl(
    out: torch.Tensor,
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    layer: int,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    max_query_len: int,
    max_seq_len: int,
    num_decodes: int = 0,
    kv_scales: torch.Tensor | None = None,
    sliding_window: int = 0,
    softcap: float = 0.0,
) -> None:
    """kiln::paged_attention_cpu's implementation (compiler/kernels/ops.py), callable without the custom-op
    dispatch from an eager forward: every row (decodes and prefill chunks alike) through the C++
    kernel, which reads only the block-table columns each sequence's length reaches (max_query_len,
    max_seq_len and num_decodes are the other backends' hints; it does not need them).
    kv_scales: an fp8 cache's per-layer scales (compiler/kernels/kv_quant.py)."""
    if not loaded():
        KERNEL.load()
    k_scale, v_scale = layer_scales(kv_scales, layer)
    torch.ops.kiln_cpu.paged_attention(
        out,
        q,
        kv_cache,
        layer,
        _int32(query_start_loc),
        _int32(seq_lens),
        _int32(block_tables),
        scale,
        sliding_window,
        softcap,
        k_scale,
        v_scale,
    )


def write_kv_cpu_impl(
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: torch.Tensor,
    layer: int,
    slot_mapping: torch.Tensor,
    kv_scales: torch.Tensor | None = None,
) -> None:
    """kiln::write_kv's effect in one C++ call (the reference takes ~6 torch ops): rows k/v
    [T, Hkv, D] into their slots of layer `layer` (slot -1: skipped), cast or, for an fp8 cache,
    quantized exactly as compiler/kernels/kv_quant.py's to_cache."""
    if not loaded():
        KERNEL.load()
    torch.ops.kiln_cpu.write_kv(k, v, kv_cache, layer, slot_mapping, *layer_scales(kv_scales, layer))


def _int32(t: torch.Tensor) -> torch.Tensor:
    return t if t.dtype == torch.int32 else t.to(torch.int32)
