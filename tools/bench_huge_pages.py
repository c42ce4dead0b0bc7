"""Batch-1 decode with the weights on 4 KB pages against 2 MB huge pages (the cpu_huge_pages
setting, engine/worker/cpu_huge_pages.py): two engines of the same model in one process, timed in
alternating order, so that the VM's bandwidth, which moves by tens of percent between minutes,
falls on both alike. Prints each run's tok/s and the median ratio huge / 4 KB.

    PYTHONPATH=. chrt -f 10 python tools/bench_huge_pages.py --model /work/peers/models/smollm2-135m-f32
"""

from __future__ import annotations

import argparse
import statistics
import time


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--runs", type=int, default=6)
    args = parser.parse_args()

    from engine import LLM, SamplingParams

    llms = {
        huge: LLM(model=args.model, dtype=args.dtype, device="cpu", max_num_seqs=1, cpu_huge_pages=huge)
        for huge in (False, True)
    }
    params = SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True, detokenize=False)
    for llm in llms.values():
        llm.generate([[1, 2, 3, 4]], params, use_tqdm=False)
    rates: dict[bool, list[float]] = {False: [], True: []}
    for r in range(args.runs):
        for huge in (False, True) if r % 2 == 0 else (True, False):
            t0 = time.perf_counter()
            llms[huge].generate([[1, 2, 3, 4, 5 + r]], params, use_tqdm=False)
            rates[huge].append(args.tokens / (time.perf_counter() - t0))
    small, huge = statistics.median(rates[False]), statistics.median(rates[True])
    print(f"{args.model} ({args.dtype}), batch 1, {args.tokens} tokens, {args.runs} alternating runs each")
    print("  4 KB pages  tok/s: " + " ".join(f"{x:.1f}" for x in rates[False]) + f"   median {small:.1f}")
    print("  huge pages  tok/s: " + " ".join(f"{x:.1f}" for x in rates[True]) + f"   median {huge:.1f}")
    print(f"  huge / 4 KB: {huge / small:.3f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
