"""Time `cpu_gemv.pack` (the GGUF blocks -> the CPU kernels' layout repack that a quantised model's
load runs once per layer) per format, for one or more checkouts in alternating rounds, and check
that every checkout writes the same bytes (issue 40: a K-quant model's load was mostly this).

    python tools/bench_pack.py [--tree OLD --tree NEW] [--formats Q4_K,Q6_K] [--rounds 3] [--threads N]

Each measurement runs in a fresh process in that checkout (a process can load one library of an op
namespace), loading the weight-streaming library that checkout's `kiln serve` would load
(building it there if missing). The shapes are a Llama-3.2-1B layer's (2048 x 2048 attention,
8192 x 2048 MLP up, 2048 x 8192 down) and its 128k-row LM head, the source random bytes (any bytes
are valid blocks: pack moves bits). Printed: milliseconds per format (the shapes together, best of
the process's repeats; median over the rounds), source GB/s, the ratio against the first tree, and
a digest of the packed bytes, which must agree between trees.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve()
SHAPES = ((2048, 2048), (8192, 2048), (2048, 8192), (128256, 2048))
FORMATS = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K")
BLOCK = {"Q4_0": (32, 18), "Q4_1": (32, 20), "Q5_0": (32, 22), "Q5_1": (32, 24), "Q8_0": (32, 34)}
BLOCK |= {"Q4_K": (256, 144), "Q5_K": (256, 176), "Q6_K": (256, 210)}


def worker(formats: list[str], threads: int, repeats: int) -> dict:
    """In a checkout's process: {format: {ms, GB, digest}}."""
    import numpy as np
    import torch

    from compiler.kernels import cpu_gemv

    torch.set_num_threads(threads)
    if not cpu_gemv.GEMV.ensure():
        raise SystemExit(f"the weight-streaming kernels did not load: {cpu_gemv.GEMV.error}")
    out = {}
    for name in formats:
        fmt = cpu_gemv.GGUF_FORMATS[name]
        values, size = BLOCK[name]
        seconds, nbytes, digest = 0.0, 0, hashlib.sha256()
        for n, k in SHAPES:
            rng = np.random.default_rng(n + k + fmt)
            data = torch.from_numpy(rng.integers(0, 256, size=(n, k // values * size), dtype=np.uint8))
            packed = torch.empty(cpu_gemv.packed_shape(fmt, n, k), dtype=torch.uint8)
            packed.fill_(0)  # (pages touched before timing, as the loader's buffers are by their huge-page advice)
            best = float("inf")
            for _ in range(repeats):
                t0 = time.perf_counter()
                cpu_gemv.pack(data, fmt, k, out=packed)
                best = min(best, time.perf_counter() - t0)
            seconds += best
            nbytes += data.numel()
            digest.update(packed.numpy().tobytes())
        out[name] = {"ms": seconds * 1e3, "GB": nbytes / 1e9, "digest": digest.hexdigest()[:16]}
    return out


def run_tree(tree: Path, formats: list[str], threads: int, repeats: int) -> dict:
    cmd = [sys.executable, str(HERE), "--worker", "--formats", ",".join(formats), "--threads", str(threads)]
    cmd += ["--repeats", str(repeats)]
    env = {**os.environ, "PYTHONPATH": str(tree)}
    done = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True)
    lines = [ln for ln in done.stdout.splitlines() if ln.startswith("PACK_RESULT ")]
    if done.returncode != 0 or not lines:
        raise SystemExit(f"{tree}: worker failed ({done.returncode}): {done.stderr[-2000:]}")
    return json.loads(lines[-1].split(" ", 1)[1])


def load() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3]) if Path("/proc/loadavg").exists() else "?"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tree", action="append", type=Path, help="a checkout (repeat; default: this one)")
    p.add_argument("--formats", default="Q4_K,Q5_K,Q6_K,Q4_1")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--repeats", type=int, default=3, help="packs per shape in a process (best taken)")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    formats = [f for f in a.formats.split(",") if f]
    if unknown := set(formats) - set(FORMATS):
        p.error(f"unknown formats {sorted(unknown)} (of {', '.join(FORMATS)})")
    if a.worker:
        print("PACK_RESULT " + json.dumps(worker(formats, a.threads, a.repeats)), flush=True)
        return 0
    trees = [t.resolve() for t in (a.tree or [HERE.parents[1]])]
    print(f"load before: {load()}; {a.threads} threads; shapes {SHAPES}", flush=True)
    runs: dict[Path, list[dict]] = {t: [] for t in trees}
    for r in range(a.rounds):
        for tree in trees:  # (alternating: each sees the same neighbours' load)
            runs[tree].append(run_tree(tree, formats, a.threads, a.repeats))
            line = ", ".join(f"{f} {runs[tree][-1][f]['ms']:.0f} ms" for f in formats)
            print(f"round {r + 1} {tree}: {line}", flush=True)
    print(f"load after: {load()}\n")
    base = trees[0]
    print("| format | " + " | ".join(f"{t} ms (GB/s)" for t in trees) + " | ratio (first / each) | bytes equal |")
    print("| --- |" + " --- |" * (len(trees) + 2))
    same_everywhere = True
    for f in formats:
        ms = {t: statistics.median(run[f]["ms"] for run in runs[t]) for t in trees}
        gb = runs[base][0][f]["GB"]
        digests = {run[f]["digest"] for t in trees for run in runs[t]}
        same_everywhere &= len(digests) == 1
        cells = " | ".join(f"{ms[t]:.0f} ({gb / ms[t] * 1e3:.2f})" for t in trees)
        ratios = ", ".join(f"{ms[base] / ms[t]:.2f}x" for t in trees[1:]) or "-"
        print(f"| {f} | {cells} | {ratios} | {'yes' if len(digests) == 1 else 'NO: ' + ', '.join(sorted(digests))} |")
    return 0 if same_everywhere else 1


if __name__ == "__main__":
    sys.exit(main())
