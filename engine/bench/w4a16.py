"""`python -m engine.bench.w4a16 [--json PATH] [--cache-dir DIR]`: kiln's W4A16 GEMM
against torch's tinygemm (`_weight_int4pack_mm`, the same int4 weights) and the bf16 matmul, on
the projections of the Llama-3.1-8B shape (fused qkv, o, fused gate/up, down), group 128, at
M = 1, 16 and 64 tokens. Per call: microseconds, GB/s of weight bytes (packed weight + group
scales and zeros), and the ratios kiln / tinygemm and kiln / bf16 (the issue's target for the
whole decode step: int4 <= 0.4x bf16).

Timing as engine/bench/kernels.py: CUDA events around graph replays of calls rotated over
enough weight copies that L2 (50 MB on an H200) serves none of them.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from engine.bench.kernels import DEFAULT_CACHE_DIR, L2_ROTATE_BYTES, _time_graph

SHAPES_8B = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
TOKENS = (1, 16, 64)
GROUP = 128


def int4_bytes(n: int, k: int, group: int = GROUP) -> int:
    """Bytes the kiln kernel reads for one weight: K/2 per row plus a float32 scale and a byte zero per group."""
    return n * k // 2 + n * (k // group) * 5


def copies_for(nbytes: int) -> int:
    """Weight copies to rotate over so that L2 holds none of them between calls."""
    return max(2, -(-L2_ROTATE_BYTES // nbytes))


def _tinygemm(q, zeros, scales, group):
    """The same weights in tinygemm's layout: W = (q - 8) * s + (8 - z) * s."""
    import torch

    packed = ((q[:, 0::2] << 4) | q[:, 1::2]).contiguous()  # (tinygemm: even column in the high nibble)
    w = torch.ops.aten._convert_weight_to_int4pack(packed, 8)
    sz = torch.stack([scales, (8 - zeros.float()) * scales], dim=-1).transpose(0, 1).to(torch.bfloat16).contiguous()
    return w, sz


def bench(cache_dir: Path, shapes=SHAPES_8B, tokens=TOKENS, reps: int = 5, on_row=None) -> list[dict]:
    import torch

    from compiler.kernels.w4a16_gemm import W4A16Gemm, pack_w4a16

    dev = torch.device("cuda")
    gemm = W4A16Gemm(cache_dir, dev)
    rows = []
    for name, (n, k) in shapes.items():
        gen = torch.Generator(dev).manual_seed(0)
        nbytes = int4_bytes(n, k)
        kiln, tiny = [], []
        for _ in range(copies_for(nbytes)):
            q = torch.randint(0, 16, (n, k), device=dev, dtype=torch.uint8, generator=gen)
            zeros = torch.randint(0, 16, (n, k // GROUP), device=dev, dtype=torch.uint8, generator=gen)
            scales = torch.rand(n, k // GROUP, device=dev, generator=gen) * 0.01
            kiln.append(pack_w4a16(q[:, 0::2] | (q[:, 1::2] << 4), zeros, scales, GROUP))
            tiny.append(_tinygemm(q, zeros, scales, GROUP))
            del q
        dense = [
            torch.randn(n, k, device=dev, dtype=torch.bfloat16, generator=gen) * 0.02
            for _ in range(copies_for(2 * n * k))
        ]
        for m in tokens:
            x = torch.randn(m, k, device=dev, dtype=torch.bfloat16, generator=gen)
            t_kiln = _time_graph([lambda w=w: gemm(x, *w) for w in kiln], reps)
            t_tiny = _time_graph(
                [lambda w=w: torch.ops.aten._weight_int4pack_mm(x, w[0], GROUP, w[1]) for w in tiny], reps
            )
            t_bf16 = _time_graph([lambda w=w: torch.nn.functional.linear(x, w) for w in dense], reps)
            rows.append(
                dict(
                    shape=name,
                    n=n,
                    k=k,
                    m=m,
                    kiln_us=t_kiln * 1e6,
                    tinygemm_us=t_tiny * 1e6,
                    bf16_us=t_bf16 * 1e6,
                    kiln_weight_GB_s=nbytes / t_kiln / 1e9,
                    kiln_over_tinygemm=t_kiln / t_tiny,
                    kiln_over_bf16=t_kiln / t_bf16,
                )
            )
            if on_row is not None:  # (as measured: a stage cut at its limit still shows what ran)
                on_row(rows[-1])
        del kiln, tiny, dense
        torch.cuda.empty_cache()
    return rows


HEADER = (
    f"{'shape':8} {'N':>6} {'K':>6} {'M':>3} {'kiln us':>9} {'tinygemm':>9} {'bf16':>9} {'kiln GB/s':>10} "
    f"{'/tinygemm':>10} {'/bf16':>7}"
)


def row_line(r: dict) -> str:
    return (
        f"{r['shape']:8} {r['n']:6d} {r['k']:6d} {r['m']:3d} {r['kiln_us']:9.2f} {r['tinygemm_us']:9.2f} "
        f"{r['bf16_us']:9.2f} {r['kiln_weight_GB_s']:10.0f} {r['kiln_over_tinygemm']:10.3f} "
        f"{r['kiln_over_bf16']:7.3f}"
    )


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m engine.bench.w4a16", description=__doc__.split("\n\n")[0])
    p.add_argument("--cache-dir", type=Path, default=DEFAULT_CACHE_DIR)
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--quick", action="store_true", help="batch 1 only")
    args = p.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("w4a16 bench: no CUDA device", file=sys.stderr)
        return 1
    print(HEADER, flush=True)
    rows = bench(
        args.cache_dir.expanduser(),
        tokens=(1,) if args.quick else TOKENS,
        on_row=lambda r: print(row_line(r), flush=True),
    )
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
