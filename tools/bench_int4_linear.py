"""One int4 linear layer, three ways, at decode shapes, in one process: bf16 dense F.linear (the
baseline), torch's packed int4 kernel (kiln's int4 path) and dequantise-on-the-fly (the reference
fallback). Prints the median ms per call (bf16 and packed calls interleaved) and the ratios to bf16.

    PYTHONPATH=. python tools/bench_int4_linear.py [--shapes 8b|1b] [--batch 1,8] [--iters 20]

Shapes: the Llama-3.1-8B (or 3.2-1B) projections as kiln fuses them: q/k/v, o, gate/up, down.
Weights: random levels, group 128, symmetric (the values do not change the speed).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from engine.layers.quant import int4_packed
from engine.layers.quant.config import QuantConfig
from engine.layers.quant.linear import IntWeightMethod

SHAPES = {
    "8b": [("qkv", 6144, 4096), ("o", 4096, 4096), ("gate_up", 28672, 4096), ("down", 4096, 14336)],
    "1b": [("qkv", 3072, 2048), ("o", 2048, 2048), ("gate_up", 16384, 2048), ("down", 2048, 8192)],
}


def _layer(out: int, inp: int, dtype: torch.dtype) -> torch.nn.Linear:
    m = torch.nn.Linear(inp, out, bias=False)
    del m.weight
    m.register_parameter("weight", None)
    method = IntWeightMethod(QuantConfig("int", "gptq", 4, 128))
    method.create(m, "cpu")
    m.quant = method
    m.qweight.random_(0, 256)
    m.zeros.fill_(8)
    m.scales.fill_(0.002)
    return m


def _times(fns: dict, iters: int) -> dict[str, float]:
    """Median ms per call of each function, the calls interleaved (a busy neighbour slows all alike)."""
    for fn in fns.values():
        fn()
    samples: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(iters):
        for k, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            samples[k].append((time.perf_counter() - t0) * 1e3)
    return {k: statistics.median(v) for k, v in samples.items()}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--shapes", choices=SHAPES, default="8b")
    p.add_argument("--batch", default="1")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--reference-iters", type=int, default=2)
    args = p.parse_args()
    dtype = torch.bfloat16
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, bf16 activations, group 128")
    totals = {}
    for batch in (int(b) for b in args.batch.split(",")):
        for name, out, inp in SHAPES[args.shapes]:
            ref = _layer(out, inp, dtype)
            dense = ref.quant.weight(ref, dtype)
            packed = _layer(out, inp, dtype)
            packed.qweight.copy_(ref.qweight)
            assert int4_packed.repack(packed, dtype) is None
            x = torch.randn(batch, inp, dtype=dtype)
            with torch.inference_mode():
                t = _times(
                    {
                        "bf16": lambda x=x, dense=dense: F.linear(x, dense),
                        "packed": lambda x=x, packed=packed: packed.quant.apply(packed, x),
                    },
                    args.iters,
                )
                t_bf16, t_packed = t["bf16"], t["packed"]
                t_ref = _times({"ref": lambda x=x, ref=ref: ref.quant.apply(ref, x)}, args.reference_iters)["ref"]
            for k, v in (("bf16", t_bf16), ("packed", t_packed), ("reference", t_ref)):
                totals[(batch, k)] = totals.get((batch, k), 0.0) + v
            print(
                f"batch {batch} {name:8s} [{out}x{inp}]: bf16 {t_bf16:8.3f} ms, int4 packed {t_packed:8.3f} ms "
                f"({t_packed / t_bf16:.2f}x bf16), reference {t_ref:9.2f} ms ({t_ref / t_bf16:.1f}x bf16, "
                f"{t_ref / t_packed:.0f}x packed)"
            )
            del ref, dense, packed
        b, pk, rf = totals[(batch, "bf16")], totals[(batch, "packed")], totals[(batch, "reference")]
        print(
            f"batch {batch} one layer's projections: bf16 {b:.2f} ms, int4 packed {pk:.2f} ms = {pk / b:.2f}x bf16; "
            f"reference {rf:.1f} ms = {rf / b:.1f}x bf16 = {rf / pk:.0f}x packed"
        )


if __name__ == "__main__":
    main()
