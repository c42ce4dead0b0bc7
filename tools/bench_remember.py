"""A/B of ModelRunner._remember in one run (issue 11): the per-step seq id -> row dict it used to
build vs LastSampled, which looks rows up only when a placeholder needs them.

Runs `kiln bench overhead`'s measure() (stub model, greedy decode) on one engine, alternating the
two implementations (old, new, old, new; each pair averaged), and prints the runner's `launch`
phase (where _remember runs) and the critical path, with the ratio new / old.

    PYTHONPATH=$PWD python tools/bench_remember.py [--steps 60] [--batches 1,64,256]
"""

from __future__ import annotations

import argparse

from engine.bench.overhead import instrument, measure, stub_model
from engine.config.settings import EngineSettings
from engine.core.sched.scheduler_output import sample_row_ranges
from engine.runtime.llm_engine import LLMEngine
from engine.worker.model_runner import ModelRunner
from engine.worker.sample.sampler_output import LastSampled


class _EagerRows(LastSampled):
    """The old shape: the seq id -> row dict built at every step."""

    def __init__(self, tokens, seqs) -> None:
        super().__init__(tokens, seqs, False)
        self._rows = {s.seq_id: r.start for s, r in sample_row_ranges(seqs) if len(r) == 1}


def _old_remember(self, sched, pending):
    self.builder.last_sampled = _EagerRows(pending.sample.tokens, sched.seqs)
    return pending


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--batches", default="1,64,256")
    args = parser.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    new_remember = ModelRunner._remember
    engine = LLMEngine.from_settings(
        EngineSettings(
            max_num_seqs=max(batches),
            enforce_eager=True,
            cpu_threads=1,
            num_gpu_blocks=max(batches) * (-(-(32 + args.steps + 80) // 16)),
        )
    )
    stub_model(engine, max(batches))
    totals = instrument(engine)
    print(f"_remember A/B, stub model, {args.steps} decode steps per row (medians), µs per step")
    print(
        f"{'batch':>5} {'loop':>8} {'old launch':>11} {'new launch':>11} {'old crit':>9} {'new crit':>9} "
        f"{'launch new/old':>15}"
    )
    try:
        for batch in batches:
            for overlap in (False, True):
                runs: dict[str, list[dict[str, float]]] = {"old": [], "new": []}
                for name, fn in (("old", _old_remember), ("new", new_remember)) * 2:
                    ModelRunner._remember = fn
                    runs[name].append(measure(engine, totals, batch, args.steps, overlap))
                old, new = ({k: sum(r[k] for r in runs[n]) / 2 for k in runs[n][0]} for n in ("old", "new"))
                print(
                    f"{batch:>5} {'overlap' if overlap else 'serial':>8} {old['launch']:>11.1f} "
                    f"{new['launch']:>11.1f} {old['critical']:>9.1f} {new['critical']:>9.1f} "
                    f"{new['launch'] / old['launch']:>15.2f}"
                )
    finally:
        ModelRunner._remember = new_remember


if __name__ == "__main__":
    main()
