"""The CPU weight-streaming kernels (compiler/kernels/cpu_gemv.py) per weight format and row count: GB/s of
weights streamed, against the machine's copy bandwidth measured in the same run, and the speed
ratio to the path kiln took before them. Interleaved repeats (new, old, new, old, ...), medians.

    PYTHONPATH=. python tools/bench_cpu_gemv.py [--formats f32,bf16,q8_0,q4_1,...] [--rows 1,4,16,64]
        [--threads 1,2] [--repeats 5] [--layers 16] [--level avx2] [--clock wall|cpu] [--stat median|min]
        [--json out.json]
    PYTHONPATH=. python tools/bench_cpu_gemv.py --crossover [--threads 1] [--level avx2] [--write]

--crossover: per kernel family and activation path, the kernels against the GEMM on the dequantised
weight per row count (µs per row, interleaved, best of --repeats), and the row count from which the
GEMM wins (engine/runtime/builder_cpu_crossover.py, what `kiln build-kernels --cpu` measures); --write
caches it for `kiln serve` on this machine (kiln's cache dir).

Weights: `--layers` decoder layers of a 1024-wide model (q/k/v 1536x1024, o 1024x1024,
gate/up 5632x1024, down 1024x2816: every format's blocks fit), random values (they do not change
the speed); one pass = every projection once with `rows` activation rows, as a decode step does.
--clock cpu times passes in this process's CPU time instead of wall time: on a machine shared with
other work it leaves out the time the process waited for a core (one thread only: with two, a
descheduled thread stalls the other at every OpenMP barrier, which CPU time does not see either).
--stat min takes each path's fastest pass instead of the median: on a shared machine, the pass
that ran while both cores were free.
GB/s = the bytes each path streams per pass (its own weight format) / the pass's time; `% copy`
= that over the copy bandwidth (read + write bytes of a 2 x 256 MB torch copy, STREAM's
convention). Each format runs in its model dtype:
  float32 models: the float activation path (exact products); bfloat16 models: int8 activations.
The old path, per format (what kiln did before these kernels):
  f32, bf16                  F.linear (oneDNN from 32 rows for float32: compiler/kernels/cpu_linear.py)
  bf16w/f16w in a f32 model  F.linear on the weights converted to float32 at load
  q8_0, gptq-int8            dequantise on the fly (IntWeightMethod), then F.linear
  q4_0 / q4_1 bf16           torch's packed int4 kernel; float32: F.linear, dequantised at load
  q4_k / q5_k / q6_k         F.linear on the weights dequantised at load
  gptq-int4 (g128) bf16      torch's packed int4 kernel; float32: dequantise on the fly
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from compiler.kernels import cpu_gemv, cpu_linear
from compiler.kernels.cpu_gemv import GEMV, GGUF_FORMATS, LEVELS
from compiler.kernels.cpu_linear import MIN_ONEDNN_ROWS
from engine.config.settings_base import default_cache_dir
from engine.layers.quant import int_formats
from engine.layers.quant.config import QuantConfig
from engine.layers.quant.linear import IntWeightMethod
from engine.runtime import builder_cpu_crossover as cpu_crossover
from engine.runtime.builder_cpu_crossover import random_blocks

SHAPES = [(1536, 1024), (1024, 1024), (5632, 1024), (1024, 2816)]  # (out, in): q/k/v, o, gate/up, down
F32, BF16 = torch.float32, torch.bfloat16
# name -> (weight kind, model dtype)
FORMATS = {
    "f32": ("f32", F32),
    "bf16": ("bf16", BF16),
    "bf16w-f32": ("bf16", F32),
    "f16w-f32": ("f16", F32),
    "q8_0-f32": ("Q8_0", F32),
    "q8_0-bf16": ("Q8_0", BF16),
    "q4_0-f32": ("Q4_0", F32),
    "q4_0-bf16": ("Q4_0", BF16),
    "q4_1-f32": ("Q4_1", F32),
    "q4_1-bf16": ("Q4_1", BF16),
    "q4_k-f32": ("Q4_K", F32),
    "q4_k-bf16": ("Q4_K", BF16),
    "q5_k-bf16": ("Q5_K", BF16),
    "q6_k-f32": ("Q6_K", F32),
    "q6_k-bf16": ("Q6_K", BF16),
    "gptq-int4-f32": ("int4", F32),
    "gptq-int4-bf16": ("int4", BF16),
    "gptq-int8-f32": ("int8", F32),
    "gptq-int8-bf16": ("int8", BF16),
}
DEFAULT = "f32,bf16,bf16w-f32,q8_0-f32,q8_0-bf16,q4_0-bf16,q4_1-f32,q4_1-bf16,q4_k-bf16,q6_k-bf16,gptq-int4-bf16"


def bandwidth(mb: int = 256, repeats: int = 5) -> tuple[float, float]:
    """(copy GB/s counting read + write bytes, read GB/s of a float32 sum), best of `repeats`."""
    a = torch.ones(mb << 18)
    b = torch.empty_like(a)
    copy = min(_timed(lambda: b.copy_(a)) for _ in range(repeats))
    read = min(_timed(lambda: a.sum()) for _ in range(repeats))
    return 2 * a.numel() * 4 / copy / 1e9, a.numel() * 4 / read / 1e9


CROSSOVER = cpu_crossover.Crossover()  # (main: this machine's, where measured)
CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}
CLOCK = CLOCKS["wall"]


def _timed(fn: Callable[[], object]) -> float:
    t0 = CLOCK()
    fn()
    return CLOCK() - t0


@dataclass
class Path:
    run: Callable[[torch.Tensor, int], None]  # (activations of one width, layer index) -> one projection
    bytes: int  # weight bytes one pass streams


def _int_layer(bits: int, n: int, k: int, gen: torch.Generator, group: int = 128) -> torch.nn.Linear:
    m = torch.nn.Linear(k, n, bias=False, device="meta")
    del m.weight
    m.register_parameter("weight", None)
    m.quant = IntWeightMethod(QuantConfig("int", "gptq", bits, group))
    m.quant.create(m, "cpu")
    m.qweight.copy_(torch.randint(0, 256, m.qweight.shape, dtype=torch.uint8, generator=gen))
    m.zeros.fill_(1 << (bits - 1))
    m.scales.fill_(1e-3)
    return m


def _torch_int4(n: int, k: int, gen: torch.Generator, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    q = torch.randint(0, 16, (n, k), dtype=torch.int32, generator=gen)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
    sz = torch.full((k // group, n, 2), 1e-3, dtype=BF16)
    return packed, sz


def _dense_old(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """compiler/kernels/cpu_linear.py before the kernels: F.linear, oneDNN from MIN_ONEDNN_ROWS float32 rows."""
    if x.dtype == F32 and x.shape[0] >= MIN_ONEDNN_ROWS:
        return torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "")
    return F.linear(x, w)


def _quant_new(x: torch.Tensor, packed: torch.Tensor, fmt: int, n: int, k: int, groups: int, float_acts: bool):
    """What a quantised layer runs now (engine/layers/quant/cpu_packed.py): the kernel, or from this
    machine's crossover (cpu_crossover.py: measured and cached, else cpu_packed.default_gemm_rows) the GEMM on the
    weight dequantised for the call."""
    if x.shape[0] >= CROSSOVER.gemm_rows([fmt], x.dtype, float_acts):
        return cpu_linear.linear(x, cpu_gemv.dequantize(packed, fmt, n, k, groups, x.dtype))
    return cpu_gemv.quant(x, packed, fmt, n, k, groups, int_acts=not float_acts)


def build(fmt: str, layers: int, seed: int = 0) -> tuple[Path, Path]:
    """(new path, old path) for `layers` layers of SHAPES in format `fmt`."""
    kind, dtype = FORMATS[fmt]
    gen = torch.Generator().manual_seed(seed)
    shapes = SHAPES * layers
    float_acts = dtype == F32
    if kind in ("f32", "bf16", "f16"):
        wdtype = {"f32": F32, "bf16": BF16, "f16": torch.float16}[kind]
        new_w = [torch.randn(n, k, generator=gen).to(wdtype) for n, k in shapes]
        old_w = new_w if wdtype == dtype else [w.to(dtype) for w in new_w]
        # (what the engine runs now: compiler/kernels/cpu_linear.py, the kernel up to MAX_DENSE_ROWS rows)
        new = Path(
            lambda x, i: cpu_linear.linear(x, new_w[i]) if wdtype == dtype else cpu_gemv.dense(x, new_w[i]),
            sum(w.numel() * w.element_size() for w in new_w),
        )
        old = Path(lambda x, i: _dense_old(x, old_w[i]), sum(w.numel() * w.element_size() for w in old_w))
        return new, old
    if kind in ("int4", "int8"):
        bits = 4 if kind == "int4" else 8
        fmt_id = cpu_gemv.INT4 if bits == 4 else cpu_gemv.INT8
        mods = [_int_layer(bits, n, k, gen) for n, k in shapes]
        packed = []
        for m in mods:
            q = int_formats.unpack_nibbles(m.qweight) if bits == 4 else m.qweight
            packed.append(cpu_gemv.pack(q.contiguous(), fmt_id, m.in_features, m.scales, m.zeros))
        new = Path(
            lambda x, i: _quant_new(x, packed[i], fmt_id, *shapes[i], shapes[i][1] // 128, float_acts),
            sum(p.numel() for p in packed),
        )
        if bits == 4 and dtype == BF16:
            t4 = [_torch_int4(n, k, gen, 128) for n, k in shapes]
            old = Path(
                lambda x, i: torch.ops.aten._weight_int4pack_mm_for_cpu(x, t4[i][0], 128, t4[i][1]),
                sum(p.numel() * p.element_size() + s.numel() * s.element_size() for p, s in t4),
            )
        else:
            old = Path(lambda x, i: mods[i].quant.apply(mods[i], x), sum(m.quant.weight_bytes(m) for m in mods))
        return new, old
    raws = [random_blocks(kind, n, k, gen) for n, k in shapes]
    fmt_id = GGUF_FORMATS[kind]
    packed = [cpu_gemv.pack(r, fmt_id, k) for r, (_, k) in zip(raws, shapes)]
    new = Path(lambda x, i: _quant_new(x, packed[i], fmt_id, *shapes[i], 0, float_acts), sum(p.numel() for p in packed))
    if kind == "Q8_0":  # IntWeightMethod on kiln's int8 layout (q + 128, zero 128, a float32 scale per 32)
        mods = [_int_layer(8, n, k, gen, group=32) for n, k in shapes]
        old = Path(lambda x, i: mods[i].quant.apply(mods[i], x), sum(m.quant.weight_bytes(m) for m in mods))
    elif kind in ("Q4_0", "Q4_1") and dtype == BF16:
        t4 = [_torch_int4(n, k, gen, 32) for n, k in shapes]
        old = Path(
            lambda x, i: torch.ops.aten._weight_int4pack_mm_for_cpu(x, t4[i][0], 32, t4[i][1]),
            sum(p.numel() * p.element_size() + s.numel() * s.element_size() for p, s in t4),
        )
    else:  # dequantised at load
        dense = [torch.randn(n, k, generator=gen).to(dtype) for n, k in shapes]
        old = Path(lambda x, i: _dense_old(x, dense[i]), sum(w.numel() * w.element_size() for w in dense))
    return new, old


def measure(
    new: Path,
    old: Path,
    dtype: torch.dtype,
    rows: int,
    projections: int,
    repeats: int,
    stat: Callable[[list[float]], float] = statistics.median,
) -> dict:
    """Seconds per pass of each path (median, or `stat`), passes interleaved."""
    xs = {k: torch.randn(rows, k).to(dtype) for _, k in SHAPES}

    def one_pass(path: Path) -> Callable[[], None]:
        def run() -> None:
            for i in range(projections):
                path.run(xs[SHAPES[i % len(SHAPES)][1]], i)

        return run

    times: dict[str, list[float]] = {"new": [], "old": []}
    fns = {"new": one_pass(new), "old": one_pass(old)}
    with torch.inference_mode():
        for fn in fns.values():
            fn()  # (warm: oneDNN primitives, first touches)
        for _ in range(repeats):
            for name, fn in fns.items():
                times[name].append(_timed(fn))
    t_new, t_old = stat(times["new"]), stat(times["old"])
    return dict(
        new_s=t_new,
        old_s=t_old,
        new_gbs=new.bytes / t_new / 1e9,
        old_gbs=old.bytes / t_old / 1e9,
        speedup=t_old / t_new,
    )


def threads_of(args: argparse.Namespace) -> list[int]:
    return [int(t) for t in args.threads.split(",")]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--formats", default=DEFAULT, help=f"comma-separated, of: {', '.join(FORMATS)} (or 'all')")
    p.add_argument("--rows", default="1,4,16,64")
    p.add_argument("--threads", default="1,2")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--level", choices=LEVELS, help="ISA level of the kernels (default: the best this CPU runs)")
    p.add_argument("--clock", choices=CLOCKS, default="wall", help="wall time, or this process's CPU time")
    p.add_argument("--stat", choices=("median", "min"), default="median", help="per path over the repeats")
    p.add_argument("--json", help="write the rows here")
    p.add_argument("--crossover", action="store_true", help="measure where the GEMM beats the kernels, per family")
    p.add_argument("--write", action="store_true", help="with --crossover: cache it for kiln on this machine")
    args = p.parse_args(argv)
    global CLOCK, CROSSOVER
    CLOCK = CLOCKS[args.clock]
    if args.clock == "cpu" and threads_of(args) != [1]:
        print("bench_cpu_gemv: --clock cpu measures one thread (--threads 1)")
        return 2
    formats = list(FORMATS) if args.formats == "all" else args.formats.split(",")
    rows_list = [int(r) for r in args.rows.split(",")]
    threads_list = threads_of(args)
    if not GEMV.ensure():
        print(f"bench_cpu_gemv: the CPU kernels could not be built: {GEMV.error}")
        return 1
    if args.level:
        GEMV.level = LEVELS.index(args.level)
        if GEMV.level not in GEMV.levels:
            print(f"bench_cpu_gemv: this CPU cannot run {args.level} (runs {[LEVELS[v] for v in GEMV.levels]})")
            return 2
    if args.crossover:
        return _crossover(threads_list, args.repeats, args.write)
    CROSSOVER = cpu_crossover.resolve(None, default_cache_dir())
    results = []
    print(f"bench_cpu_gemv: quantised layers' GEMM from: {CROSSOVER.describe()} rows ({CROSSOVER.source})")
    print(
        f"bench_cpu_gemv: {platform.processor() or platform.machine()}, torch {torch.__version__} "
        f"({torch.backends.cpu.get_cpu_capability()}), kernels {LEVELS[GEMV.level]}, {args.clock} clock, "
        f"{args.stat} of {args.repeats}, "
        f"load average {', '.join(f'{v:.1f}' for v in os.getloadavg())}"
    )
    for threads in threads_list:
        torch.set_num_threads(threads)
        copy, read = bandwidth()
        print(f"\n{threads} thread(s): copy {copy:.1f} GB/s (read + write), read {read:.1f} GB/s")
        print(f"{'format':<16}{'rows':>5}{'new GB/s':>10}{'% copy':>8}{'old GB/s':>10}{'new/old':>9}")
        for fmt in formats:
            new, old = build(fmt, args.layers)
            for rows in rows_list:
                r = measure(
                    new,
                    old,
                    FORMATS[fmt][1],
                    rows,
                    len(SHAPES) * args.layers,
                    args.repeats,
                    min if args.stat == "min" else statistics.median,
                )
                r.update(
                    format=fmt,
                    rows=rows,
                    threads=threads,
                    copy_gbs=copy,
                    read_gbs=read,
                    clock=args.clock,
                    stat=args.stat,
                    level=LEVELS[GEMV.level],
                    pct_copy=100 * r["new_gbs"] / copy,
                )
                results.append(r)
                print(
                    f"{fmt:<16}{rows:>5}{r['new_gbs']:>10.1f}{r['pct_copy']:>7.0f}%{r['old_gbs']:>10.1f}"
                    f"{r['speedup']:>8.2f}x",
                    flush=True,
                )
            del new, old
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


def _crossover(threads_list: list[int], repeats: int, write: bool) -> int:
    print(
        f"bench_cpu_gemv --crossover: {cpu_crossover.cpu_model()}, kernels {LEVELS[GEMV.level]}, "
        f"torch {torch.__version__} ({torch.backends.cpu.get_cpu_capability()}), layer {cpu_crossover.SHAPE}, "
        f"best of {repeats}, load average {', '.join(f'{v:.1f}' for v in os.getloadavg())}"
    )
    for threads in threads_list:
        # (one thread: its CPU time, as kiln build-kernels --cpu measures; more: wall time)
        clock = time.thread_time if threads == 1 else time.perf_counter
        print(f"\n{threads} thread(s), {'CPU' if threads == 1 else 'wall'} time:")
        rows = cpu_crossover.measure(repeats=repeats, report=print, threads=threads, clock=clock)
        print(f"GEMM from: {cpu_crossover.Crossover(rows).describe()} rows")
        if write:
            print(f"cached for kiln: {cpu_crossover.save(default_cache_dir(), rows, threads)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
