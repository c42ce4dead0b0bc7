"""Where a quantised layer on the CPU leaves the weight-streaming kernels for a GEMM on its
dequantised weight (engine/layers/quant/cpu_packed.py): a row count measured once per machine.

The kernels' cost grows with the rows (each row's integer or float dot products against the
streamed weight); the GEMM's is dequantising the whole weight once plus oneDNN's matmul, so it
wins from some row count on. Where depends on the CPU (AMX / AVX-512 / AVX2, VNNI or not), the
kernels' level, the weight format and the activations' path, so a fixed constant is wrong
somewhere: on an Intel Sapphire Rapids the int8 kernels ran 1.6-3.1x faster per token than the
GEMM up to ~900 rows while the old constant switched at 128 (docs/benchmarks.md).

`measure` times both paths on one layer per kernel family and activation mode, interleaved, at
row counts GRID (one thread, its CPU time: robust to neighbours on a shared machine), and takes
the first row count from which the GEMM wins at two grid points in a row (NEVER: the kernels won
everywhere measured). `kiln build-kernels --cpu` measures and
caches it under kiln's cache dir, keyed by the CPU model, the kernels' ISA level and build,
torch's capability and version (`cache_key`), so start-up only reads a small JSON file; where
nothing is cached the defaults (cpu_packed.default_gemm_rows) hold, and the setting cpu_quant_gemm_rows
overrides both. `resolve` says which, for the start-up log.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from compiler.kernels import cpu_gemv
from engine.config.process_env import onednn_isa_limit
from engine.layers.quant import cpu_packed
from engine.layers.quant.gguf_blocks import BLOCK_TYPES

# Kernel families: formats whose kernels decode alike (one representative is measured for each).
_GGUF = cpu_gemv.GGUF_FORMATS
FAMILIES = {
    "q8": (_GGUF["Q8_0"], cpu_gemv.INT8),
    "q4": (_GGUF["Q4_0"], _GGUF["Q4_1"], _GGUF["Q5_0"], _GGUF["Q5_1"], cpu_gemv.INT4),
    "k": (_GGUF["Q4_K"], _GGUF["Q5_K"], _GGUF["Q6_K"]),
}
MEASURED = {"q8": "Q8_0", "q4": "Q4_0", "k": "Q4_K"}
# Activation modes: the activations' dtype on the packed layer (float32 / bfloat16) and their path.
MODES = {"f32-float": (torch.float32, True), "f32-int8": (torch.float32, False), "bf16-int8": (torch.bfloat16, False)}
GRID = (16, 32, 64, 128, 256, 512, 1024, 2048)
NEVER = cpu_packed.GEMM_NEVER  # "from this many rows": never, the kernels at every row count
SHAPE = (1024, 2048)  # (out, in) of the layer measured: a 1B model's o_proj transposed, 2M weights
MARGIN = 0.95  # the GEMM must take under this share of the kernels' time to count as a win
VERSION = 1  # of the cache file's content


def family_of(fmt: int) -> str:
    """The kernel family of a packed format id (cpu_gemv.GGUF_FORMATS values, INT4, INT8)."""
    for family, formats in FAMILIES.items():
        if fmt in formats:
            return family
    raise ValueError(f"cpu_crossover: format {fmt} is in no kernel family")


def mode_of(dtype: torch.dtype, float_acts: bool) -> str:
    """The activation mode of a packed layer whose activations are `dtype` (bfloat16 stays, every
    other dtype runs as float32: CpuPackedMethod.apply)."""
    if dtype == torch.bfloat16:
        return "bf16-int8"
    return "f32-float" if float_acts else "f32-int8"


@dataclass(frozen=True)
class Crossover:
    """Rows from which the GEMM runs, per "family/mode" (missing: the default for the mode's
    path), and where the figures came from, in words."""

    rows: dict[str, int] = field(default_factory=dict)
    source: str = "defaults"

    def gemm_rows(self, formats: list[int], dtype: torch.dtype, float_acts: bool) -> int:
        """For a layer of packed `formats` (its runs): the smallest of theirs, so that a fused
        layer (Q4_K_M's q/k in Q4_K, v in Q6_K) leaves the kernels as a whole."""
        mode = mode_of(dtype, float_acts)
        default = cpu_packed.default_gemm_rows(float_acts)
        return min(self.rows.get(f"{family_of(f)}/{mode}", default) for f in formats)

    def summary(self, smallest: int) -> str:
        """The start-up log line, for a model whose layers' smallest row count is `smallest`."""
        when = "at no step size (the kernels take every step)" if smallest >= NEVER else f"from {smallest} rows"
        return f"quantised layers run as a GEMM on their dequantised weight {when} ({self.source})"

    def describe(self) -> str:
        parts = [f"{k} {'never' if v >= NEVER else v}" for k, v in sorted(self.rows.items())]
        int8 = cpu_packed.default_gemm_rows(False)
        defaults = f"float path {cpu_packed.GEMM_ROWS[True]}, int8 {'never' if int8 >= NEVER else int8}"
        return ", ".join(parts) if parts else defaults


def random_blocks(name: str, n: int, k: int, gen: torch.Generator) -> torch.Tensor:
    """Random bytes in GGUF blocks of `name` [n, row bytes] with small finite float16 scales (the
    values do not change the speed; finite ones keep the GEMM off denormal and NaN paths)."""
    _, block, nbytes = BLOCK_TYPES[cpu_gemv.GGUF_FORMATS[name]]
    raw = torch.randint(0, 256, (n, k // block, nbytes), dtype=torch.uint8, generator=gen)
    scale = torch.full((n, k // block), 1e-3, dtype=torch.float16).view(torch.uint8).reshape(n, -1, 2)
    for at in {"Q6_K": (208,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q4_1": (0, 2), "Q5_1": (0, 2)}.get(name, (0,)):
        raw[:, :, at : at + 2] = scale
    return raw.reshape(n, -1)


def packed_layer(name: str, float_acts: bool, shape: tuple[int, int] = SHAPE, seed: int = 0) -> nn.Module:
    """A linear layer of random GGUF blocks of `name` on the kernels (cpu_packed.install)."""
    n, k = shape
    gen = torch.Generator().manual_seed(seed)
    fmt = cpu_gemv.GGUF_FORMATS[name]
    layer = nn.Linear(k, n, bias=False, device="meta")
    packed = cpu_gemv.pack(random_blocks(name, n, k, gen), fmt, k)
    cpu_packed.install(layer, [(0, n, fmt, 0)], [packed], None, float_acts)
    return layer


@dataclass
class Point:
    rows: int
    kernels_s: float  # best of the repeats, one call
    gemm_s: float

    @property
    def gemm_wins(self) -> bool:
        return self.gemm_s < MARGIN * self.kernels_s


def time_point(layer: nn.Module, x: torch.Tensor, repeats: int, clock: Callable[[], float]) -> Point:
    """Both paths on `layer` with activations x, interleaved, the best of `repeats` each."""
    quant: Any = layer.quant
    best = {"kernels": float("inf"), "gemm": float("inf")}
    with torch.inference_mode():
        for i in range(repeats + 1):  # (the first round warms: oneDNN's primitive, first touches)
            for path, rows in (("kernels", NEVER), ("gemm", 1)):
                quant.gemm_rows = rows
                t0 = clock()
                quant.apply(layer, x)
                if i:
                    best[path] = min(best[path], clock() - t0)
    return Point(x.shape[0], best["kernels"], best["gemm"])


def measure_one(
    family: str,
    mode: str,
    grid: tuple[int, ...] = GRID,
    repeats: int = 3,
    clock: Callable[[], float] = time.thread_time,
    report: Callable[[str], None] | None = None,
) -> tuple[int, list[Point]]:
    """The crossover of one family and mode, and the points measured (the sweep stops once the
    GEMM won twice in a row)."""
    dtype, float_acts = MODES[mode]
    layer = packed_layer(MEASURED[family], float_acts)
    points: list[Point] = []
    gen = torch.Generator().manual_seed(1)
    for rows in grid:
        x = torch.randn(rows, int(layer.in_features), generator=gen).to(dtype)  # type: ignore[arg-type]
        points.append(time_point(layer, x, repeats, clock))
        if report:
            p = points[-1]
            report(
                f"  {family}/{mode} {rows:>5} rows: kernels {1e6 * p.kernels_s / rows:8.1f} µs/row, "
                f"GEMM {1e6 * p.gemm_s / rows:8.1f} µs/row ({p.kernels_s / p.gemm_s:.2f}x)"
            )
        if len(points) >= 2 and points[-1].gemm_wins and points[-2].gemm_wins:
            return points[-2].rows, points
    last = points[-1]
    return (last.rows if last.gemm_wins else NEVER), points


def measure(
    families: tuple[str, ...] = tuple(FAMILIES),
    modes: tuple[str, ...] = tuple(MODES),
    repeats: int = 3,
    report: Callable[[str], None] | None = None,
    threads: int = 1,
    clock: Callable[[], float] = time.thread_time,
) -> dict[str, int]:
    """Every family x mode's crossover on this machine (the kernels loaded). By default on one
    thread, timed in its CPU time: a call of tens of ms on a machine whose cores other processes
    share is often preempted, and wall time then decides by who ran beside it (a first try on this
    2-core VM at load 8, two threads, wall clock: per-row costs jumping 5-10x between neighbouring
    row counts); one thread's CPU time leaves that out, and both paths split over threads alike
    (whole row groups; oneDNN's blocks), so their ratio, hence the crossover, carries over."""
    if not cpu_gemv.GEMV.ensure():
        raise RuntimeError(f"cpu_crossover: the CPU kernels are not available ({cpu_gemv.GEMV.error})")
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        rows = {}
        for family in families:
            for mode in modes:
                rows[f"{family}/{mode}"], _ = measure_one(family, mode, repeats=repeats, clock=clock, report=report)
    finally:
        torch.set_num_threads(before)
    return rows


def cpu_model() -> str:
    """This CPU's model name from /proc/cpuinfo (the platform's processor string elsewhere)."""
    return cpu_packed.cpuinfo_field("model name") or platform.processor() or platform.machine()


def machine() -> dict[str, str]:
    """What the crossover depends on besides the code measured: the CPU, the kernels' level and
    build, torch's own kernels (their capability: a KILN_CPU_ISA limit lowers it; oneDNN's version)."""
    cpu_gemv.GEMV.ensure()  # (the level is the loaded library's)
    return {
        "cpu": cpu_model(),
        "kernels": cpu_gemv.LEVELS[cpu_gemv.GEMV.level],
        "kernels_build": cpu_gemv.GEMV.key(),
        "torch": torch.__version__,
        "torch_isa": torch.backends.cpu.get_cpu_capability(),
        "onednn_isa": onednn_isa_limit(),
    }


def cache_key(info: dict[str, str]) -> str:
    return hashlib.sha256(json.dumps([VERSION, sorted(info.items())]).encode()).hexdigest()[:16]


def cache_path(cache_dir: Path, info: dict[str, str] | None = None) -> Path:
    return Path(cache_dir) / "cpu_crossover" / f"{cache_key(info or machine())}.json"


def save(cache_dir: Path, rows: dict[str, int], threads: int) -> Path:
    """Write this machine's measured rows (atomically: a reader sees the old file or the new one)."""
    info = machine()
    path = cache_path(cache_dir, info)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps({"version": VERSION, "machine": info, "threads": threads, "rows": rows}, indent=1))
    tmp.replace(path)
    return path


def load(cache_dir: Path) -> Crossover | None:
    """This machine's measured rows from the cache; None where not measured (or unreadable)."""
    path = cache_path(cache_dir)
    try:
        data = json.loads(path.read_text())
        rows = {str(k): int(v) for k, v in data["rows"].items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None
    return Crossover(rows, f"measured on this machine ({data.get('threads', '?')} threads; {path})")


def resolve(setting: int | None, cache_dir: Path) -> Crossover:
    """The crossover in force: the setting's rows for every layer, else this machine's measured
    ones, else the defaults."""
    if setting is not None:
        rows = {f"{f}/{m}": setting for f in FAMILIES for m in MODES}
        return Crossover(rows, f"cpu_quant_gemm_rows={setting}")
    measured = load(cache_dir)
    if measured is not None:
        return measured
    return Crossover({}, "defaults: not measured on this machine (`kiln build-kernels --cpu` measures it)")


def apply(model: nn.Module, crossover: Crossover, dtype: torch.dtype) -> int:
    """Give each packed layer of `model` (activations `dtype`) its row count. Returns the smallest
    (the step size up to which every layer stays on the kernels)."""
    act_dtype = torch.bfloat16 if dtype == torch.bfloat16 else torch.float32
    smallest = NEVER
    for m in model.modules():
        quant = getattr(m, "quant", None)
        if isinstance(quant, cpu_packed.CpuPackedMethod):
            runs: Any = m.gemv_runs
            quant.gemm_rows = crossover.gemm_rows([r[2] for r in runs], act_dtype, quant.float_acts)
            smallest = min(smallest, quant.gemm_rows)
    return smallest


def measure_for_build(compile_cache_dir: Path, cache_dir: Path) -> int:
    """`kiln build-kernels --cpu`'s last step, with the kernels just built into compile_cache_dir:
    measure at the level the engine will run (KILN_CPU_ISA's limit applied, as the engine does)
    and cache. Returns the exit code."""
    from engine.worker.cpu_isa import apply_cpu_isa_limit

    apply_cpu_isa_limit()
    cpu_gemv.GEMV.configure(compile_cache_dir)
    try:
        measure_and_save(cache_dir)
    except RuntimeError as exc:
        print(f"kiln build-kernels: {exc}")
        return 1
    return 0


def measure_and_save(cache_dir: Path, report: Callable[[str], None] = print) -> Path:
    """Measure this machine and cache it."""
    t0 = time.perf_counter()
    report(f"measuring where quantised layers leave the CPU kernels for a GEMM ({cpu_model()})")
    rows = measure(report=report)
    path = save(cache_dir, rows, threads=1)
    summary = Crossover(rows).describe()
    report(f"quantised layers' GEMM from: {summary} rows ({time.perf_counter() - t0:.1f}s; {path})")
    return path
