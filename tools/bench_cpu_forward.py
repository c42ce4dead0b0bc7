"""Per-step cost of the eager CPU forward (run_model + compute_logits) for decode steps of 16/41/64
rows, on the tiny default model (or --model), for this tree and, with --baseline, another tree
(e.g. `git worktree add /tmp/base <commit>`), each in its own process, alternating, so one run
prints new / old ratios measured on the same machine at the same time.

    PYTHONPATH=$PWD python tools/bench_cpu_forward.py --baseline /tmp/base

On a machine shared with other jobs, --threads 1 gives steadier numbers (two OpenMP threads
stall whenever another process holds a core). Each decode row attends a context of 16-128 tokens (seeded), as
in `kiln bench throughput`'s
short workload. Prints the best µs per step (the mean of the fastest chunk of 10 steps) over all rounds: the
machine this runs on is shared, and the fastest chunk is the least disturbed one.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

CHUNK = 10  # steps timed together
DEFAULT_MODEL = str(Path.home() / ".cache" / "kiln" / "default-model-llama")


def measure(model_path: str, rows_list: list[int], iters: int, threads: int) -> dict[str, float]:
    """µs per decode step (forward + logits) for each row count, in this process's tree."""
    import torch

    if threads:
        torch.set_num_threads(threads)

    from engine.entrypoints.llm import LLM
    from engine.layers.attention.base import AttentionMetadata

    llm = LLM(model=model_path, max_num_seqs=max(rows_list))
    runner = llm.engine.core.runner
    model, cache = runner.model, runner.kv_cache.tensor
    block_size = cache.shape[3]
    gen = torch.Generator().manual_seed(0)
    results = {}
    for rows in rows_list:
        lens = torch.randint(16, 129, (rows,), generator=gen, dtype=torch.int32)
        blocks_per_seq = (128 + block_size - 1) // block_size
        tables = torch.arange(rows * blocks_per_seq, dtype=torch.int32).view(rows, blocks_per_seq)
        pos = (lens - 1).to(torch.int64)
        slots = (
            tables.gather(1, (pos // block_size).view(-1, 1).to(torch.int64)).view(-1).to(torch.int64) * block_size
            + pos % block_size
        )
        meta = AttentionMetadata(
            slot_mapping=slots,
            query_start_loc=torch.arange(rows + 1, dtype=torch.int32),
            seq_lens=lens,
            block_tables=tables,
            max_query_len=1,
            max_seq_len=int(lens.max()),
            num_decodes=rows,
        )
        ids = torch.randint(0, model.config.vocab_size, (rows,), generator=gen)

        def step() -> None:
            hidden = runner.forward_fn(ids, pos, cache, meta, None)
            model.compute_logits(hidden[:rows])

        with torch.inference_mode():
            for _ in range(20):
                step()
            best = float("inf")
            for _ in range(max(1, iters // CHUNK)):  # the least-disturbed chunk: others share the cores
                t0 = time.perf_counter()
                for _ in range(CHUNK):
                    step()
                best = min(best, (time.perf_counter() - t0) / CHUNK)
            results[str(rows)] = best * 1e6
    return results


def run_tree(tree: str, args) -> dict[str, float]:
    env = dict(os.environ, PYTHONPATH=tree)
    cmd = [
        sys.executable,
        str(Path(__file__).resolve()),
        "--child",
        "--model",
        args.model,
        "--rows",
        args.rows,
        "--iters",
        str(args.iters),
        "--threads",
        str(args.threads),
    ]
    out = subprocess.run(cmd, cwd=tree, env=env, check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--rows", default="16,41,64")
    parser.add_argument("--iters", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=0, help="intra-op threads (0: torch's default)")
    parser.add_argument("--baseline", help="another kiln tree to time against (its own process)")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    rows_list = [int(r) for r in args.rows.split(",")]
    if args.child:
        print(json.dumps(measure(args.model, rows_list, args.iters, args.threads)))
        return
    here = str(Path(__file__).resolve().parents[1])
    trees = {"new": here} | ({"old": str(Path(args.baseline).resolve())} if args.baseline else {})
    samples: dict[str, dict[str, list[float]]] = {name: {str(r): [] for r in rows_list} for name in trees}
    for _ in range(args.rounds):
        for name, tree in trees.items():
            for rows, us in run_tree(tree, args).items():
                samples[name][rows].append(us)
    for rows in map(str, rows_list):
        med = {name: min(samples[name][rows]) for name in trees}
        line = f"rows {rows:>3}: new {med['new']:7.1f} µs/step"
        if "old" in med:
            line += f"   old {med['old']:7.1f} µs/step   old/new {med['old'] / med['new']:.2f}x"
        print(line)


if __name__ == "__main__":
    main()
