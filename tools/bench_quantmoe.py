"""Quantised MoE experts and int4 on float32 CPU models, each against its baseline in the same run.

    PYTHONPATH=. python tools/bench_quantmoe.py [--part linear|moe|all] [--iters 20] [--threads 2]

linear: one int4 layer (group 128) of a float32 model at batch 1/16/128, three ways: the float32
  reference (dequantise on the fly, int4_kernel=auto/reference), the packed kernel with bf16
  activations (int4_kernel=packed) and the dense float32 matmul of the same weights.
moe: one MoE layer's routed experts (E=8, top-2, H=1024, I=2816: Mixtral's proportions at a
  quarter width) in float32: dense float32 experts (kiln::moe_experts), quantised experts
  (engine/layers/quant/moe.py, dequantised on the fly: int4 g128, int8 per channel, fp8; and int4 on
  torch's packed kernel with bf16 activations, int4_kernel=packed) and, as the baseline for
  "only the chosen experts", the same quantised experts with every expert dequantised each call.
Prints median ms per call and the ratios. Random weights: the values do not change the speed.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from compiler.kernels.moe import moe_experts_dense
from engine.layers.quant import int4_packed
from engine.layers.quant.config import QuantConfig
from engine.layers.quant.linear import FP8, make_method
from engine.layers.quant.moe import QuantExperts, routed_experts
from tools.bench_int4_linear import _layer as _int4_layer
from tools.bench_int4_linear import _times


def _medians_ms(fns: list, iters: int) -> list[float]:
    """Median ms per call of each function, their calls interleaved (the machine is shared)."""
    return list(_times(dict(enumerate(fns)), iters).values())


@torch.no_grad()
def bench_linear(iters: int) -> None:
    print("int4 linear, float32 model: ms per call (reference | packed bf16-acts | dense fp32), ratios")
    for out, inp in ((2048, 2048), (5632, 2048), (2048, 5632)):
        ref = _int4_layer(out, inp, torch.float32)
        packed = _int4_layer(out, inp, torch.float32)
        packed.load_state_dict(ref.state_dict())
        dense_w = ref.quant.weight(ref, torch.float32)
        assert int4_packed.repack(packed, int4_packed.kernel_dtype(torch.float32, "packed")) is None
        for batch in (1, 16, 128):
            x = torch.randn(batch, inp)
            t_ref, t_packed, t_dense = _medians_ms(
                [lambda: ref.quant.apply(ref, x), lambda: packed.quant.apply(packed, x), lambda: F.linear(x, dense_w)],
                iters,
            )
            err = (packed.quant.apply(packed, x) - F.linear(x, dense_w)).abs().max() / F.linear(x, dense_w).abs().max()
            print(
                f"  {out}x{inp} T={batch:<4} ref {t_ref:8.3f}  packed {t_packed:7.3f}  dense {t_dense:7.3f}  "
                f"ref/packed {t_ref / t_packed:6.1f}x  dense/packed {t_dense / t_packed:5.2f}x  rel.err {err:.1e}"
            )


def _experts(kind: str, out: int, inp: int, e: int, gen) -> QuantExperts:
    config = {
        "int4": QuantConfig("int", "gptq", 4, 128),
        "int8": QuantConfig("int", "gptq", 8, -1),
        "fp8": QuantConfig("fp8", "ct", 8),
    }[kind]
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
        fns = [
            lambda: torch.ops.kiln.moe_experts(x, weights, ids, dense13, dense2, "silu"),
            lambda: routed_experts(*packed, x, weights, ids, "silu"),
        ]
        for w13, w2 in quant.values():
            fns.append(lambda w13=w13, w2=w2: routed_experts(w13, w2, x, weights, ids, "silu"))
            fns.append(
                lambda w13=w13, w2=w2: moe_experts_dense(
                    x, weights, ids, w13.weight(None, x.dtype), w2.weight(None, x.dtype), "silu"
                )
            )
        t_dense, t_packed, *rest = _medians_ms(fns, iters)
        print(
            f"  T={tokens:<3} dense fp32 {t_dense:8.2f} | int4 packed {t_packed:8.2f} "
            f"(dense/packed {t_dense / t_packed:5.2f}x)"
        )
        for kind, t_q, t_all in zip(quant, rest[0::2], rest[1::2]):
            print(
                f"        {kind} dequantised {t_q:8.2f} (dense/it {t_dense / t_q:4.2f}x; every expert dequantised "
                f"{t_all:8.2f}: {t_all / t_q:4.1f}x slower)"
            )


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
