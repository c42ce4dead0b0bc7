"""The bookkeeping half of tools/gpu_check.sh: one JSON per stage, the table printed last.

    gpu_summary.py record WORK STAGE STATUS RC SECONDS [--reason R] [--result F] [--junit F ...] [--log F]
                          [--engines "NAME=STATE ..."]
        write WORK/STAGE.stage.json: status (ok, failed, timeout, skipped), exit code, seconds, why
        skipped, the background engines' state as it began timing, pytest counts from the junit
        files (a stage whose tests all skipped fails), the crash (the signal, the last error line
        of the log) and the stage's own JSON result if any
    gpu_summary.py group WORK NAME RC SECONDS
        one process of the tests stage (WORK/tests-NAME.{xml,log}) into WORK/tests.json
    gpu_summary.py kernel-env JUNIT...
        print the KILN_* settings of the newest kernel generations whose GPU tests all passed
        (KILN_DECODE_KERNEL=v2, KILN_PREFILL_KERNEL=wgmma)
    gpu_summary.py table WORK [--out DIR]
        print one line per stage (in run order; the tests stage's processes under it) and the
        targets against the figures found, each naming what produced it (backend, CUDA graphs,
        overlap scheduling); a figure is scored (MET / missed) only if it was measured on the
        cutlass backend with CUDA graphs, every forward of its timed window replayed a graph and
        nothing compiled there. Write DIR/summary.json with all of it. Never fails on
        missing data.
Standard library only: it must run where the engine's dependencies failed to install.
"""

from __future__ import annotations

import argparse
import json
import re
import signal
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

# transformers generate (eager, sdpa) on the lent H200, Llama-3.1-8B shape (DESIGN.md): the
# baseline is known, so the device run does not spend minutes re-measuring it.
HF_8B_MS_PER_STEP_B1 = 21.96
HF_8B_TOK_PER_S_B64 = 2734.0
TARGETS = (
    # (name, stage, how to read the figure, comparison, bound)
    ("8B bf16 batch 1 ms/step", "latency-8b", ("latency", 1, "ms_per_step"), "<=", 4.3),
    (
        "8B bf16 batch 64 tok/s (3x transformers' 2,734)",
        "latency-8b",
        ("latency", 64, "decode_tok_per_s"),
        ">=",
        3 * HF_8B_TOK_PER_S_B64,
    ),
    ("1B bf16 batch 1 ms/step", "latency-1b", ("latency", 1, "ms_per_step"), "<=", 1.0),
    ("paged decode GB/s at B=64, ctx 2048", "kernel-bench", ("decode", 64, 2048), ">=", 3500.0),
    ("paged decode GB/s at B=64, ctx 2048", "kernel-bench-v2", ("decode", 64, 2048), ">=", 3500.0),
    ("8B int4 / bf16 ms/step at batch 1", "quant-bench", ("quant", 1, "int4_over_bf16_ms"), "<=", 0.4),
)
# The bounds above are the H200's (4.8 TB/s of HBM3e). Each figure is memory-bound, so on another
# card its bound scales with the memory bandwidth (datasheet figures): times and ratios of times
# longer by H200 / card, rates shorter by card / H200 (the int4 / bf16 ratio is the same on both).
CARD_BANDWIDTH_TBS = {"H200": 4.8, "H100": 3.35}


def card_of(stages: dict[str, dict]) -> str:
    """The card the run was on, from the env stage ("H200" when it cannot be told: its floors apply)."""
    name = ((stages.get("env") or {}).get("result") or {}).get("gpu") or ""
    return next((card for card in CARD_BANDWIDTH_TBS if card in name), "H200")


def card_bound(bound: float, op: str, name: str, card: str) -> float:
    if "int4 / bf16" in name:
        return bound
    scale = CARD_BANDWIDTH_TBS["H200"] / CARD_BANDWIDTH_TBS[card]
    return bound * scale if op == "<=" else bound / scale


