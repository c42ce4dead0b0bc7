"""The bookkeeping half of tools/gpu_check.sh: one JSON per stage, the table printed last.

    gpu_summary.py record WORK STAGE STATUS RC SECONDS [--reason R] [--result F] [--junit F ...]
        write WORK/STAGE.json: status (ok, failed, timeout, skipped), exit code, seconds, why
        skipped, pytest counts from the junit files, and the stage's own JSON result if any
    gpu_summary.py kernel-env JUNIT...
        print the KILN_* settings of the newest kernel generations whose GPU tests all passed
        (KILN_DECODE_KERNEL=v2, KILN_PREFILL_KERNEL=wgmma), for the later stages to export
    gpu_summary.py table WORK [--out DIR]
        print one line per stage (in run order) and the targets of issue 16 against the
        figures found; write DIR/summary.json with all of it. Never fails on missing data.
Standard library only: it must run where the engine's dependencies failed to install.
"""

from __future__ import annotations

import argparse
import json
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

# transformers generate (eager, sdpa) on the lent H200, Llama-3.1-8B shape (DESIGN.md): the
# baseline is known, so the device run does not spend minutes re-measuring it.
HF_8B_MS_PER_STEP_B1 = 21.96
HF_8B_TOK_PER_S_B64 = 2734.0
TARGETS = (
    # (name, stage, how to read the figure, comparison, bound)
    ("8B bf16 batch 1 ms/step", "latency-8b", ("latency", 1, "ms_per_step_median"), "<=", 4.3),
    ("8B bf16 batch 64 tok/s (3x transformers' 2,734)", "latency-8b", ("latency", 64, "decode_tok_per_s"), ">=",
     3 * HF_8B_TOK_PER_S_B64),
    ("1B bf16 batch 1 ms/step", "latency-1b", ("latency", 1, "ms_per_step_median"), "<=", 1.0),
    ("paged decode GB/s at B=64, ctx 2048", "kernel-bench", ("decode", 64, 2048), ">=", 3500.0),
)


def junit_counts(paths: list[str]) -> dict | None:
    """passed/failed/errors/skipped over pytest junit files (None if none could be read)."""
    counts = {"passed": 0, "failed": 0, "errors": 0, "skipped": 0}
    found = False
    for path in paths:
        try:
            root = ET.parse(path).getroot()
        except (OSError, ET.ParseError):
            continue
        found = True
        for case in root.iter("testcase"):
            kinds = {child.tag for child in case}
            if "failure" in kinds:
                counts["failed"] += 1
            elif "error" in kinds:
                counts["errors"] += 1
            elif "skipped" in kinds:
                counts["skipped"] += 1
            else:
                counts["passed"] += 1
    return counts if found else None


def junit_outcomes(paths: list[str]) -> dict[str, str]:
    """{test name: passed|failed|skipped} over pytest junit files."""
    out = {}
    for path in paths:
        try:
            root = ET.parse(path).getroot()
        except (OSError, ET.ParseError):
            continue
        for case in root.iter("testcase"):
            kinds = {child.tag for child in case}
            name = f"{case.get('classname', '')}::{case.get('name', '')}"
            out[name] = ("failed" if kinds & {"failure", "error"} else "skipped" if "skipped" in kinds
                         else "passed")
    return out


def kernel_env(paths: list[str]) -> list[str]:
    """Settings for the newest kernel generations whose tests ran and all passed."""
    outcomes = junit_outcomes(paths)
    lines = []
    for marker, setting, value in (("v2", "KILN_DECODE_KERNEL", "v2"), ("wgmma", "KILN_PREFILL_KERNEL", "wgmma")):
        mine = [o for name, o in outcomes.items() if marker in name.split("::")[-1]]
        if mine and all(o == "passed" for o in mine):
            lines.append(f"{setting}={value}")
    return lines


