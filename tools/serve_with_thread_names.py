"""Run `python -m engine.entrypoints.cli ...` from the current directory with each Python thread's
name given to its OS thread (so /proc/PID/task/*/comm tells kiln-outputs from kiln-step-loop),
and optionally a sampling profiler of the Python threads: tools/bench_output_cost.py's launcher.

    python tools/serve_with_thread_names.py [--sample-to FILE] -- serve MODEL ...

With --sample-to, SIGUSR1 starts sampling (every 2 ms, each thread's Python stack while the OS
says it is running) and SIGUSR2 stops it and writes FILE: one line per thread and stack,
"thread;outer;...;inner count" (collapsed stacks, as flame-graph tools read them).
"""

from __future__ import annotations

import ctypes
import os
import runpy
import signal
import sys
import threading
import time
from collections import Counter

_PR_SET_NAME = 15


def name_os_threads() -> None:
    """Every Python thread started from now on names its OS thread (15 bytes at most, prctl's limit)."""
    libc = ctypes.CDLL(None, use_errno=True)
    original = threading.Thread._bootstrap_inner  # type: ignore[attr-defined]

    def bootstrap(self) -> None:
        libc.prctl(_PR_SET_NAME, self.name.encode()[:15], 0, 0, 0)
        original(self)

    threading.Thread._bootstrap_inner = bootstrap  # type: ignore[attr-defined]


class Sampler:
    """Python stacks of the threads that are on a CPU, counted."""

    def __init__(self, path: str, interval_s: float = 0.002) -> None:
        self.path, self.interval_s = path, interval_s
        self.on = threading.Event()
        self.counts: Counter[str] = Counter()
        self.pid = os.getpid()
        signal.signal(signal.SIGUSR1, lambda *_: self.start())
        signal.signal(signal.SIGUSR2, lambda *_: self.stop())
        threading.Thread(target=self.run, name="sampler", daemon=True).start()

    def running(self, native_id: int) -> bool:
        try:
            with open(f"/proc/{self.pid}/task/{native_id}/stat", "rb") as f:
                return f.read().rsplit(b")", 1)[1].split()[0] == b"R"
        except OSError:
            return False

    def run(self) -> None:
        me = threading.get_ident()
        while True:
            self.on.wait()
            frames = sys._current_frames()
            for thread in threading.enumerate():
                frame = frames.get(thread.ident or -1)
                if frame is None or thread.ident == me or thread.native_id is None:
                    continue
                if not self.running(thread.native_id):
                    continue
                stack = []
                while frame is not None:
                    code = frame.f_code
                    stack.append(f"{os.path.basename(code.co_filename)}:{code.co_name}")
                    frame = frame.f_back
                self.counts[";".join([thread.name, *reversed(stack)])] += 1
            time.sleep(self.interval_s)

    def start(self) -> None:
        self.counts.clear()
        self.on.set()

    def stop(self) -> None:
        self.on.clear()
        with open(self.path, "w") as f:
            for stack, count in self.counts.most_common():
                f.write(f"{stack} {count}\n")


def main() -> None:
    argv = sys.argv[1:]
    sample_to = None
    if argv[:1] == ["--sample-to"]:
        sample_to, argv = argv[1], argv[2:]
    if argv[:1] == ["--"]:
        argv = argv[1:]
    name_os_threads()
    if sample_to:
        Sampler(sample_to)
    sys.path.insert(0, os.getcwd())  # the tree being measured, not this file's
    sys.argv = ["kiln", *argv]
    runpy.run_module("engine.entrypoints.cli", run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
