"""A server under benchmark (kiln, llama-server, vLLM), for the tools that compare kiln with its
peers (bench_vs_llamacpp.py, bench_vs_vllm.py, bench_kv_workloads.py): started in a process group
of its own with its output in a log file, ready once GET /v1/models answers 200, stopped with
SIGINT (SIGKILL if it has not exited within a minute), whatever happens in between.

Measured the same way for every server (issue 40: memory and time to ready beside tok/s): the
seconds from its start to the first 200 of /v1/models, and the memory of every process in its
group (a server of several processes, vLLM's API server and engine core, counts them all): the
peak of their summed PSS, sampled twice a second from ready to stop, and the sum of their own
peak RSS (VmHWM; an upper bound: pages they share count in each)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import threading
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
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
        time.sleep(0.2)  # (the ready time's resolution)
    raise SystemExit(f"server not ready after {timeout}s; see {log}")


def group_memory(pgid: int) -> list[tuple[str, int, int]]:
    """(name, VmHWM bytes, Pss bytes) of every live process of process group `pgid`."""
    out = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            # /proc/PID/stat: "pid (comm) state ppid pgrp ..."; comm may hold spaces and parentheses
            stat = (entry / "stat").read_text()
            if int(stat.rsplit(")", 1)[1].split()[2]) != pgid:
                continue
            hwm = _kb(entry / "status", "VmHWM:")
            pss = _kb(entry / "smaps_rollup", "Pss:")
        except (OSError, IndexError, ValueError):
            continue  # (gone meanwhile, or not ours to read)
        out.append((stat[stat.index("(") + 1 : stat.rindex(")")], hwm, pss))
    return out


def _kb(path: Path, key: str) -> int:
    for line in path.read_text().splitlines():
        if line.startswith(key):
            return int(line.split()[1]) * 1024
    return 0


def group_peak_rss(pgid: int) -> tuple[int, int]:
    """(bytes: the sum of VmHWM over the live processes of process group `pgid`, how many)."""
    mem = group_memory(pgid)
    return sum(hwm for _, hwm, _ in mem), len(mem)


@dataclass
class Server:
    """A running server: its process (the group's leader), seconds from its start to ready, and its
    memory: the peak of its processes' summed PSS (sampled twice a second while it runs: a page two
    processes share counts once, as it should for a forked or spawned helper) and, read as it is
    stopped, the sum of their VmHWM (each process's own peak RSS: an upper bound, shared pages
    counted in every process; for a one-process server, its peak RSS)."""

    proc: subprocess.Popen
    ready_s: float
    peak_rss: int = 0  # bytes
    peak_pss: int = 0  # bytes
    names: tuple[str, ...] = ()

    @property
    def processes(self) -> int:
        return len(self.names)

    def sample(self) -> None:
        mem = group_memory(self.proc.pid)
        if mem:  # (a server that already exited keeps the last figures)
            self.peak_pss = max(self.peak_pss, sum(pss for _, _, pss in mem))
            self.peak_rss = sum(hwm for _, hwm, _ in mem)
            self.names = tuple(name for name, _, _ in mem)

    def describe(self) -> str:
        procs = f" ({self.processes} processes: {', '.join(self.names)})" if self.processes > 1 else ""
        return (
            f"ready {self.ready_s:.1f} s, peak PSS {self.peak_pss / 1e9:.3f} GB, "
            f"peak RSS {self.peak_rss / 1e9:.3f} GB{procs}"
        )

    def figures(self) -> dict:
        return {
            "ready_s": self.ready_s,
            "peak_pss_GB": self.peak_pss / 1e9,
            "peak_rss_GB": self.peak_rss / 1e9,
            "processes": self.processes,
            "names": list(self.names),
        }


def _sample_until(server: Server, done: threading.Event, every: float = 0.5) -> None:
    while not done.wait(every):
        server.sample()


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
) -> Iterator[Server]:
    """The server `cmd` started (under the normal scheduling policy: server_prefix) and ready on
    `port`; its peak RSS read, then it is stopped, when the block ends."""
    t0 = time.perf_counter()
    with open(log, "w") as f:
        proc = subprocess.Popen(
            server_prefix() + cmd, env=env, stdout=f, stderr=subprocess.STDOUT, cwd=cwd, start_new_session=True
        )
    server, done = None, threading.Event()
    try:
        wait_ready(proc, port, log, start_timeout)
        server = Server(proc, time.perf_counter() - t0)
        server.sample()
        threading.Thread(target=_sample_until, args=(server, done), daemon=True).start()
        yield server
    finally:
        done.set()
        if server is not None:
            server.sample()
        stop(proc)
