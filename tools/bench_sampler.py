"""Time per sampling step: the old sampling (tests/support/full_sort_probs.py: the full-sort rules and
torch's uniform_ noise, kiln's sampler at 1ae5d20) against the sampler as it is, interleaved in one
process.

    python tools/bench_sampler.py [--batches 1,16,64] [--vocabs 49152,128256] [--zipf 1.5]
        [--reps 7] [--threads N]

Each step is the sampler's whole launch and result (Sampler.launch(...).result()) on float32
logits of the batch's rows, all rows with the same parameters: greedy; temperature 1; top-k 40;
top-p 0.95; llama-server's defaults (top-k 40, top-p 0.95, min-p 0.05, temperature 0.8). The
logits look like a model's: a random permutation of -s*log(rank) (Zipf's law, exponent --zipf)
plus a little noise; at s=1.5 a top-p 0.95 cut keeps a few hundred tokens. Old and new alternate
per repetition (the same background load for both); the table gives medians in ms and new/old.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from engine.core.params import SamplingParams  # noqa: E402
from engine.worker.sample import sampler as sampler_module  # noqa: E402
from engine.worker.sample.sampler import Sampler, SampleRow  # noqa: E402
from tests.support.full_sort_probs import full_sort_probs, torch_uniform_race_noise  # noqa: E402

MODES = {
    "greedy": dict(temperature=0.0),
    "temperature 1": dict(temperature=1.0),
    "seeded temperature 1": dict(temperature=1.0, seed=1),
    "top-k 40": dict(temperature=1.0, top_k=40),
    "top-p 0.95": dict(temperature=1.0, top_p=0.95),
    "llama-server defaults": dict(temperature=0.8, top_k=40, top_p=0.95, min_p=0.05),
}


def model_like_logits(batch: int, vocab: int, s: float, gen: torch.Generator) -> torch.Tensor:
    ranks = torch.arange(1, vocab + 1, dtype=torch.float32)
    out = torch.empty(batch, vocab)
    for i in range(batch):
        out[i, torch.randperm(vocab, generator=gen)] = -s * ranks.log()
    return out + 0.01 * torch.randn(batch, vocab, generator=gen)


def one_step(sampler: Sampler, logits: torch.Tensor, rows: list[SampleRow]) -> float:
    start = time.perf_counter()
    sampler.launch(logits, rows).result()
    return time.perf_counter() - start


def measure(batch: int, vocab: int, params: dict, args) -> tuple[float, float]:
    gen = torch.Generator().manual_seed(batch * 7 + vocab)
    logits = model_like_logits(batch, vocab, args.zipf, gen)
    rows = [SampleRow(SamplingParams(max_tokens=64, **params), [1, 2, 3], 3, 0, key=i) for i in range(batch)]
    sampler = Sampler(torch.device("cpu"), (0,))
    new_fns = (sampler_module.processed_probs, sampler_module.race_noise)
    times: dict[str, list[float]] = {"old": [], "new": []}
    sides = [("old", (full_sort_probs, torch_uniform_race_noise)), ("new", new_fns)]
    for rep in range(args.reps + 1):  # (the first round warms up; the sides alternate which goes first)
        for name, (probs_fn, noise_fn) in sides if rep % 2 else sides[::-1]:
            sampler_module.processed_probs, sampler_module.race_noise = probs_fn, noise_fn
            try:
                t = one_step(sampler, logits, rows)
            finally:
                sampler_module.processed_probs, sampler_module.race_noise = new_fns
            if rep:
                times[name].append(t)
    return statistics.median(times["old"]) * 1e3, statistics.median(times["new"]) * 1e3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batches", default="1,16,64")
    p.add_argument("--vocabs", default="49152,128256")
    p.add_argument("--modes", default=",".join(MODES), help=f"any of: {', '.join(MODES)}")
    p.add_argument("--zipf", type=float, default=1.5, help="the logits' Zipf exponent (default 1.5)")
    p.add_argument("--reps", type=int, default=7, help="timed steps per side and case (default 7)")
    p.add_argument("--threads", type=int, default=None, help="torch's intra-op threads (default: torch's)")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    modes = [m.strip() for m in args.modes.split(",")]
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, Zipf {args.zipf}, {args.reps} reps, medians")
    print("| vocab | batch | sampling | old ms | new ms | new/old |\n| ---: | ---: | --- | ---: | ---: | ---: |")
    for vocab in (int(v) for v in args.vocabs.split(",")):
        for batch in (int(b) for b in args.batches.split(",")):
            for mode in modes:
                old, new = measure(batch, vocab, MODES[mode], args)
                print(f"| {vocab} | {batch} | {mode} | {old:.2f} | {new:.2f} | {new / old:.2f} |", flush=True)


if __name__ == "__main__":
    main()
