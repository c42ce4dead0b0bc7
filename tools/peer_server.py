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
