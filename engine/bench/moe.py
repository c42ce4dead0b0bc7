"""`kiln bench moe [--shape NAME] [--tokens N,N,...] [--json PATH]`: kiln::moe_experts against
the per-expert loop that transformers runs (index each expert's tokens, two matmuls, add back;
it reads the routing on the host), on one MoE layer's routed experts with uniform random
top-k routing. Prints ms per call for kiln's grouped path (torch._grouped_mm), its dense
fallback, and the loop, with the ratio loop / grouped; on a GPU also the expert weight bytes
the call must read over its time, as GB/s.

Shapes: qwen3-30b-a3b (128 experts, top 8, hidden 2048, expert width 768), mixtral-8x7b
(8, top 2, 4096, 14336), and `small` (16, top 2, 512, 256; the CPU default).
Also runnable as `python -m engine.bench.moe`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

SHAPES = {  # experts, top-k, hidden, expert width
    "qwen3-30b-a3b": (128, 8, 2048, 768),
    "mixtral-8x7b": (8, 2, 4096, 14336),
    "small": (16, 2, 512, 256),
}


def loop_experts(x, weights, ids, w13, w2):
    """transformers' way: one pass per expert that got tokens (found on the host)."""
    import torch
    import torch.nn.functional as F

    out = torch.zeros_like(x)
    for e in ids.unique().tolist():
        token, slot = (ids == e).nonzero(as_tuple=True)
        gate, up = F.linear(x[token], w13[e]).chunk(2, dim=-1)
        rows = F.linear(F.silu(gate) * up, w2[e]) * weights[token, slot, None].to(x.dtype)
        out.index_add_(0, token, rows)
    return out


def _time(fn, reps: int, device) -> float:
    import torch

    fn()  # warm-up (allocator, kernels)
    times = []
    for _ in range(reps):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    import torch

    from compiler.kernels.moe import grouped_mm_supported, moe_experts_dense, moe_experts_grouped

    parser = argparse.ArgumentParser(
        prog="kiln bench moe", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--shape", choices=list(SHAPES), default=None, help="default: qwen3-30b-a3b on a GPU, small on the CPU"
    )
    parser.add_argument("--tokens", default=None, help="token counts (default: 1,16,64,256,2048 GPU; 1,16,64,256 CPU)")
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    gpu = device.type == "cuda"
    shape = args.shape or ("qwen3-30b-a3b" if gpu else "small")
    num_experts, k, hidden, width = SHAPES[shape]
    dtype = torch.bfloat16 if gpu else torch.float32
    tokens = [int(t) for t in (args.tokens or ("1,16,64,256,2048" if gpu else "1,16,64,256")).split(",")]
    g = torch.Generator(device=device).manual_seed(0)
    w13 = (torch.randn(num_experts, 2 * width, hidden, device=device, generator=g) * 0.02).to(dtype)
    w2 = (torch.randn(num_experts, hidden, width, device=device, generator=g) * 0.02).to(dtype)
    print(
        f"moe_experts, {shape}: {num_experts} experts, top {k}, hidden {hidden}, width {width}, "
        f"{str(dtype).removeprefix('torch.')} on {device}"
    )
    print(f"{'tokens':>7} {'grouped ms':>11} {'dense ms':>9} {'loop ms':>9} {'loop/grouped':>13} {'GB/s':>7}")
    rows = []
    for n in tokens:
        x = torch.randn(n, hidden, device=device, generator=g).to(dtype)
        scores = torch.rand(n, num_experts, device=device, generator=g)
        weights, ids = scores.softmax(-1).topk(k, dim=-1)
        touched = int(ids.unique().numel())
        row = {"tokens": n, "experts_touched": touched}
        if grouped_mm_supported(x):
            row["grouped_s"] = _time(lambda: moe_experts_grouped(x, weights, ids, w13, w2, "silu"), args.reps, device)
        if n * num_experts * 2 * width * 4 <= 8 << 30:  # the dense fallback's [E, T, 2I] fits
            row["dense_s"] = _time(lambda: moe_experts_dense(x, weights, ids, w13, w2, "silu"), args.reps, device)
        row["loop_s"] = _time(lambda: loop_experts(x, weights, ids, w13, w2), args.reps, device)
        best = row.get("grouped_s") or row.get("dense_s")
        row["ratio_loop_over_kiln"] = row["loop_s"] / best
        bytes_read = touched * 3 * hidden * width * w13.element_size()
        row["weight_gb_per_s"] = bytes_read / best / 1e9
        rows.append(row)

        def ms(key):
            return f"{row[key] * 1e3:.3f}" if key in row else "-"

        print(
            f"{n:>7} {ms('grouped_s'):>11} {ms('dense_s'):>9} {ms('loop_s'):>9} "
            f"{row['ratio_loop_over_kiln']:>12.2f}x {row['weight_gb_per_s']:>7.0f}"
        )
    if args.json:
        Path(args.json).write_text(
            json.dumps({"shape": shape, "device": str(device), "dtype": str(dtype), "rows": rows}, indent=2)
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
