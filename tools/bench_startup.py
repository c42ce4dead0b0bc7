"""Time `kiln serve MODEL` from the process's start to /health answering 200, by phase, for one
or more checkouts in alternating rounds (a baseline measured in the same run; issue 40).

    python tools/bench_startup.py MODEL [--tree DIR ...] [--runs 3] [-- extra kiln serve flags]

Each tree's `python -m engine.entrypoints.cli serve` runs in that directory (its code wins over the
installed one). The phases come from the server's log, stamped on arrival: up to the first engine
log line (imports, settings, the model's config), the tokenizer and the weights (their own
"done in" lines; the tokenizer loads beside the weights where the code does so), from the weights
to "engine ready" (KV, packing, huge pages, kernels, warm-up) and from there to health 200. CPU is
the process's user + system seconds at that moment: on a busy machine it varies less than the
wall time. Best (lowest-wall) run of each tree.

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


def run_once(tree: Path, model: str, extra: list[str], timeout: float = 300.0) -> dict[str, float]:
    port = _free_port()
    t0 = time.perf_counter()
    cmd = [sys.executable, "-m", "engine.entrypoints.cli", "serve", model, "--port", str(port), *extra]
    proc = subprocess.Popen(cmd, cwd=tree, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: list[tuple[float, str]] = []

    def pump() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append((time.perf_counter() - t0, line.rstrip()))

    threading.Thread(target=pump, daemon=True).start()
    ready = cpu = None
    while proc.poll() is None and time.perf_counter() - t0 < timeout:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1) as r:
                if r.status == 200:
                    ready = time.perf_counter() - t0
                    fields = Path(f"/proc/{proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
                    cpu = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
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

    def took(pattern: str) -> float:
        for _, text in lines:
            m = re.search(pattern + r".*done in ([0-9.]+)s", text)
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
    for r in range(args.runs):
        for tree in trees:  # (alternating: both see the same load)
            got = run_once(tree, args.model, extra)
            wall, cpu = got["ready (wall)"], got["ready (CPU)"]
            print(f"run {r + 1} {tree}: ready {wall:.2f}s wall, {cpu:.2f}s CPU", flush=True)
            if tree not in best or got["ready (wall)"] < best[tree]["ready (wall)"]:
                best[tree] = got
    names = list(next(iter(best.values())))
    print("\n| tree | " + " | ".join(names) + " |\n|" + " --- |" * (len(names) + 1))
    for tree, got in best.items():
        print(f"| {tree} | " + " | ".join(f"{got[n]:.2f}" for n in names) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
