"""kiln bench timeline FILE: what the slowest steps of a step timeline are made of.

    kiln serve --model M --step-timeline /tmp/steps.jsonl      # then load it (kiln bench serve, vllm bench serve)
    kiln bench timeline /tmp/steps.jsonl [--top 2] [--json report.json]

Reads the JSON lines the step_timeline setting writes (engine/core/sched/step_timeline.py). For
each step that decoded, the gap its tokens saw at the client side of the server is the time
between this step's outputs reaching the event loop and the previous step's (a step ends at
`t + interval_ms - gap_ms`; it is delivered output_ms + loop_ms later). Each step counts once per
decoding sequence (as a client's inter-token latencies do: its percentiles are the ITL's), and the
steps in the slowest --top percent are each put down to the part that exceeds the typical step the most:

  prefill chunk   model time above a decode-only step of as many sequences, with prefill in the step
  model (decode)  the same without prefill: the forward itself was slow (contention, the OS)
  python gc       the collector's pauses in the step (counted first when they are half the excess)
  host            schedule + update above their median
  step loop       the gap between steps above its median (inbox, hand-off to the output thread, wake-up)
  output path     delivery later than the step's end by more than the previous step's (output
                  thread, event-loop wake-up)
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections import defaultdict
from pathlib import Path
from typing import Any

CAUSES = ("prefill chunk", "model (decode)", "python gc", "host", "step loop", "output path")


def load(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _pct(values: list[float], q: float, weights: list[int] | None = None) -> float:
    """The q-th percentile (nearest rank) of values, each counted weights[i] times."""
    if not values:
        return float("nan")
    pairs = sorted(zip(values, weights or [1] * len(values)))
    total = sum(w for _, w in pairs)
    rank = min(total - 1, int(q / 100 * total))
    for value, w in pairs:
        rank -= w
        if rank < 0:
            return value
    return pairs[-1][0]


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else 0.0


def client_gaps(steps: list[dict[str, Any]]) -> list[tuple[dict[str, Any], float, float]]:
    """(step, gap the decodes saw at delivery, delivery delay past the step's end) per decoding step."""
    out = []
    prev_delivered: float | None = None
    for s in steps:
        if s.get("interval_ms") is None or s["kind"] == "idle":
            prev_delivered = None
            continue
        end_ms = s["t"] * 1e3 + s["interval_ms"] - (s["gap_ms"] or 0.0)
        delay = (s.get("output_ms") or 0.0) + (s.get("loop_ms") or 0.0)
        delivered = end_ms + delay
        if prev_delivered is not None and s["decode_seqs"] > 0:
            out.append((s, delivered - prev_delivered, delay))
        prev_delivered = delivered
    return out


def analyse(steps: list[dict[str, Any]], top: float = 2.0) -> dict[str, Any]:
    """Percentiles of the step gaps and the slow steps grouped by cause (see the module docstring)."""
    gaps = client_gaps(steps)
    if not gaps:
        return {"steps": len(steps), "decode_steps": 0, "causes": {}}
    decode_only = [s for s in steps if s["kind"] == "decode"]
    model_by_seqs: dict[int, list[float]] = defaultdict(list)
    for s in decode_only:
        model_by_seqs[s["decode_seqs"]].append(s["model_ms"])
    typical_model = {d: _median(v) for d, v in model_by_seqs.items()}
    all_decode_model = _median([s["model_ms"] for s in decode_only])
    host_med = _median([s["schedule_ms"] + s["update_ms"] for s in decode_only])
    gap_med = _median([s["gap_ms"] for s in decode_only if s["gap_ms"] is not None])
    seen = [g for _, g, _ in gaps]
    weights = [s["decode_seqs"] for s, _, _ in gaps]
    typical_gap = _pct(seen, 50, weights)
    threshold = _pct(seen, 100 - top, weights)
    slow = [i for i, (_, g, _) in enumerate(gaps) if g >= threshold]
    causes: dict[str, list[float]] = {c: [] for c in CAUSES}
    examples: dict[str, dict[str, Any]] = {}
    for i in slow:
        s, g, delay = gaps[i]
        excess = g - typical_gap
        model_base = typical_model.get(s["decode_seqs"], all_decode_model)
        before = gaps[i - 1][2] if i > 0 else delay
        parts = {
            "prefill chunk" if s["prefill_tokens"] else "model (decode)": s["model_ms"] - model_base,
            "host": s["schedule_ms"] + s["update_ms"] - host_med,
            "step loop": (s["gap_ms"] or 0.0) - gap_med,
            "output path": delay - before,
        }
        cause = "python gc" if s["gc_ms"] >= 0.5 * max(excess, 1e-9) else max(parts, key=lambda k: parts[k])
        causes[cause] += [excess] * s["decode_seqs"]
        if cause not in examples or excess > examples[cause]["excess_ms"]:
            examples[cause] = {
                "step": s["step"],
                "excess_ms": round(excess, 2),
                **{k: round(v, 2) for k, v in parts.items()},
            }
    slow_tokens = sum(len(v) for v in causes.values())
    by_kind: dict[str, list[float]] = defaultdict(list)
    for s, g, _ in gaps:
        by_kind[s["kind"]].append(g)
    return {
        "steps": len(steps),
        "decode_steps": len(gaps),
        "gap_ms": {
            "median": round(typical_gap, 2),
            "p90": round(_pct(seen, 90, weights), 2),
            "p99": round(_pct(seen, 99, weights), 2),
        },
        "gap_ms_by_kind": {
            k: {"n": len(v), "median": round(_median(v), 2), "p99": round(_pct(v, 99), 2)} for k, v in by_kind.items()
        },
        "gc": {
            "collections": sum(s["gc_collections"] for s in steps),
            "pause_ms_total": round(sum(s["gc_ms"] for s in steps), 1),
            "pause_ms_max": round(max(s["gc_ms"] for s in steps), 2),
        },
        "slow_threshold_ms": round(threshold, 2),
        "causes": {
            c: {"tokens": len(v), "share": round(len(v) / slow_tokens, 3), "median_excess_ms": round(_median(v), 2)}
            for c, v in causes.items()
            if v
        },
        "worst_example": examples,
    }


def render(report: dict[str, Any], top: float) -> str:
    if not report.get("decode_steps"):
        return f"{report['steps']} steps, none with decodes: nothing to analyse"
    g = report["gap_ms"]
    lines = [
        f"{report['steps']} steps, {report['decode_steps']} with decodes; gap the decoded tokens saw (ms): "
        f"median {g['median']}, p90 {g['p90']}, p99 {g['p99']}",
        "by step kind (steps): "
        + ", ".join(f"{k} n={v['n']} median {v['median']} p99 {v['p99']}" for k, v in report["gap_ms_by_kind"].items()),
        f"python gc: {report['gc']['collections']} collections, {report['gc']['pause_ms_total']} ms in all, "
        f"longest {report['gc']['pause_ms_max']} ms",
        f"slowest {top}% of decoded tokens (gap >= {report['slow_threshold_ms']} ms), by cause:",
    ]
    for cause, c in sorted(report["causes"].items(), key=lambda kv: -kv[1]["tokens"]):
        lines.append(
            f"  {cause:<15} {c['tokens']:>5} tokens ({c['share']:.0%}), median excess {c['median_excess_ms']} ms"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="kiln bench timeline", description=__doc__.split("\n\n")[0])
    p.add_argument("file", type=Path, help="a step timeline (the step_timeline setting's JSON lines)")
    p.add_argument("--top", type=float, default=2.0, help="percent of the slowest decode steps to explain (default 2)")
    p.add_argument("--skip", type=int, default=0, help="leave out the first N steps (warm-up)")
    p.add_argument("--json", type=Path, default=None, help="also write the report here")
    a = p.parse_args(argv)
    report = analyse(load(a.file)[a.skip :], a.top)
    print(render(report, a.top))
    if a.json is not None:
        a.json.write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
