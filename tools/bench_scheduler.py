"""`Scheduler.schedule` cost per step, this tree's scheduler against a baseline revision's, in one run.

No model and no engine: `batch` requests are admitted and prefilled, then every step is
schedule -> launched -> update with one fake token per sequence (the steady decode state of
a serving engine). Only `schedule()` is timed. The baseline is `engine/core/sched/scheduler.py` as it
is at `--baseline` (a git revision, default `main`), loaded as a module next to this tree's
block pool, so both run on the same machine at the same time.

    PYTHONPATH=$PWD python tools/bench_scheduler.py [--baseline main] [--batches 1,64,256]

Also times a mixed step (decodes plus a chunked prefill being admitted) and prints medians
in µs per step, µs per sequence, and baseline / new ratios.
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BLOCK_SIZE = 16


def load_baseline(rev: str):
    """The scheduler module at git revision `rev` (None if it cannot be read)."""
    root = Path(__file__).resolve().parent.parent
    try:
        text = subprocess.run(
            ["git", "-C", str(root), "show", f"{rev}:engine/core/sched/scheduler.py"],
            check=True,
            capture_output=True,
            text=True,
        ).stdout
    except (subprocess.CalledProcessError, FileNotFoundError):
        return None
    path = Path(tempfile.mkdtemp()) / "baseline_scheduler.py"
    path.write_text(text)
    spec = importlib.util.spec_from_file_location("baseline_scheduler", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["baseline_scheduler"] = module
    spec.loader.exec_module(module)
    return module


def _make(module, batch: int, steps: int, prefill_len: int):
    from engine.core.kv.block_pool import BlockPool

    max_len = 64 + steps + 2 * prefill_len
    blocks = (batch + 4) * (-(-max_len // BLOCK_SIZE)) + 8
    cfg = module.SchedulerConfig(
        max_num_seqs=batch + 4,
        max_num_batched_tokens=max(2048, batch + prefill_len),
        max_model_len=max_len,
        block_size=BLOCK_SIZE,
    )
    return module.Scheduler(cfg, BlockPool(blocks, BLOCK_SIZE, True))


def _advance(sched, out, token_of) -> None:
    """Hand the step's fake tokens back, through whichever API the scheduler has: one pass
    (update_from_output, which also finishes by length) or the older update + finish_seq."""
    if hasattr(sched, "update_from_output"):
        from engine.core.outputs import SamplerOutput

        ids = [token_of(s) for s in out.seqs if s.do_sample]
        sched.update_from_output(out, SamplerOutput(ids, [None] * len(ids)))
        return
    from engine.core.outputs import FinishReason

    touched = sched.update(out, [[token_of(s)] if s.do_sample else [] for s in out.seqs])
    for seq in touched:
        if seq.num_output_tokens >= seq.request.params.max_tokens:
            sched.finish_seq(seq, FinishReason.LENGTH)
            sched.pop_finished_request(seq.request.request_id)


def _step(sched, token: int) -> None:
    out = sched.schedule()
    sched.launched(out)
    _advance(sched, out, lambda s: token)


def measure(module, batch: int, steps: int, mixed: bool) -> float:
    from engine.core.params import SamplingParams
    from engine.core.request import Request

    prefill = 96
    sched = _make(module, batch, steps, prefill)
    params = SamplingParams(temperature=0, max_tokens=steps + 40, ignore_eos=True)
    short = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    for i in range(batch):
        sched.add_request(Request(f"r{i}", None, list(range(10 + i % 7, 26 + i % 7 + i % 3)), params))
    for _ in range(4):  # prefill and a few decodes
        _step(sched, 5)
    times = []
    for k in range(steps):
        if mixed and k % 4 == 0:  # a new prompt arrives, chunked in beside the decodes
            sched.add_request(Request(f"m{k}", None, [7 + k % 5] * (2 * prefill), short))
        t0 = time.perf_counter()
        out = sched.schedule()
        times.append(time.perf_counter() - t0)
        sched.launched(out)
        _advance(sched, out, lambda s, k=k: (k * 7 + s.seq_id) % 50 + 3)
    sched.check_integrity()
    return statistics.median(times) * 1e6


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--baseline", default="main", help="git revision of the baseline scheduler")
    parser.add_argument("--batches", default="1,64,256")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=3, help="best of this many runs per row")
    args = parser.parse_args()
    import engine.core.sched.scheduler as new

    base = load_baseline(args.baseline)
    if base is None:
        print(f"(no baseline: git revision {args.baseline!r} unreadable)")
    print(
        f"Scheduler.schedule, µs per step (median of {args.steps} steps, best of {args.repeats}); "
        f"baseline = {args.baseline}"
    )
    print(f"{'batch':>5} {'step':>7} {'baseline':>9} {'new':>9} {'new/seq':>8} {'speed-up':>9}")
    for batch in [int(b) for b in args.batches.split(",") if b]:
        for mixed in (False, True):
            row = {}
            for name, module in (("baseline", base), ("new", new)):
                if module is None:
                    continue
                try:
                    row[name] = min(measure(module, batch, args.steps, mixed) for _ in range(args.repeats))
                except Exception as exc:  # noqa: BLE001 - an old scheduler.py beside this tree's helpers
                    if name == "new":
                        raise
                    print(
                        f"(baseline {args.baseline!r} does not run beside this tree's engine/core modules: "
                        f"{type(exc).__name__}: {exc}; compare with a revision after the same restructuring)"
                    )
                    base = None
            b = row.get("baseline")
            n = row["new"]
            print(
                f"{batch:>5} {'mixed' if mixed else 'decode':>7} {b if b else float('nan'):>9.1f} {n:>9.1f} "
                f"{n / batch:>8.2f} {(b / n if b else float('nan')):>8.2f}x"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