# A line of a log that names what went wrong (the last one is reported).
_ERROR_LINE = re.compile(
    r"(\w+(Error|Exception)\b|error:|Traceback|Segmentation fault|Aborted|core dumped|Killed|"
    r"illegal|CUDA error|FAILED|ERROR)"
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
            if case.get("name") is None:  # (the test a SIGINT cut: pytest writes it empty, no verdict)
                continue
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
            if case.get("name") is None:  # (cut by a SIGINT: no verdict)
                continue
            kinds = {child.tag for child in case}
            name = f"{case.get('classname', '')}::{case.get('name', '')}"
            out[name] = "failed" if kinds & {"failure", "error"} else "skipped" if "skipped" in kinds else "passed"
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


def crash_of(rc: str, log: str | None) -> str | None:
    """What ended a failed command: the signal that killed it, and the last error line of its log."""
    parts = []
    try:
        code = int(rc)
    except ValueError:
        code = 0
    if code > 128 and code - 128 in signal.valid_signals() and code not in (124, 137):
        parts.append(f"killed by {signal.Signals(code - 128).name}")
    elif code in (124, 137):
        parts.append("cut at its time limit")
    if log:
        try:
            lines = Path(log).read_text(errors="replace").splitlines()
        except OSError:
            lines = []
        found = [ln.strip() for ln in lines if _ERROR_LINE.search(ln)]
        if found:
            parts.append(found[-1][:300])
    return "; ".join(parts) or None


def _test_verdict(entry: dict, counts: dict | None) -> None:
    """Fold pytest counts into a record: failures fail it; only skips (or no test at all) fail it too."""
    if counts is None:
        return
    entry["tests"] = counts
    total = sum(counts.values())
    if entry["status"] != "ok":
        return
    if counts["failed"] or counts["errors"]:
        entry["status"] = "failed"
    elif counts["passed"] == 0:
        entry["status"] = "failed"
        entry["reason"] = f"all {total} tests skipped" if total else "no test ran"


def record(
    work: Path,
    stage: str,
    status: str,
    rc: str,
    seconds: float,
    reason: str | None,
    result: str | None,
    junit: list[str],
    log: str | None = None,
    engines: str | None = None,
) -> dict:
    entry = {"stage": stage, "status": status, "rc": rc, "seconds": round(float(seconds), 1)}
    if reason:
        entry["reason"] = reason
    if engines:  # the background engines' state when the stage began timing (gpu_check.sh quiet_gpu)
        entry["engines"] = engines
    _test_verdict(entry, junit_counts(junit))
    if status in ("failed", "timeout"):
        crash = crash_of(rc, log)
        if crash:
            entry["crash"] = crash
    if result:
        try:
            entry["result"] = json.loads(Path(result).read_text())
        except (OSError, ValueError):
            pass
    work.mkdir(parents=True, exist_ok=True)
    previous = work / f"{stage}.stage.json"
    try:  # a stage recorded again keeps its place
        entry["order"] = json.loads(previous.read_text())["order"]
    except (OSError, ValueError, KeyError):
        entry["order"] = len(list(work.glob("*.stage.json")))
    previous.write_text(json.dumps(entry, indent=1))
    return entry


def group(work: Path, name: str, rc: str, seconds: float) -> dict:
    """One process of the tests stage into WORK/tests.json (its counts, status and crash)."""
    status = "ok" if rc == "0" else "timeout" if rc in ("124", "137") else "failed"
    entry = {"status": status, "rc": rc, "seconds": round(float(seconds), 1)}
    junit = work / f"tests-{name}.xml"
    _test_verdict(entry, junit_counts([str(junit)]))
    if "tests" not in entry:
        entry["reason"] = "no junit file (the process crashed or was cut before pytest wrote it)"
    if entry["status"] != "ok":
        crash = crash_of(rc, str(work / f"tests-{name}.log"))
        if crash:
            entry["crash"] = crash
    path = work / "tests.json"
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        data = {"groups": {}}
    data["groups"][name] = entry
    path.write_text(json.dumps(data, indent=1))
    return entry


# ---- figures and what produced them ----------------------------------------------------------


def _rows(result) -> list[dict]:
    return [r for r in (result if isinstance(result, list) else [result]) if isinstance(r, dict)]


def _latency_row(result, batch: int) -> dict | None:
    return next((r for r in _rows(result) if r.get("batch_size") == batch), None)


def produced_by(row: dict) -> str:
    """What measured a latency row: device, backend, CUDA graphs, overlap scheduling."""
    graphs = "CUDA graphs" if row.get("cuda_graphs") else "no CUDA graphs"
    if row.get("forwards") is not None and row.get("graph_replays") is not None:
        graphs += f" ({row['graph_replays']}/{row['forwards']} replayed, {row.get('recompiles', '?')} compiles)"
    overlap = {True: "overlap on", False: "overlap off"}.get(row.get("async_scheduling"), "overlap ?")
    kernels = f" {row.get('decode_kernel')}/{row.get('prefill_kernel')}" if row.get("backend") == "cutlass" else ""
    return f"{row.get('device', '?')}, {row.get('backend', '?')}{kernels}, {graphs}, {overlap}"


def why_not_scored(row: dict) -> str | None:
    """None when a latency figure may be judged: measured to the end on a GPU, by the CUTLASS
    backend, with CUDA graphs; else the reason (a torch-backend figure is no kiln figure)."""
    if row.get("status", "done") != "done":
        return f"status {row.get('status')}"
    if not str(row.get("device", "")).startswith("cuda"):
        return f"device {row.get('device', '?')}"
    if row.get("backend") != "cutlass":
        return f"{row.get('backend', 'unknown')} backend"
    if not row.get("cuda_graphs"):
        return "no CUDA graphs"
    # Graphs captured is not graphs replayed: the timed window must have replayed one for every
    # forward and compiled nothing (rows from before these were recorded are taken as they are).
    forwards, replays, recompiles = row.get("forwards"), row.get("graph_replays"), row.get("recompiles")
    if recompiles:
        return f"{recompiles} recompiles in the timed window"
    if forwards is not None and replays is not None and replays != forwards:
        return f"{replays} graph replays for {forwards} forwards in the timed window"
    return None


def _figure(kind: str, result, a, b) -> tuple[object, str, str | None]:
    """(value, produced by, why not scored) of one target's figure."""
    if kind == "latency":
        row = _latency_row(result, a)
        if row is None:
            return None, "-", "no row"
        return row.get(b), produced_by(row), why_not_scored(row)
    if kind == "decode":
        result = result if isinstance(result, dict) else {}
        row = next((r for r in result.get("decode", []) if r.get("batch") == a and r.get("ctx") == b), None)
        label = (
            f"{result.get('device', '?')}, {result.get('backend', '?')} {result.get('decode_kernel', '?')}, "
            f"{result.get('timing', '?')}"
        )
        why = (
            "a fake device"
            if result.get("fake")
            else None
            if result.get("backend") == "cutlass" and "graph" in str(result.get("timing", ""))
            else "not a CUTLASS kernel timed by graph replay"
        )
        return (row or {}).get("kiln_GBps"), label, why
    if kind == "quant":
        result = result if isinstance(result, dict) else {}
        int4, bf16 = result.get("int4_row") or {}, result.get("bf16_row") or {}
        if not (int4 and bf16):
            return result.get(b), "-", "no int4 or no bf16 row"
        return (
            result.get(b),
            f"int4: {produced_by(int4)}; bf16: {produced_by(bf16)}",
            why_not_scored(int4) or why_not_scored(bf16),
        )
    return None, "-", "unknown figure"


def targets(stages: dict[str, dict]) -> list[dict]:
    rows = []
    card = card_of(stages)
    for name, stage, (kind, a, b), op, bound in TARGETS:
        bound = card_bound(bound, op, name, card)
        result = stages.get(stage, {}).get("result")
        value, label, why = _figure(kind, result, a, b) if result is not None else (None, "-", "no result")
        if value is None:
            verdict = "no figure"
        elif why is not None:
            verdict = f"not scored ({why})"
        else:
            verdict = "MET" if (value <= bound if op == "<=" else value >= bound) else "missed"
        row = {
            "target": name,
            "stage": stage,
            "bound": f"{op} {bound:.4g}",
            "card": card,
            "value": value,
            "verdict": verdict,
            "produced_by": label,
        }
        if name.startswith("8B bf16") and why is None and isinstance(value, (int, float)) and value:
            row["vs_transformers"] = HF_8B_MS_PER_STEP_B1 / value if "ms/step" in name else value / HF_8B_TOK_PER_S_B64
        rows.append(row)
    return rows


def _fmt(v) -> str:
    return f"{v:.4g}" if isinstance(v, float) else str(v)


def _detail(entry: dict) -> str:
    parts = []
    if "tests" in entry:
        t = entry["tests"]
        parts.append(f"{t['passed']} passed, {t['failed']} failed, {t['errors']} errors, {t['skipped']} skipped")
    for key in ("reason", "crash"):
        if entry.get(key):
            parts.append(("CRASH: " if key == "crash" else "") + entry[key])
    if entry.get("engines"):
        parts.append(f"background engines: {entry['engines']}")
    result = entry.get("result")
    if isinstance(result, dict) and "notes" in result:  # quant_compare's
        for key, what in (("int4_over_bf16_ms", "int4/bf16 ms/step"), ("fp8_over_bf16_tok_s", "fp8/bf16 tok/s")):
            if key in result:
                parts.append(
                    f"{what} {result[key]:.3f}" + (f" ({result['int4_verdict']})" if key.startswith("int4") else "")
                )
        parts += [f"missing {note}" for note in result["notes"]]
    if isinstance(result, dict) and result.get("complete") is False:
        parts.append("result incomplete (has " + ", ".join(k for k in result if k not in ("complete", "fake")) + ")")
    rows = (
        _rows(entry.get("result"))
        if isinstance(entry.get("result"), list)
        or (isinstance(entry.get("result"), dict) and "startup_s" in entry["result"])
        else []
    )
    if rows and "startup_s" in rows[0]:
        r = rows[0]
        parts.append(
            f"start-up {r['startup_s']:.0f}s (compile {r.get('compile_s', 0):.0f}s, "
            f"capture {r.get('capture_s', 0):.1f}s); {produced_by(r)}; rows "
            + ", ".join(f"b{x.get('batch_size')} {x.get('status', 'done')}" for x in rows)
        )
    return "; ".join(parts)


def table(work: Path, out: Path | None) -> str:
    stages = {}
    for path in work.glob("*.stage.json") if work.is_dir() else []:
        try:
            entry = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        stages[entry.get("stage", path.stem)] = entry
    lines = [
        "================ kiln GPU check summary ================",
        f"{'stage':<20} {'status':<8} {'rc':>4} {'secs':>6}  detail",
    ]
    for entry in sorted(stages.values(), key=lambda e: e.get("order", 0)):
        lines.append(
            f"{entry['stage']:<20} {entry['status']:<8} {entry['rc']:>4} {entry['seconds']:>6}  {_detail(entry)}"
        )
        groups = (
            entry.get("result", {}).get("groups", {})
            if entry["stage"] == "tests" and isinstance(entry.get("result"), dict)
            else {}
        )
        for name, g in groups.items():
            lines.append(f"  {name:<18} {g['status']:<8} {g['rc']:>4} {g['seconds']:>6}  {_detail(g)}")
    found = targets(stages)
    lines.append("---------------- targets (scored only on the cutlass backend with CUDA graphs) ----------------")
    for row in found:
        value = "-" if row["value"] is None else _fmt(row["value"])
        extra = f"  ({row['vs_transformers']:.2f}x transformers)" if "vs_transformers" in row else ""
        lines.append(
            f"{row['target']:<50} {row['bound']:>10}  {value:>10}  {row['verdict']}{extra}  "
            f"[{row['stage']}: {row['produced_by']}]"
        )
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
    r.add_argument("--log", default=None)
    r.add_argument("--engines", default=None)
    g = sub.add_parser("group")
    g.add_argument("work", type=Path)
    g.add_argument("name")
    g.add_argument("rc")
    g.add_argument("seconds", type=float)
    k = sub.add_parser("kernel-env")
    k.add_argument("junit", nargs="*")
    t = sub.add_parser("table")
    t.add_argument("work", type=Path)
    t.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    if args.cmd == "record":
        entry = record(
            args.work,
            args.stage,
            args.status,
            args.rc,
            args.seconds,
            args.reason,
            args.result,
            args.junit,
            args.log,
            args.engines,
        )
        print(entry["status"])
    elif args.cmd == "group":
        print(group(args.work, args.name, args.rc, args.seconds)["status"])
    elif args.cmd == "kernel-env":
        print("\n".join(kernel_env(args.junit)))
    else:
        print(table(args.work, args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
