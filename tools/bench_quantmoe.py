"""Quantised MoE experts and int4 on float32 CPU models, each against its baseline in the same run.

    PYTHONPATH=. python tools/bench_quantmoe.py [--part linear|moe|all] [--iters 20] [--threads 2]

linear: one int4 layer (group 128) of a float32 model at batch 1/16/128, three ways: the float32
  reference (dequantise on the fly, int4_kernel=auto/reference), the packed kernel with bf16
  activations (int4_kernel=packed) and the dense float32 matmul of the same weights.
moe: one MoE layer's routed experts (E=8, top-2, H=1024, I=2816: Mixtral's proportions at a
  quarter width) in float32: dense float32 experts (kiln::moe_experts), quantised experts
  (engine/quant/moe.py, dequantised on the fly: int4 g128, int8 per channel, fp8; and int4 on
  torch's packed kernel with bf16 activations, int4_kernel=packed) and, as the baseline for
  "only the chosen experts", the same quantised experts with every expert dequantised each call.
Prints median ms per call and the ratios. Random weights: the values do not change the speed.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from compiler.moe import moe_experts_dense
from engine.quant import int4_packed
from engine.quant.config import QuantConfig
from engine.quant.linear import FP8, IntWeightMethod, make_method
from engine.quant.moe import QuantExperts, routed_experts


def _median_ms(fn, iters: int) -> float:
    fn()
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def _int4_layer(out: int, inp: int) -> torch.nn.Linear:
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


@torch.no_grad()
def bench_linear(iters: int) -> None:
    print("int4 linear, float32 model: ms per call (reference | packed bf16-acts | dense fp32), ratios")
    for out, inp in ((2048, 2048), (5632, 2048), (2048, 5632)):
        ref = _int4_layer(out, inp)
        packed = _int4_layer(out, inp)
        packed.load_state_dict(ref.state_dict())
        dense_w = ref.quant.weight(ref, torch.float32)
        assert int4_packed.repack(packed, int4_packed.kernel_dtype(torch.float32, "packed")) is None
        for batch in (1, 16, 128):
            x = torch.randn(batch, inp)
            t_ref = _median_ms(lambda: ref.quant.apply(ref, x), iters)
            t_packed = _median_ms(lambda: packed.quant.apply(packed, x), iters)
            t_dense = _median_ms(lambda: F.linear(x, dense_w), iters)
            err = (packed.quant.apply(packed, x) - F.linear(x, dense_w)).abs().max() / F.linear(x, dense_w).abs().max()
            print(f"  {out}x{inp} T={batch:<4} ref {t_ref:8.3f}  packed {t_packed:7.3f}  dense {t_dense:7.3f}  "
                  f"ref/packed {t_ref / t_packed:6.1f}x  dense/packed {t_dense / t_packed:5.2f}x  rel.err {err:.1e}")


def _experts(kind: str, out: int, inp: int, e: int, gen) -> QuantExperts:
    config = {"int4": QuantConfig("int", "gptq", 4, 128), "int8": QuantConfig("int", "gptq", 8, -1),
              "fp8": QuantConfig("fp8", "ct", 8)}[kind]
    m = QuantExperts(e, out, inp, make_method(config), "cpu")
    if kind == "fp8":
        m.weight_fp8.copy_(torch.randn(m.weight_fp8.shape, generator=gen).to(FP8))
        m.weight_scale.fill_(0.01)
    else:
        m.qweight.random_(0, 256, generator=gen)
        m.zeros.fill_(1 << (config.bits - 1))
        m.scales.fill_(0.002)
    return m


@torch.no_grad()
def bench_moe(iters: int) -> None:
    e, k, h, i = 8, 2, 1024, 2816
    gen = torch.Generator().manual_seed(0)
    print(f"MoE experts E={e} top-{k} H={h} I={i}, float32: ms per call; ratios against dense float32 experts")
    dense13 = torch.randn(e, 2 * i, h, generator=gen) * 0.02
    dense2 = torch.randn(e, h, i, generator=gen) * 0.02
    quant = {kind: (_experts(kind, 2 * i, h, e, gen), _experts(kind, h, i, e, gen)) for kind in ("int4", "int8", "fp8")}
    packed = (_experts("int4", 2 * i, h, e, gen), _experts("int4", h, i, e, gen))
    for w in packed:  # int4_kernel="packed": torch's int4 CPU kernel, bf16 activations
        w.repack(int4_packed.kernel_dtype(torch.float32, "packed"))
    for tokens in (1, 3, 16):
        x = torch.randn(tokens, h, generator=gen)
        ids = torch.stack([torch.randperm(e, generator=gen)[:k] for _ in range(tokens)])
        weights = torch.rand(tokens, k, generator=gen)
        t_dense = _median_ms(lambda: torch.ops.kiln.moe_experts(x, weights, ids, dense13, dense2, "silu"), iters)
        line = f"  T={tokens:<3} dense fp32 {t_dense:7.2f}"
        for kind, (w13, w2) in quant.items():
            t_q = _median_ms(lambda: routed_experts(w13, w2, x, weights, ids, "silu"), iters)
            t_all = _median_ms(lambda: moe_experts_dense(x, weights, ids, w13.weight(None, x.dtype),
                                                         w2.weight(None, x.dtype), "silu"), iters)
            line += (f" | {kind} {t_q:7.2f} (all experts {t_all:7.2f}: {t_all / t_q:4.1f}x; "
                     f"vs dense {t_dense / t_q:4.2f}x)")
        t_packed = _median_ms(lambda: routed_experts(*packed, x, weights, ids, "silu"), iters)
        line += f" | int4 packed {t_packed:7.2f} (vs dense {t_dense / t_packed:5.2f}x)"
        print(line)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--part", choices=("linear", "moe", "all"), default="all")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    if args.part in ("linear", "all"):
        bench_linear(args.iters)
    if args.part in ("moe", "all"):
        bench_moe(args.iters)


if __name__ == "__main__":
    main()
