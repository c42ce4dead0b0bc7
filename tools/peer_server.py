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


def _real_time() -> bool:
    return hasattr(os, "sched_getscheduler") and os.sched_getscheduler(0) in (os.SCHED_FIFO, os.SCHED_RR)


def server_prefix() -> list[str]:
    """What runs a served benchmark's server as it is deployed: the normal time-sharing policy, also
    when the tool runs under a real-time one (`chrt -f 10`, for steady offline numbers). At one
    real-time priority a server's compute threads keep the cores until they block, and the threads
    that write its responses wait behind them: llama-server's tokens left in bursts (median gap
    3.5 ms, p99 516 ms; under the normal policy 58-59 ms and 67-69 ms; 2 cores, session 17)."""
    return ["chrt", "-o", "0"] if _real_time() else []


def client_prefix() -> list[str]:
    """What runs the benchmark client above the servers it measures (under a real-time policy; else
    nothing), so that it reads each chunk when it arrives: at the servers' priority it was held off
    the cores and timed llama-server's chunks ~0 ms apart (median inter-token latency 0.0 ms)."""
    if not _real_time():
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
def running_server(
    cmd: list[str], env: dict[str, str], log: Path, port: int, start_timeout: float, cwd: Path
) -> Iterator[subprocess.Popen]:
    """The server `cmd` started (under the normal scheduling policy: server_prefix) and ready on
    `port`; stopped when the block ends."""
    with open(log, "w") as f:
        proc = subprocess.Popen(
            server_prefix() + cmd, env=env, stdout=f, stderr=subprocess.STDOUT, cwd=cwd, start_new_session=True
        )
    try:
        wait_ready(proc, port, log, start_timeout)
        yield proc
    finally:
        stop(proc)
