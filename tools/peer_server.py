"""A server under benchmark (kiln, llama-server, vLLM), for the tools that compare kiln with its
peers (bench_vs_llamacpp.py, bench_vs_vllm.py): started in a process group of its own with its
output in a log file, ready once GET /v1/models answers 200, stopped with SIGINT (SIGKILL if it
has not exited within a minute), whatever happens in between."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path


def core_count(cores: str) -> int:
    """Cores in a list like 0-3 or 0,2,4-5."""
    n = 0
    for part in cores.split(","):
        lo, _, hi = part.partition("-")
        n += int(hi or lo) - int(lo) + 1
    return n


def client_prefix() -> list[str]:
    """What runs the benchmark client above the servers it measures. Under a real-time policy (the
    tools are run with `chrt -f 10` for steady numbers) servers and client would share one
    priority, and a server whose threads keep both cores busy held the client off them: it read
    llama-server's chunks in bursts, timed ~0 ms apart, and reported a median inter-token latency of
    0.0 ms (llama-server, 2 cores, session 17; 53.3 ms with the client above it). Otherwise: nothing."""
    if not hasattr(os, "sched_getscheduler") or os.sched_getscheduler(0) not in (os.SCHED_FIFO, os.SCHED_RR):
        return []
    priority = min(os.sched_getparam(0).sched_priority + 10, os.sched_get_priority_max(os.SCHED_FIFO))
    return ["chrt", "-f", str(priority)]


def wait_ready(proc: subprocess.Popen, port: int, log: Path, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"server exited ({proc.returncode}) before it was ready; see {log}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(1.0)
    raise SystemExit(f"server not ready after {timeout}s; see {log}")


def stop(proc: subprocess.Popen) -> None:
    """SIGINT to the server's process group, SIGKILL after a minute (a group already gone: nothing to do)."""
    try:
        os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


@contextlib.contextmanager
def running_server(cmd: list[str], env: dict[str, str], log: Path, port: int, start_timeout: float,
                   cwd: Path) -> Iterator[subprocess.Popen]:
    """The server `cmd` started and ready on `port`; stopped when the block ends."""
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, env=env, stdout=f, stderr=subprocess.STDOUT, cwd=cwd, start_new_session=True)
    try:
        wait_ready(proc, port, log, start_timeout)
        yield proc
    finally:
        stop(proc)
