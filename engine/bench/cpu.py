"""`kiln bench cpu`: thread settings under load, what compiling pays, batch-1 speed, warm start.

    kiln bench cpu --model DIR                       # threads x neighbour, batch 1 and throughput
    kiln bench cpu --model DIR --baseline --parts --startup --json out.json

One engine (the default settings: eager forward, the C++ paged attention) is driven under
each thread setting -- the default plan (engine/worker/cpu_threads.py), 1, 2 and every available core --
first on a quiet machine and then next to a CPU-burning neighbour process that the benchmark
starts and stops (it also ends by itself after --neighbour-seconds). Per setting: batch-1 decode
(median ms per step after the prefill) and the throughput of --requests requests (generated
tokens per second, end to end). Each number is printed with its ratio to the best setting of the
same run, and the check the issue asks for: with the neighbour running, the default is within
1.3x of the best.

--baseline: transformers' `generate` (eager, sdpa) on the same weights and threads, batch 1, in
the same process (ratio = its ms per token / kiln's; >= 1.0 means kiln is at least as fast).
--parts: compiled vs eager per part: the decode attention op alone (C++ kernel vs the gather +
SDPA reference) at a few batch/context sizes, and batch-1 decode of the engine with the
reference attention (enforce_eager) vs the default.
--startup: wall time from process start to the first generated token, twice in fresh processes
(the first may build the kernel; the second is the warm-cache start).
--step-parts: where a decode step's time goes, at batch 1 (and --step-parts-batch): the median
step's wall time, unprofiled, split by torch's profiler into the linear layers (GEMM/GEMV and the
quantised kernels), attention (the C++ paged attention and KV writes), the fused norms/RoPE/SiLU,
other torch ops, and the rest: the host's Python (modules, dispatch, scheduler, sampler glue) and
the threads' wake-ups, i.e. wall time no op accounts for. Also the torch ops per step.

The machine may be shared: only ratios within one run mean anything.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import torch

# The parts: cpu_threads_under_load.py (threads x neighbour), cpu_baselines.py (--baseline, --parts,
# --startup), cpu_step_parts.py (--step-parts, --decoder-stack); here the flags and the run.
from engine.bench.cpu_baselines import baseline, parts, startup
from engine.bench.cpu_step_parts import decoder_stack, step_parts
from engine.bench.cpu_threads_under_load import Neighbour, check_default, print_table, run_settings, thread_settings


def build_parser() -> argparse.ArgumentParser:
    from engine.entrypoints.cli.flags import add_settings_flags

    p = argparse.ArgumentParser(
        prog="kiln bench cpu", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--threads", default="default,1,2,all", help="settings to compare (default, all, or counts)")
    p.add_argument("--no-neighbour", action="store_true", help="skip the runs next to a CPU-burning process")
    p.add_argument("--neighbour-procs", type=int, default=1, help="busy-loop processes of the neighbour")
    p.add_argument("--neighbour-seconds", type=float, default=900.0, help="the neighbour ends by itself after this")
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds over the settings (medians)")
    p.add_argument("--input-len", type=int, default=32)
    p.add_argument("--batch1-tokens", type=int, default=32, help="tokens generated in the batch-1 run")
    p.add_argument("--requests", type=int, default=256, help="throughput run: requests queued at once (0: skip)")
    p.add_argument("--output-len", type=int, default=16, help="throughput run: tokens per request")
    p.add_argument("--baseline", action="store_true", help="batch 1 against transformers generate")
    p.add_argument("--baseline-rounds", type=int, default=3)
    p.add_argument("--parts", action="store_true", help="compiled vs eager per part")
    p.add_argument("--startup", action="store_true", help="process start to first token, twice")
    p.add_argument("--step-parts", action="store_true", help="where a decode step's time goes (profiled)")
    p.add_argument("--step-parts-batch", default="1,16", help="batch sizes for --step-parts (default 1,16)")
    p.add_argument("--step-parts-steps", type=int, default=20, help="decode steps timed per batch size")
    p.add_argument(
        "--decoder-stack",
        action="store_true",
        help="decode steps with the C++ decoder stack vs the layers op by op, interleaved",
    )
    p.add_argument("--decoder-stack-batch", default="1,16", help="batch sizes for --decoder-stack (default 1,16)")
    p.add_argument("--decoder-stack-rounds", type=int, default=5)
    p.add_argument("--decoder-stack-steps", type=int, default=20, help="decode steps timed per run")
    p.add_argument("--json", type=Path, help="write the results here")
    add_settings_flags(p)
    return p


def main(argv: list[str]) -> int:
    from engine.config.process_setup import available_cores
    from engine.entrypoints.cli.flags import settings_from_args
    from engine.runtime.llm_engine import LLMEngine
    from engine.worker.cpu_threads import plan_threads

    args = build_parser().parse_args(argv)
    settings = settings_from_args(args)
    if settings.device == "cuda":
        print("kiln bench cpu: runs on the CPU (device=cpu)", file=sys.stderr)
        return 2
    settings = settings.model_copy(update={"device": "cpu", "log_stats_interval": 0})
    cores = available_cores()
    default = plan_threads(settings.cpu_threads, settings.cpu_bind, cores).threads
    results: dict[str, Any] = {"available_cores": len(cores), "default_threads": default}
    if args.startup:
        print("start-up (fresh processes):")
        results["startup_s"] = startup(settings.model_dump(mode="json", exclude_defaults=True))
    engine = LLMEngine.from_settings(settings)
    print(
        f"model {engine.model_dir}, {len(cores)} available cores, default plan {default} threads; "
        f"the machine may be shared with other jobs: compare ratios, not absolute numbers"
    )
    if args.baseline:
        results["baseline"] = baseline(engine, args)
    if args.parts:
        results["parts"] = parts(engine, args)
    if args.step_parts:
        print(f"\nwhere a decode step's time goes ({torch.get_num_threads()} threads, context {args.input_len}+):")
        results["step_parts"] = [
            step_parts(engine, int(b), args.step_parts_steps, args.input_len)
            for b in args.step_parts_batch.split(",")
            if b.strip()
        ]
    if args.decoder_stack:
        results["decoder_stack"] = decoder_stack(
            engine,
            [int(b) for b in args.decoder_stack_batch.split(",") if b],
            args.decoder_stack_rounds,
            args.decoder_stack_steps,
            args.input_len,
        )
    chosen = thread_settings(args.threads, len(cores), default)
    rows = run_settings(engine, chosen, args, neighbour=False)
    ok = True
    if not args.no_neighbour:
        with Neighbour(args.neighbour_procs, args.neighbour_seconds):
            rows += run_settings(engine, chosen, args, neighbour=True)
        print_table(rows)
        ok = check_default(rows)
    else:
        print_table(rows)
    results["rows"] = rows
    results["default_within_1.3x"] = ok
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    return 0
