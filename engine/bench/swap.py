"""`kiln bench swap`: GB/s of swap_blocks (GPU <-> pinned CPU KV blocks) vs a plain pinned copy.

For each block count (default 1 and 512) it times, on the side stream with events exactly as
the engine runs it (BlockSwapper.launch + wait), moving that many randomly placed GPU blocks
out to the CPU pool and back in (into consecutive CPU slots, and into scattered ones), and a plain `copy_` of
the same number of bytes between one
contiguous device buffer and one pinned host buffer, in the same run. Before timing, it
checks that the moved blocks arrive bit-exact, and that a write queued on the compute stream
right after a swap-out (what the next step's forward does to a freed block) does not reach
the CPU copy. Exit status 1 if a check fails. `--json PATH` is rewritten after the check and
after every row (`complete` false until the end), so a run cut off halfway keeps what it measured.

Default shape on a GPU: an 8B-model KV (32 layers, 8 kv heads, head_dim 128, block 16, bf16:
2 MiB a block). On the CPU: a tiny shape (2 layers, 2 kv heads, head_dim 32, float32).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time

from engine.config.process_setup import prepare_process

# An entry point (`python -m engine.bench.swap`, as tools/gpu_check.sh runs it): before torch loads.
prepare_process()

import torch  # noqa: E402

from engine.worker.block_swapper import BlockSwapper  # noqa: E402

_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def _parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="kiln bench swap", description=__doc__.split("\n")[0])
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument("--layers", type=int, default=None)
    p.add_argument("--kv-heads", type=int, default=None)
    p.add_argument("--head-dim", type=int, default=None)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--dtype", default=None, choices=list(_DTYPES))
    p.add_argument("--blocks", default="1,512", help="comma-separated block counts per swap")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--staging-mb", type=int, default=128, help="device staging buffer (MiB)")
    p.add_argument(
        "--json",
        nargs="?",
        const="-",
        default=None,
        metavar="PATH",
        help="write the results as one JSON object to PATH (no PATH: print it instead of the table)",
    )
    return p.parse_args(argv)


class _Timer:
    """Wall time of a batch of queued GPU work (events on the current stream) or of CPU work."""

    def __init__(self, cuda: bool) -> None:
        self.cuda = cuda

    def __call__(self, fn, iters: int) -> float:
        times = []
        for _ in range(iters):
            if self.cuda:
                torch.cuda.synchronize()
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end) / 1e3)
            else:
                t0 = time.perf_counter()
                fn()
                times.append(time.perf_counter() - t0)
        return statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    args = _parse(list(sys.argv[1:] if argv is None else argv))
    device = torch.device(
        "cuda"
        if args.device == "auto" and torch.cuda.is_available()
        else ("cpu" if args.device == "auto" else args.device)
    )
    cuda = device.type == "cuda"
    layers = args.layers or (32 if cuda else 2)
    heads = args.kv_heads or (8 if cuda else 2)
    dim = args.head_dim or (128 if cuda else 32)
    dtype = _DTYPES[args.dtype or ("bfloat16" if cuda else "float32")]
    counts = [int(x) for x in args.blocks.split(",") if x]
    most = max(counts)
    t_start = time.perf_counter()

    num_gpu_blocks = most + 8
    cache = torch.empty(layers, 2, num_gpu_blocks, args.block_size, heads, dim, dtype=dtype, device=device)
    if dtype.is_floating_point:
        cache.normal_()
    swapper = BlockSwapper(cache, num_cpu_blocks=most, staging_bytes=args.staging_mb << 20)
    per_block = swapper.bytes_per_block
    rng = random.Random(0)
    ok = True

    # ---- correctness and ordering first ----
    src = rng.sample(range(num_gpu_blocks), most)
    expect = cache[:, :, src].clone()
    swapper.launch([(g, c) for c, g in enumerate(src)], [])
    swapper.wait()
    cache.zero_()  # queued on the compute stream: must run after the swap-out has read the blocks
    dst = rng.sample(range(num_gpu_blocks), most)
    swapper.launch([], [(c, g) for c, g in enumerate(dst)])
    swapper.wait()
    got = cache[:, :, dst]
    if cuda:
        torch.cuda.synchronize()
    if not torch.equal(got, expect):
        print("kiln bench swap: FAILED: swapped blocks differ after a round trip", file=sys.stderr)
        ok = False

    shape = {
        "layers": layers,
        "kv_heads": heads,
        "head_dim": dim,
        "block_size": args.block_size,
        "dtype": str(dtype).removeprefix("torch."),
        "bytes_per_block": per_block,
    }
    results = []

    def snapshot(complete: bool) -> dict:
        return {
            "device": torch.cuda.get_device_name(device) if cuda else "cpu",
            "shape": shape,
            "staging_blocks": swapper.staging.shape[0],
            "pinned": swapper.cpu.is_pinned(),
            "correct": ok,
            "results": results,
            "complete": complete,
            "seconds": round(time.perf_counter() - t_start, 2),
        }

    def write(complete: bool) -> dict:
        result = snapshot(complete)
        if args.json and args.json != "-":
            with open(args.json + ".tmp", "w") as f:
                json.dump(result, f, indent=1)
            os.replace(args.json + ".tmp", args.json)
        return result

    write(False)
    # ---- timing ----
    timer = _Timer(cuda)
    host = torch.empty(most * per_block // cache.element_size(), dtype=dtype, pin_memory=cuda)
    dev = torch.empty_like(host, device=device)
    for n, layout in [(n, layout) for n in counts for layout in ("runs", "scattered")]:
        if n == 1 and layout == "scattered":
            continue
        gpu_ids = rng.sample(range(num_gpu_blocks), n)
        # runs: consecutive CPU slots, as SwapSpace hands out from a fresh pool (one DMA per run);
        # scattered: random CPU slots, one DMA per block (a fragmented pool, the worst case).
        cpu_ids = list(range(n)) if layout == "runs" else rng.sample(range(most), n)
        out_map = list(zip(gpu_ids, cpu_ids))
        in_map = list(zip(cpu_ids, gpu_ids))

        def swap_out():
            swapper.launch(out_map, [])
            swapper.wait()

        def swap_in():
            swapper.launch([], in_map)
            swapper.wait()

        numel = n * per_block // cache.element_size()

        def plain_d2h():
            host[:numel].copy_(dev[:numel], non_blocking=True)

        def plain_h2d():
            dev[:numel].copy_(host[:numel], non_blocking=True)

        for fn in (swap_out, swap_in, plain_d2h, plain_h2d):  # warm-up
            fn()
        nbytes = n * per_block
        row = {"blocks": n, "cpu_slots": layout, "bytes": nbytes}
        for name, fn in (
            ("swap_out", swap_out),
            ("swap_in", swap_in),
            ("pinned_d2h", plain_d2h),
            ("pinned_h2d", plain_h2d),
        ):
            seconds = timer(fn, args.iters)
            row[f"{name}_us"] = round(seconds * 1e6, 1)
            row[f"{name}_gbps"] = round(nbytes / seconds / 1e9, 2)
        row["out_vs_pinned"] = round(row["swap_out_gbps"] / row["pinned_d2h_gbps"], 3)
        row["in_vs_pinned"] = round(row["swap_in_gbps"] / row["pinned_h2d_gbps"], 3)
        results.append(row)
        write(False)

    summary = write(True)
    if args.json == "-":
        print(json.dumps(summary))
    else:
        s = summary["shape"]
        print(
            f"swap_blocks on {summary['device']}: {s['layers']} layers x {s['kv_heads']} kv heads x D{s['head_dim']}, "
            f"block {s['block_size']}, {s['dtype']} = {per_block / 2**20:.3f} MiB/block; staging "
            f"{summary['staging_blocks']} blocks; round trip {'exact' if ok else 'WRONG'}"
        )
        print(
            f"{'blocks':>6} {'cpu slots':>9} {'MiB':>8} {'out GB/s':>9} {'pinned':>8} {'ratio':>6} "
            f"{'in GB/s':>9} {'pinned':>8} {'ratio':>6}"
        )
        for r in results:
            print(
                f"{r['blocks']:>6} {r['cpu_slots']:>9} {r['bytes'] / 2**20:>8.2f} {r['swap_out_gbps']:>9.2f} "
                f"{r['pinned_d2h_gbps']:>8.2f} "
                f"{r['out_vs_pinned']:>6.2f} {r['swap_in_gbps']:>9.2f} {r['pinned_h2d_gbps']:>8.2f} "
                f"{r['in_vs_pinned']:>6.2f}"
            )
        print(f"({summary['seconds']} s)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
