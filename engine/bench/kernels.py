"""`kiln bench kernels [--quick] [--json PATH] [--cache-dir DIR]`: kiln's attention kernels vs torch.

decode : B in {1,16,64,256} x context in {128, 2048, 32768}, 32 q / 8 kv heads, D128, block 16,
         bf16, randomly permuted block tables. KV GB/s and share of the measured device-to-device
         copy bandwidth, beside torch's gather + SDPA (the reference op) and contiguous-cache SDPA.
prefill: causal, D128, 32 heads (and 32/8 GQA), S in {512, 4096, 16384}, batch filling ~16k
         tokens: TFLOP/s (2*2*B*H*S^2*D/2) beside torch SDPA on the same dense inputs.
Timing: CUDA events around CUDA-graph replays of several calls over rotated input copies
(so small cases are not served from L2 and Python launch overhead is not measured).
Only the generation named by --decode-kernel / --prefill-kernel is loaded and timed (default
v1 / mma, the verified ones): a kernel fault is sticky (it ends the CUDA context), so a newer
generation is timed in a process of its own, and only after its GPU tests passed
(tools/gpu_check.sh: stages kernel-bench and kernel-bench-v2); --compare loads both generations
for side-by-side columns. --json is rewritten after every section (copy bandwidth, decode,
sweep, prefill; `complete` false until the end), so a fault halfway keeps the sections before it.
Also runnable as `python -m engine.bench.kernels`.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path

DEFAULT_CACHE_DIR = Path("~/.cache/kiln/kernels")
_OTHER = {"v1": "v2", "v2": "v1", "mma": "wgmma", "wgmma": "mma"}
HQ, HKV, D, BS = 32, 8, 128, 16
L2_ROTATE_BYTES = 256 << 20


def _time_graph(fns, reps: int = 5, calls_per_graph: int | None = None) -> float:
    """Median seconds per call of fns (a list of zero-arg callables, rotated) via graph replay."""
    import torch

    calls = calls_per_graph or len(fns)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for f in fns:
            f()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for i in range(calls):
            fns[i % len(fns)]()
    g.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3 / calls)
    del g
    return statistics.median(times)


def _time(fns, reps: int = 5, calls_per_graph: int | None = None) -> float:
    """_time_graph, or plain eager timing where a baseline cannot be graph-captured."""
    import torch

    try:
        return _time_graph(fns, reps, calls_per_graph)
    except Exception:  # noqa: BLE001 - baseline not capturable: time it eagerly
        torch.cuda.synchronize()
        calls = calls_per_graph or len(fns)
        times = []
        for _ in range(reps):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            for i in range(calls):
                fns[i % len(fns)]()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b) / 1e3 / calls)
        return statistics.median(times)


def copy_bandwidth() -> float:
    """Device-to-device copy, bytes read + written per second.

    Timed eagerly with events: inside a CUDA graph a D2D memcpy becomes a copy-engine node,
    which runs well below the SMs' copy rate and would understate the ceiling.
    """
    import torch

    n = 1 << 30  # 1 GiB each way
    a = torch.empty(n // 2, dtype=torch.bfloat16, device="cuda").normal_()
    b = torch.empty_like(a)
    for _ in range(3):
        b.copy_(a)
    torch.cuda.synchronize()
    times = []
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(10):
            b.copy_(a)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3 / 10)
    return 2 * n / statistics.median(times)


def _paged(batch: int, ctx: int, dtype, copies: int, seed: int = 0):
    import torch

    g = torch.Generator(device="cuda").manual_seed(seed)
    nblk = -(-ctx // BS)
    total = batch * nblk + 1
    sets = []
    for _ in range(copies):
        kv = torch.empty(1, 2, total, BS, HKV, D, dtype=dtype, device="cuda").normal_(generator=g)
        perm = torch.randperm(total - 1, device="cuda", generator=g).to(torch.int32) + 1
        bt = perm[: batch * nblk].view(batch, nblk).contiguous()
        sets.append((kv, bt))  # kv: a one-layer cache [1, 2, blocks, BS, HKV, D]
    return sets


def _decode_case(B: int, ctx: int, dtype, kv_bytes: int, kernels_by_path: dict):
    """One decode shape: rotated paged K/V copies (L2 defeated), a query batch, and the kiln
    decode calls over each copy, per decode path. Returns (sets, q, query_start_loc, seq_lens,
    scale, {path: calls})."""
    import torch

    copies = max(1, min(8, -(-L2_ROTATE_BYTES // kv_bytes)))
    sets = _paged(B, ctx, dtype, copies)
    q = torch.randn(B, HQ, D, dtype=dtype, device="cuda")
    out = torch.empty_like(q)
    qsl = torch.arange(B + 1, dtype=torch.int32, device="cuda")
    lens = torch.full((B,), ctx, dtype=torch.int32, device="cuda")
    scale = 1 / math.sqrt(D)
    fns = {
        path: [
            lambda kv=kv, bt=bt, h=k.handle: torch.ops.kiln.paged_attention_cutlass(
                out, q, kv, 0, qsl, lens, bt, scale, 1, ctx, 0, h
            )
            for kv, bt in sets
        ]
        for path, k in kernels_by_path.items()
    }
    return sets, q, qsl, lens, scale, fns


def bench_decode(kernels_by_path, chosen, batches, ctxs, copy_bw, baselines_max_bytes=4 << 30, max_kv_bytes=40e9):
    """kernels_by_path: {"v1": AttentionKernels, "v2": ...}; `chosen` is the kiln column."""
    import torch
    import torch.nn.functional as F

    from compiler.kernels.reference_attention import paged_attention_reference

    rows = []
    dtype = torch.bfloat16
    for B in batches:
        for ctx in ctxs:
            kv_bytes = B * ctx * HKV * D * 2 * 2
            if kv_bytes > max_kv_bytes:
                continue
            sets, q, qsl, lens, scale, fns = _decode_case(B, ctx, dtype, kv_bytes, kernels_by_path)
            cpg = max(len(sets), 20 if kv_bytes < 1e9 else 4)
            times = {path: _time_graph(f, calls_per_graph=cpg) for path, f in fns.items()}
            t = times[chosen]
            row = {
                "kind": "decode",
                "batch": B,
                "ctx": ctx,
                "kiln_us": t * 1e6,
                "kiln_GBps": kv_bytes / t / 1e9,
                "kiln_copy_share": kv_bytes / t / copy_bw,
                "v1_us": times.get("v1", math.nan) * 1e6,
                "v2_us": times.get("v2", math.nan) * 1e6,
                "path": chosen,
                "splits": {
                    p: k.decode_plan(B, HQ, HKV, sets[0][1].shape[1]).splits for p, k in kernels_by_path.items()
                },
            }
            if kv_bytes <= baselines_max_bytes:
                kv, bt = sets[0]
                kc, vc = kv[0, 0], kv[0, 1]
                tr = _time(
                    [lambda: paged_attention_reference(q, kc, vc, qsl, lens, bt, scale, 1, ctx)], calls_per_graph=3
                )
                kd = torch.randn(B, HKV, ctx, D, dtype=dtype, device="cuda")
                vd = torch.randn_like(kd)
                qd = q.view(B, HKV, HQ // HKV, D)  # a kv group's query heads as rows: plain MHA SDPA
                ts = _time([lambda: F.scaled_dot_product_attention(qd, kd, vd, scale=scale)], calls_per_graph=5)
                row.update(
                    ref_us=tr * 1e6, ref_GBps=kv_bytes / tr / 1e9, sdpa_us=ts * 1e6, sdpa_GBps=kv_bytes / ts / 1e9
                )
                del kd, vd
            rows.append(row)
            del sets
            torch.cuda.empty_cache()
    return rows


def bench_decode_sweep(
    kernels, copy_bw, batches=(1, 16, 64), ctx=2048, min_tokens=(32, 64, 128, 256, 512), ctas_per_sm=(1, 2, 3, 4, 8)
):
    """v2 decode time per (tokens-per-split, CTAs-per-SM) policy setting (`kernels`: the v2 ones)."""
    import torch

    rows = []
    dtype = torch.bfloat16
    for B in batches:
        kv_bytes = B * ctx * HKV * D * 2 * 2
        sets, q, qsl, lens, scale, fns = _decode_case(B, ctx, dtype, kv_bytes, {"v2": kernels})
        fns = fns["v2"]
        try:
            for mt in min_tokens:
                for cps in ctas_per_sm:
                    kernels.decode_min_tokens, kernels.decode_ctas_per_sm = mt, cps
                    splits = kernels.decode_plan(B, HQ, HKV, sets[0][1].shape[1]).splits
                    t = _time_graph(fns, calls_per_graph=max(len(fns), 20))
                    rows.append(
                        {
                            "kind": "decode_sweep",
                            "batch": B,
                            "ctx": ctx,
                            "min_tokens": mt,
                            "ctas_per_sm": cps,
                            "splits": splits,
                            "us": t * 1e6,
                            "GBps": kv_bytes / t / 1e9,
                            "copy_share": kv_bytes / t / copy_bw,
                        }
                    )
        finally:
            kernels.decode_min_tokens = kernels.decode_ctas_per_sm = None
        del sets
        torch.cuda.empty_cache()
    return rows


def bench_prefill(kernels_by_path, chosen, seq_lens, head_cfgs, tokens=16384):
    """kernels_by_path: {"mma": AttentionKernels, "wgmma": ...}; `chosen` is the kiln column."""
    import torch
    import torch.nn.functional as F

    rows = []
    dtype = torch.bfloat16
    for hq, hkv in head_cfgs:
        for S in seq_lens:
            B = max(1, tokens // S)
            flops = 4 * B * hq * S * S * D / 2
            g = torch.Generator(device="cuda").manual_seed(S)
            nblk = -(-S // BS)
            total = B * nblk + 1
            kv = torch.empty(1, 2, total, BS, hkv, D, dtype=dtype, device="cuda").normal_(generator=g)
            kc, vc = kv[0, 0], kv[0, 1]
            bt = (
                (torch.randperm(total - 1, device="cuda", generator=g).to(torch.int32) + 1)[: B * nblk]
                .view(B, nblk)
                .contiguous()
            )
            q = torch.randn(B * S, hq, D, dtype=dtype, device="cuda")
            out = torch.empty_like(q)
            qsl = torch.arange(B + 1, dtype=torch.int32, device="cuda") * S
            lens = torch.full((B,), S, dtype=torch.int32, device="cuda")
            scale = 1 / math.sqrt(D)
            times = {}
            for path, k in kernels_by_path.items():
                fn = [
                    lambda h=k.handle, out=out, q=q, kv=kv: torch.ops.kiln.paged_attention_cutlass(
                        out, q, kv, 0, qsl, lens, bt, scale, S, S, 0, h
                    )
                ]
                try:
                    times[path] = _time_graph(fn, calls_per_graph=3)
                except Exception as e:  # noqa: BLE001 - report, keep benchmarking the rest
                    print(f"{path} prefill failed: {e}", file=sys.stderr)
                    times[path] = float("nan")
            t_mma, t_wg, t = times.get("mma", math.nan), times.get("wgmma", math.nan), times[chosen]
            qd = q.view(B, S, hq, D).transpose(1, 2).contiguous()
            # dense K/V with the kv heads expanded to hq (same FLOPs; SDPA's flash path takes it)
            kd = torch.randn(B, hkv, S, D, dtype=dtype, device="cuda").repeat_interleave(hq // hkv, dim=1)
            vd = torch.randn_like(kd)
            ts = _time(
                [lambda qd=qd, kd=kd, vd=vd: F.scaled_dot_product_attention(qd, kd, vd, is_causal=True, scale=scale)],
                calls_per_graph=3,
            )
            rows.append(
                {
                    "kind": "prefill",
                    "heads": f"{hq}/{hkv}",
                    "batch": B,
                    "seq": S,
                    "kiln_ms": t * 1e3,
                    "kiln_TFLOPs": flops / t / 1e12,
                    "mma_TFLOPs": flops / t_mma / 1e12,
                    "wgmma_TFLOPs": flops / t_wg / 1e12,
                    "sdpa_ms": ts * 1e3,
                    "sdpa_TFLOPs": flops / ts / 1e12,
                }
            )
            del kv, kc, vc, q, out, qd, kd, vd
            torch.cuda.empty_cache()
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="kiln bench kernels")
    p.add_argument("--quick", action="store_true", help="fewer shapes (skips the 32k-context large batches)")
    p.add_argument("--json", type=Path, default=None, help="also write the results as JSON here")
    p.add_argument("--cache-dir", type=Path, default=DEFAULT_CACHE_DIR)
    p.add_argument(
        "--sweep",
        action="store_true",
        help="also sweep the v2 decode split policy (tokens per split x CTAs per SM), B 1/16/64, ctx 2048",
    )
    p.add_argument(
        "--decode-kernel",
        choices=("v1", "v2"),
        default="v1",
        help="the decode generation timed (the decode_kernel setting; default v1)",
    )
    p.add_argument(
        "--prefill-kernel",
        choices=("mma", "wgmma"),
        default="mma",
        help="the prefill generation timed (the prefill_kernel setting; default mma)",
    )
    p.add_argument(
        "--compare",
        action="store_true",
        help="also load and time the other generations (v1/v2, mma/wgmma columns) in this process",
    )
    args = p.parse_args(argv if argv is not None else sys.argv[1:])

    import torch

    if not torch.cuda.is_available():
        print("kiln bench kernels: needs a CUDA GPU", file=sys.stderr)
        return 2
    from compiler.kernels import cutlass_ops
    from compiler.kernels.build import build_kernels, find_nvcc
    from compiler.kernels.loader import missing_variants

    cache = args.cache_dir.expanduser()
    missing = missing_variants(cache, cutlass_ops.required_variants(torch.bfloat16, D, BS))
    if missing and find_nvcc() is not None:
        build_kernels(cache, missing, progress=False)
    chosen = cutlass_ops.AttentionKernels(
        cache, "cuda", torch.bfloat16, D, BS, decode_kernel=args.decode_kernel, prefill_kernel=args.prefill_kernel
    )
    decode_by_path, prefill_by_path = {args.decode_kernel: chosen}, {args.prefill_kernel: chosen}
    if args.compare:
        other = cutlass_ops.AttentionKernels(
            cache,
            "cuda",
            torch.bfloat16,
            D,
            BS,
            decode_kernel=_OTHER[args.decode_kernel],
            prefill_kernel=_OTHER[args.prefill_kernel],
        )
        decode_by_path[_OTHER[args.decode_kernel]] = other
        prefill_by_path[_OTHER[args.prefill_kernel]] = other
    result = {
        "decode_kernel": args.decode_kernel,
        "prefill_kernel": args.prefill_kernel,
        "backend": "cutlass",
        "timing": "CUDA-graph replay",
        "device": torch.cuda.get_device_name(),
        "complete": False,
    }

    def write() -> None:
        if args.json:
            tmp = args.json.with_name(args.json.name + ".tmp")
            tmp.write_text(json.dumps(result, indent=1))
            tmp.replace(args.json)

    t0 = time.perf_counter()
    bw = copy_bandwidth()
    result["copy_GBps"] = bw / 1e9
    write()
    print(f"device: {torch.cuda.get_device_name()}  copy bandwidth {bw / 1e9:.0f} GB/s (read+write)")
    batches = [1, 16, 64, 256]
    ctxs = [128, 2048, 32768]
    dec = bench_decode(
        decode_by_path, args.decode_kernel, batches, ctxs, bw, max_kv_bytes=(5e9 if args.quick else 40e9)
    )
    result["decode"] = dec
    write()
    print("\ndecode (32q/8kv, D128, block 16, bf16)")
    print(
        f"kiln = decode {args.decode_kernel} (--decode-kernel); v1/v2 columns: both paths; occupancy "
        f"(CTAs/SM by group) " + ", ".join(f"{p} {k.occupancy}" for p, k in decode_by_path.items())
    )
    print(
        f"{'B':>4} {'ctx':>6} | {'kiln us':>9} {'GB/s':>7} {'%copy':>6} | {'v1 us':>7} {'v2 us':>7} | "
        f"{'gather+sdpa':>11} {'GB/s':>6} | {'contig sdpa':>11} {'GB/s':>6} | {'x ref':>6} {'x sdpa':>6}"
    )
    for r in dec:
        extra = ""
        if "ref_us" in r:
            extra = (
                f"{r['ref_us']:11.1f} {r['ref_GBps']:6.0f} | {r['sdpa_us']:11.1f} {r['sdpa_GBps']:6.0f} | "
                f"{r['ref_us'] / r['kiln_us']:6.2f} {r['sdpa_us'] / r['kiln_us']:6.2f}"
            )
        else:
            extra = f"{'(skipped: KV too big for baselines)':>40}"
        print(
            f"{r['batch']:>4} {r['ctx']:>6} | {r['kiln_us']:9.1f} {r['kiln_GBps']:7.0f} "
            f"{100 * r['kiln_copy_share']:5.1f}% | "
            f"{r['v1_us']:7.1f} {r['v2_us']:7.1f} | {extra}"
        )
    sweep = []
    if args.sweep and "v2" in decode_by_path:
        sweep = bench_decode_sweep(decode_by_path["v2"], bw)
        result["decode_sweep"] = sweep
        write()
        print("\ndecode v2 split-policy sweep (32q/8kv, D128, block 16, bf16, ctx 2048)")
        print(f"{'B':>4} {'min_tok':>7} {'ctas/SM':>7} {'splits':>6} | {'us':>8} {'GB/s':>7} {'%copy':>6}")
        best = {}
        for r in sweep:
            print(
                f"{r['batch']:>4} {r['min_tokens']:>7} {r['ctas_per_sm']:>7} {r['splits']:>6} | {r['us']:8.1f} "
                f"{r['GBps']:7.0f} {100 * r['copy_share']:5.1f}%"
            )
            if r["batch"] not in best or r["us"] < best[r["batch"]]["us"]:
                best[r["batch"]] = r
        for b, r in best.items():
            print(
                f"best B={b}: min tokens per split {r['min_tokens']}, CTAs per SM {r['ctas_per_sm']} "
                f"({r['us']:.1f} us, {r['GBps']:.0f} GB/s)"
            )
    pre = bench_prefill(
        prefill_by_path, args.prefill_kernel, [512, 4096] if args.quick else [512, 4096, 16384], [(32, 32), (32, 8)]
    )
    result["prefill"] = pre
    write()
    print("\nprefill (causal, D128, bf16)")
    print(f"kiln = prefill {args.prefill_kernel} (--prefill-kernel); mma/wgmma columns: TFLOP/s of both paths")
    print(
        f"{'heads':>6} {'B':>3} {'S':>6} | {'kiln ms':>8} {'TFLOP/s':>8} | {'mma':>6} {'wgmma':>6} | "
        f"{'sdpa ms':>8} {'TFLOP/s':>8} | {'kiln/sdpa':>9}"
    )
    for r in pre:
        print(
            f"{r['heads']:>6} {r['batch']:>3} {r['seq']:>6} | {r['kiln_ms']:8.3f} {r['kiln_TFLOPs']:8.1f} | "
            f"{r['mma_TFLOPs']:6.1f} {r['wgmma_TFLOPs']:6.1f} | "
            f"{r['sdpa_ms']:8.3f} {r['sdpa_TFLOPs']:8.1f} | {r['kiln_TFLOPs'] / r['sdpa_TFLOPs']:9.2f}"
        )
    print(f"\n(bench took {time.perf_counter() - t0:.1f} s)")
    result.update(prefill=pre, complete=True, seconds=time.perf_counter() - t0)
    write()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