def record(work: Path, stage: str, status: str, rc: str, seconds: float, reason: str | None, result: str | None,
           junit: list[str]) -> dict:
    entry = {"stage": stage, "status": status, "rc": rc, "seconds": round(float(seconds), 1)}
    if reason:
        entry["reason"] = reason
    counts = junit_counts(junit)
    if counts is not None:
        entry["tests"] = counts
        if status == "ok" and (counts["failed"] or counts["errors"]):
            entry["status"] = "failed"
    if result:
        try:
            entry["result"] = json.loads(Path(result).read_text())
        except (OSError, ValueError):
            pass
    work.mkdir(parents=True, exist_ok=True)
    order = len(list(work.glob("*.stage.json")))
    entry["order"] = order
    (work / f"{stage}.stage.json").write_text(json.dumps(entry, indent=1))
    return entry


def _latency_figure(result, batch: int, key: str):
    rows = result if isinstance(result, list) else [result]
    for row in rows:
        if isinstance(row, dict) and row.get("batch_size") == batch:
            return row.get(key)
    return None


def _decode_figure(result, batch: int, ctx: int):
    for row in (result or {}).get("decode", []) if isinstance(result, dict) else []:
        if row.get("batch") == batch and row.get("ctx") == ctx:
            return row.get("kiln_GBps")
    return None


def targets(stages: dict[str, dict]) -> list[dict]:
    rows = []
    for name, stage, (kind, a, b), op, bound in TARGETS:
        result = stages.get(stage, {}).get("result")
        value = (_latency_figure(result, a, b) if kind == "latency" else _decode_figure(result, a, b)) \
            if result is not None else None
        if value is None:
            verdict = "no figure"
        else:
            verdict = "MET" if (value <= bound if op == "<=" else value >= bound) else "missed"
        row = {"target": name, "bound": f"{op} {bound:g}", "value": value, "verdict": verdict}
        if name.startswith("8B") and value:
            row["vs_transformers"] = (HF_8B_MS_PER_STEP_B1 / value if "ms/step" in name
                                      else value / HF_8B_TOK_PER_S_B64)
        rows.append(row)
    return rows


def _fmt(v) -> str:
    return f"{v:.4g}" if isinstance(v, float) else str(v)


def table(work: Path, out: Path | None) -> str:
    stages = {}
    for path in work.glob("*.stage.json") if work.is_dir() else []:
        try:
            entry = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        stages[entry.get("stage", path.stem)] = entry
    lines = ["================ kiln GPU check summary ================",
             f"{'stage':<16} {'status':<8} {'rc':>4} {'secs':>6}  detail"]
    for entry in sorted(stages.values(), key=lambda e: e.get("order", 0)):
        detail = entry.get("reason", "")
        if "tests" in entry:
            t = entry["tests"]
            detail = (f"{t['passed']} passed, {t['failed']} failed, {t['errors']} errors, {t['skipped']} skipped "
                      + detail).strip()
        lines.append(f"{entry['stage']:<16} {entry['status']:<8} {entry['rc']:>4} {entry['seconds']:>6}  {detail}")
    found = targets(stages)
    lines.append("---------------- targets (issue 16) ----------------")
    for row in found:
        value = "-" if row["value"] is None else _fmt(row["value"])
        extra = f"  ({row['vs_transformers']:.2f}x transformers)" if "vs_transformers" in row else ""
        lines.append(f"{row['target']:<50} {row['bound']:>10}  {value:>10}  {row['verdict']}{extra}")
    text = "\n".join(lines)
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        (out / "summary.json").write_text(json.dumps({"stages": stages, "targets": found}, indent=1))
    return text


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="gpu_summary.py")
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("record")
    r.add_argument("work", type=Path)
    r.add_argument("stage")
    r.add_argument("status", choices=("ok", "failed", "timeout", "skipped"))
    r.add_argument("rc")
    r.add_argument("seconds", type=float)
    r.add_argument("--reason", default=None)
    r.add_argument("--result", default=None)
    r.add_argument("--junit", nargs="*", default=[])
    k = sub.add_parser("kernel-env")
    k.add_argument("junit", nargs="*")
    t = sub.add_parser("table")
    t.add_argument("work", type=Path)
    t.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    if args.cmd == "record":
        entry = record(args.work, args.stage, args.status, args.rc, args.seconds, args.reason, args.result,
                       args.junit)
        print(entry["status"])
    elif args.cmd == "kernel-env":
        print("\n".join(kernel_env(args.junit)))
    else:
        print(table(args.work, args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
