"""Time `kiln serve MODEL` from the process's start to /health answering 200, by phase, for one
or more checkouts in alternating rounds (a baseline measured in the same run; issue 40).

    python tools/bench_startup.py MODEL [--tree DIR ...] [--runs 3] [-- extra kiln serve flags]

Each tree's `python -m engine.entrypoints.cli serve` runs in that directory (its code wins over the
installed one). The phases come from the server's log, stamped on arrival: up to the first engine
log line (imports, settings, the model's config), the tokenizer and the weights (their own
"done in" lines; the tokenizer loads beside the weights where the code does so), from the weights
to "engine ready" (KV, packing, huge pages, kernels, warm-up) and from there to health 200. CPU is
the process's user + system seconds at that moment: on a busy machine it varies less than the
wall time; the CPU columns give it at the first log line (read from /proc as the line arrives:
the imports' share), for the weights phase (its log line's own CPU figure), at "engine ready" (read
as that line arrives) and at health 200.
Best (lowest-CPU) run of each tree, and each tree's median CPU over its runs; then every column's
median over each tree's runs.

Each tree's Python files are byte-compiled first, as an install leaves them: a checkout run with
PYTHONDONTWRITEBYTECODE set (as some shells and CI have it) would otherwise compile kiln's modules
again at every start, which no installed kiln does.
"""

from __future__ import annotations

import argparse
import compileall
import os
import re
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # (run as a script from the checkout)

from tools.peer_process import split_passthrough  # noqa: E402


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def process_cpu(pid: int) -> float | None:
    """User + system CPU seconds of a running process (None once it is gone)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def run_once(tree: Path, model: str, extra: list[str], timeout: float = 300.0) -> dict[str, float]:
    port = _free_port()
    t0 = time.perf_counter()
    cmd = [sys.executable, "-m", "engine.entrypoints.cli", "serve", model, "--port", str(port), *extra]
    proc = subprocess.Popen(cmd, cwd=tree, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: list[tuple[float, str]] = []
    first_log_cpu: list[float | None] = []
    engine_ready_cpu: list[float | None] = []

    def pump() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append((time.perf_counter() - t0, line.rstrip()))
            if not first_log_cpu and re.search(r" INFO engine\.", line):
                first_log_cpu.append(process_cpu(proc.pid))
            if not engine_ready_cpu and re.search(r"engine ready", line):
                engine_ready_cpu.append(process_cpu(proc.pid))

    threading.Thread(target=pump, daemon=True).start()
    ready = cpu = None
    while proc.poll() is None and time.perf_counter() - t0 < timeout:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1) as r:
                if r.status == 200:
                    ready = time.perf_counter() - t0
                    cpu = process_cpu(proc.pid)
                    break
        except OSError:
            pass
        time.sleep(0.05)
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()
    if ready is None:
        tail = "\n".join(text for _, text in lines[-20:])
        raise SystemExit(f"{tree}: not ready within {timeout:.0f}s\n{tail}")

    def at(pattern: str) -> float:
        return next(t for t, text in lines if re.search(pattern, text))

    def took(pattern: str, what: str = r"done in ([0-9.]+)s") -> float:
        for _, text in lines:
            m = re.search(pattern + r".*" + what, text)
            if m:
                return float(m.group(1))
        return float("nan")

    weights_done, engine_ready = at(r"loading weights of .*done in"), at(r"engine ready")
    return {
        "to first log": at(r" INFO engine\."),
        "tokenizer": took(r"loading the tokenizer"),
        "weights": took(r"loading weights of"),
        "weights -> engine ready": engine_ready - weights_done,
        "engine ready -> health": ready - engine_ready,
        "ready (wall)": ready,
        "first log (CPU)": (first_log_cpu or [None])[0] or float("nan"),
        "weights (CPU)": took(r"loading weights of", r"done in [0-9.]+s \(CPU ([0-9.]+)s"),
        "engine ready (CPU)": (engine_ready_cpu or [None])[0] or float("nan"),
        "ready (CPU)": cpu or 0.0,
    }


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    argv, extra = split_passthrough(argv)
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("model")
    p.add_argument("--tree", action="append", type=Path, help="a checkout (repeat; default: this one)")
    p.add_argument("--runs", type=int, default=3)
    args = p.parse_args(argv)
    trees = args.tree or [Path(__file__).resolve().parents[1]]
    for tree in trees:
        for package in ("engine", "compiler", "tools"):
            compileall.compile_dir(str(tree / package), quiet=1)
    best: dict[Path, dict[str, float]] = {}
    cpus: dict[Path, list[float]] = {tree: [] for tree in trees}
    runs: dict[Path, list[dict[str, float]]] = {tree: [] for tree in trees}
    print(f"load before: {_load()}", flush=True)
    for r in range(args.runs):
        for tree in trees:  # (alternating: both see the same load)
            got = run_once(tree, args.model, extra)
            wall, cpu = got["ready (wall)"], got["ready (CPU)"]
            print(f"run {r + 1} {tree}: ready {wall:.2f}s wall, {cpu:.2f}s CPU (load {_load()})", flush=True)
            cpus[tree].append(cpu)
            runs[tree].append(got)
            if tree not in best or got["ready (CPU)"] < best[tree]["ready (CPU)"]:
                best[tree] = got
    names = list(next(iter(best.values())))
    print("\n| tree | " + " | ".join(names) + " | median ready (CPU) |\n|" + " --- |" * (len(names) + 2))
    for tree, got in best.items():
        median = statistics.median(cpus[tree])
        print(f"| {tree} | " + " | ".join(f"{got[n]:.2f}" for n in names) + f" | {median:.2f} |")
    print("\nmedians over each tree's runs, column by column:\n| tree | " + " | ".join(names) + " |")
    print("|" + " --- |" * (len(names) + 1))
    for tree, got_all in runs.items():
        print(f"| {tree} | " + " | ".join(f"{statistics.median(g[n] for g in got_all):.2f}" for n in names) + " |")
    if len(trees) > 1:
        base = statistics.median(cpus[trees[0]])
        ratios = ", ".join(f"{statistics.median(cpus[t]) / base:.2f}x" for t in trees[1:])
        print(f"median ready CPU, each tree / the first: {ratios}")
    return 0


def _load() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


if __name__ == "__main__":
    sys.exit(main())
