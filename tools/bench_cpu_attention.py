"""CPU attention at `kiln bench throughput`'s shapes: the C++ kernel (compiler/kernels/cpu_attention.py)
against the gather + SDPA reference, and optionally against an older implementation, in one run.

    PYTHONPATH=$PWD python tools/bench_cpu_attention.py [--old-module FILE] [--threads N] [--reps N]
        [--dtype bfloat16] [--layers 30]

Shapes: the tiny llama (4 query heads, 2 KV heads, head dim 32, block 16, float32; --heads 9,3,64 for
SmolLM2-135M's): decode
batches of 1, 16 and 64 rows with contexts drawn from 16..128 (prompt 16..64 + up to 64 outputs),
and the bench's prefill step (64 prompts of 16..64 tokens, ~2600 tokens). --old-module: a Python
file with an older `paged_attention_cpu_impl` (same arguments), e.g. the AOTInductor kernel:
    git show 06add57:compiler/kernels/cpu_attention.py > /tmp/old_cpu_attention.py
--dtype: the cache's and queries' dtype (default float32). --layers N: a cache of N layers, the calls
cycling through them (with 30, SmolLM2's batch-64 cache no longer fits the caches: cold, as in a
decode step, where a layer's cache was last read a step ago).
Each case prints the median µs of one layer's attention call and ratios against the C++ kernel
(then the same for the step's K/V cache write);
the calls of the implementations are interleaved so load on a shared machine hits them alike.
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import sys
import time

import torch

from compiler.kernels.cpu_attention import paged_attention_cpu_impl, write_kv_cpu_impl
from compiler.kernels.reference_attention import paged_attention_reference, write_kv_reference

HQ, HKV, D, BS = 4, 2, 32, 16  # (the default --heads)


def cases(g: torch.Generator):
    """(name, q_lens, seq_lens) of the bench's steps."""
    for batch in (1, 16, 64):
        lens = torch.randint(16, 129, (batch,), generator=g).tolist()
        yield f"decode batch {batch:2d} ctx 16..128", [1] * batch, lens
    for ctx in (16, 128):
        yield f"decode batch 64 ctx {ctx}", [1] * 64, [ctx] * 64
    prompts = torch.randint(16, 65, (64,), generator=g).tolist()
    yield f"prefill 64 prompts, {sum(prompts)} tokens", prompts, prompts


def inputs(g, q_lens, lens, hq=HQ, hkv=HKV, d=D, dtype=torch.float32, layers=1):
    width = max(-(-n // BS) for n in lens)
    blocks = sum(-(-n // BS) for n in lens) + 1
    kv = torch.randn(layers, 2, blocks, BS, hkv, d, generator=g).to(dtype)
    ids = (torch.randperm(blocks - 1, generator=g) + 1).tolist()
    tables = torch.zeros(len(lens), width, dtype=torch.int32)
    for row, n in enumerate(lens):
        for c in range(-(-n // BS)):
            tables[row, c] = ids.pop()
    qsl = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32)
    q = torch.randn(int(qsl[-1]), hq, d, generator=g).to(dtype)
    return q, kv, qsl, torch.tensor(lens, dtype=torch.int32), tables


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--old-module", help="a file with an older paged_attention_cpu_impl to compare")
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    p.add_argument("--reps", type=int, default=200)
    p.add_argument("--heads", default=f"{HQ},{HKV},{D}", help="query heads, KV heads, head dim (default %(default)s)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--layers", type=int, default=1, help="layers in the cache, cycled through (default 1)")
    args = p.parse_args()
    hq, hkv, d = (int(v) for v in args.heads.split(","))
    dtype = getattr(torch, args.dtype)
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    torch.set_num_threads(args.threads)
    impls = {"C++ kernel": paged_attention_cpu_impl}
    if args.old_module:
        spec = importlib.util.spec_from_file_location("old_cpu_attention", args.old_module)
        old = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = old  # inspect.getsource (the old kernel's cache key) looks it up there
        spec.loader.exec_module(old)
        impls["old"] = old.paged_attention_cpu_impl

    def reference(out, q, kv, layer, qsl, lens, tables, scale, max_q, max_len, nd):
        out.copy_(
            paged_attention_reference(
                q.float(), kv[layer, 0].float(), kv[layer, 1].float(), qsl, lens, tables, scale, max_q, max_len, nd
            )
        )

    impls["reference"] = reference
    g = torch.Generator().manual_seed(0)
    print(
        f"one layer's attention, {hq} q heads / {hkv} kv heads, head dim {d}, block {BS}, {args.dtype}, "
        f"{args.layers} layer(s) cycled, {args.threads} threads, median µs of {args.reps} interleaved calls"
    )
    with torch.inference_mode():
        for name, q_lens, lens in cases(g):
            q, kv, qsl, seq_lens, tables = inputs(g, q_lens, lens, hq, hkv, d, dtype, args.layers)
            nd = sum(1 for n in q_lens if n == 1) if max(q_lens) > 1 else len(q_lens)
            rest = (qsl, seq_lens, tables, d**-0.5, max(q_lens), max(lens), nd)
            outs = {k: torch.empty_like(q) for k in impls}
            times: dict[str, list[float]] = {k: [] for k in impls}
            for i in range(args.reps + 5):
                for k, fn in impls.items():
                    if k == "reference" and i % 10:
                        continue  # the reference is slow: a tenth of the calls is enough for a median
                    layer = i % args.layers
                    t0 = time.perf_counter()
                    fn(outs[k], q, kv, layer, *rest)
                    if i >= 5:
                        times[k].append(time.perf_counter() - t0)
            for k, fn in impls.items():
                fn(outs[k], q, kv, 0, *rest)
            for k in impls:
                torch.testing.assert_close(outs[k].float(), outs["reference"].float(), rtol=tol, atol=tol)
            med = {k: statistics.median(v) * 1e6 for k, v in times.items()}
            base = med["C++ kernel"]
            parts = "  ".join(f"{k} {us:8.1f} µs ({us / base:5.2f}x)" for k, us in med.items())
            print(f"  {name:34s} {parts}")
            # The same step's cache write: one C++ call against the reference's torch ops.
            k, v = torch.randn(q.shape[0], hkv, d, generator=g), torch.randn(q.shape[0], hkv, d, generator=g)
            slots = torch.randperm(kv.shape[2] * BS, generator=g)[: q.shape[0]]
            writes = {
                "C++ write_kv": lambda: write_kv_cpu_impl(k, v, kv, 0, slots),
                "reference": lambda: write_kv_reference(k, v, kv[0, 0], kv[0, 1], slots),
            }
            wt: dict[str, list[float]] = {w: [] for w in writes}
            for i in range(args.reps + 5):
                for w, fn in writes.items():
                    t0 = time.perf_counter()
                    fn()
                    if i >= 5:
                        wt[w].append(time.perf_counter() - t0)
            wmed = {w: statistics.median(x) * 1e6 for w, x in wt.items()}
            parts = "  ".join(f"{w} {us:8.1f} µs ({us / wmed['C++ write_kv']:5.2f}x)" for w, us in wmed.items())
            print(f"  {'  its K/V write':34s} {parts}")


if __name__ == "__main__":
    main()
