"""CPU time per output token, by thread, of a served model at concurrency (issue 41: every CPU
microsecond the output side spends per token is taken from the forward's thread team on a small
machine, and shows in the inter-token tail).

    python tools/bench_output_cost.py MODEL [--tree DIR ...] [--rounds 3] [--prompts 160] \
        [--concurrency 16] [--input-len 64] [--output-len 64] [--backend openai-chat] \
        [--profile-to DIR] [-- extra kiln serve flags]

Each tree's server runs from that directory (its code wins over the installed one) through
tools/serve_with_thread_names.py, which gives each Python thread's name to its OS thread. All
trees' servers start first and stay up; each round then loads each tree in turn (interleaved, so
every tree sees the same background load) with `kiln bench serve`'s client (streaming, random
prompts, --ignore-eos, greedy) after a warm-up. Per thread group, the CPU time the server spent
during the load (/proc/PID/task/*/schedstat: nanoseconds on a CPU) divided by the output tokens
the client received: `kiln-step-loop` (schedules, launches the forward, updates the requests),
`kiln-outputs` (detokenising, stop strings, RequestOutputs, metrics), `event loop` (the main
thread: HTTP, delta merging, SSE), `team` (native threads started by the step thread or the main
thread: the forward's OpenMP team beside the step thread), and every other Python thread by name
(the tokenizing pool...); `all` is the whole process
(/proc/PID/stat, threads that ended included). Also output tok/s and ITL p50/p99 (client side).
Medians over rounds; the last table gives each tree's ratio to the first.

--profile-to DIR: the servers also run cProfile on the event loop (during each measured load) and
on the output thread (from its start), written to DIR/TREE-ROUND-{loop,outputs}.prof (costs time:
use it for where the time goes, not for the figures).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # the client: this tree's kiln bench serve

from engine.bench.serve import run as load  # noqa: E402
from engine.bench.serve_data import BenchConfig  # noqa: E402
from engine.bench.serve_metrics import percentile  # noqa: E402
from tools.peer_process import split_passthrough  # noqa: E402

TICK_S = 1.0 / os.sysconf("SC_CLK_TCK")
GROUPS = {"kiln-step-loop": "step", "kiln-outputs": "outputs", "event loop": "event loop"}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, tree: Path, model: str, extra: list[str], profile_to: Path | None) -> None:
        self.tree, self.port = tree, _free_port()
        self.threads_file = Path(tempfile.mkdtemp()) / "threads.tsv"
        cmd = [sys.executable, str(HERE / "serve_with_thread_names.py"), str(self.threads_file)]
        self.profile: Path | None = None
        if profile_to is not None:
            self.profile = profile_to / tree.name
            cmd += ["--profile-to", str(self.profile)]
        cmd += ["--", "serve", model, "--port", str(self.port), *extra]
        self.log: list[str] = []
        self.proc = subprocess.Popen(cmd, cwd=tree, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.log.append(line.rstrip())

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def wait_ready(self, timeout: float = 600.0) -> None:
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout:
            if self.proc.poll() is not None:
                break
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=1) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.2)
        raise SystemExit(f"{self.tree}: server not ready\n" + "\n".join(self.log[-30:]))

    def cpu_by_thread(self) -> dict[str, float]:
        """Seconds on a CPU so far, per thread group, and 'all' for the process."""
        pid = self.proc.pid
        named = {}  # Python threads by native id (the launcher lists them)
        for line in self.threads_file.read_text().splitlines():
            tid, name = line.split("\t", 1)
            named[int(tid)] = name
        out: dict[str, float] = {}
        for tid in os.listdir(f"/proc/{pid}/task"):
            try:
                comm = Path(f"/proc/{pid}/task/{tid}/comm").read_text().strip()
                ns = int(Path(f"/proc/{pid}/task/{tid}/schedstat").read_text().split()[0])
            except OSError:
                continue  # (ended meanwhile)
            name = named.get(int(tid))
            if name is None:  # a native thread: it inherited the name of the thread that started it
                group = "team" if comm.startswith(("kiln-step-loop", "python")) else f"other: {comm}"
            else:
                group = GROUPS.get(name, f"other: {name.rstrip('_0123456789')}")
            out[group] = out.get(group, 0.0) + ns / 1e9
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        out["all"] = (int(fields[11]) + int(fields[12])) * TICK_S  # (threads that ended included)
        return out

    def signal(self, sig: int) -> None:
        if self.profile is not None:
            self.proc.send_signal(sig)

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGINT)
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def config(server: Server, args: argparse.Namespace, prompts: int, seed: int) -> BenchConfig:
    backend = args.backend
    return BenchConfig(
        url=server.url,
        model=None,
        num_prompts=prompts,
        request_rate=float("inf"),
        max_concurrency=args.concurrency,
        input_len=args.input_len,
        output_len=args.output_len,
        seed=seed,
        backend=backend,
        endpoint="/v1/chat/completions" if backend == "openai-chat" else "/v1/completions",
        ignore_eos=True,
    )


def measure(server: Server, args: argparse.Namespace, round_: int) -> dict[str, float]:
    asyncio.run(load(config(server, args, args.concurrency, seed=1000 + round_), progress=False))  # warm-up
    server.signal(signal.SIGUSR1)
    before, t0, load_before = server.cpu_by_thread(), time.monotonic(), os.getloadavg()[0]
    summary = asyncio.run(load(config(server, args, args.prompts, seed=round_), progress=False))
    after, wall = server.cpu_by_thread(), time.monotonic() - t0
    server.signal(signal.SIGUSR2)
    if server.profile is not None:
        time.sleep(2.0)  # (the server writes its profiles)
        for part in ("loop", "outputs"):
            got = Path(f"{server.profile}-{part}.prof")
            if got.exists():
                got.rename(f"{server.profile}-{round_}-{part}.prof")
    errors = [e for e in summary["request_errors"] if e]
    if errors:
        raise SystemExit(f"{server.tree}: {len(errors)} requests failed: {errors[:3]}")
    tokens = sum(summary["output_lens"])
    itls = [gap for gaps in summary["itls"] for gap in gaps]
    row = {f"{group} us/tok": 1e6 * (after[group] - before.get(group, 0.0)) / tokens for group in after}
    row.update(
        {
            "output tok/s": tokens / wall,
            "ITL p50 ms": 1000 * percentile(itls, 50),
            "ITL p90 ms": 1000 * percentile(itls, 90),
            "ITL p99 ms": 1000 * percentile(itls, 99),
            "TTFT p50 ms": 1000 * percentile([t for t in summary["ttfts"] if t], 50),
            "load avg": (load_before + os.getloadavg()[0]) / 2,
        }
    )
    return row


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    argv, extra = split_passthrough(argv)
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("model")
    p.add_argument("--tree", action="append", type=Path, help="a checkout (repeat; default: this one)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--prompts", type=int, default=160)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--input-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--backend", choices=("openai", "openai-chat"), default="openai-chat")
    p.add_argument("--profile-to", type=Path, help="also profile the servers' output side into this directory")
    args = p.parse_args(argv)
    trees = [t.resolve() for t in (args.tree or [HERE.parent])]
    if args.profile_to is not None:
        args.profile_to.mkdir(parents=True, exist_ok=True)
    servers = [Server(tree, args.model, extra, args.profile_to) for tree in trees]
    rows: dict[Path, list[dict[str, float]]] = {tree: [] for tree in trees}
    try:
        for server in servers:
            server.wait_ready()
        for r in range(args.rounds):
            for server in servers if r % 2 == 0 else servers[::-1]:  # (alternating order too)
                row = measure(server, args, r)
                rows[server.tree].append(row)
                print(
                    f"round {r + 1} {server.tree}: "
                    + ", ".join(f"{k} {v:.1f}" for k, v in row.items() if not k.startswith("other")),
                    flush=True,
                )
    finally:
        for server in servers:
            server.stop()
    medians = {
        tree: {k: statistics.median(row.get(k, 0.0) for row in got) for k in sorted({k for g in got for k in g})}
        for tree, got in rows.items()
    }
    keys = sorted({k for m in medians.values() for k in m}, key=_order)
    print(
        f"\nmedians of {args.rounds} interleaved rounds, c{args.concurrency}, {args.input_len} in / "
        f"{args.output_len} out, {args.prompts} prompts, {args.backend}"
    )
    print("| | " + " | ".join(str(t) for t in trees) + (" | ratio" * (len(trees) - 1)) + " |")
    print("| --- |" + " ---: |" * (2 * len(trees) - 1))
    first = medians[trees[0]]
    for k in keys:
        cells = [f"{medians[t].get(k, 0.0):.1f}" for t in trees]
        cells += [f"{medians[t].get(k, 0.0) / first[k]:.2f}x" if first.get(k) else "-" for t in trees[1:]]
        print(f"| {k} | " + " | ".join(cells) + " |")
    return 0


def _order(key: str) -> tuple[int, str]:
    ranks = ["step", "outputs", "event loop", "team", "all", "output tok/s", "ITL", "TTFT", "load"]
    return next((i for i, r in enumerate(ranks) if key.startswith(r)), len(ranks) - 1), key


if __name__ == "__main__":
    sys.exit(main())
