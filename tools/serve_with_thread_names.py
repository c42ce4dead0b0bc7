"""Run `python -m engine.entrypoints.cli ...` from the current directory with each Python thread's
name given to its OS thread (so /proc/PID/task/*/comm tells kiln-outputs from kiln-step-loop),
and optionally cProfile of the output side: tools/bench_output_cost.py's launcher.

    python tools/serve_with_thread_names.py THREADS_FILE [--profile-to PREFIX] -- serve MODEL ...

With --profile-to, SIGUSR1 starts profiling the event loop and SIGUSR2 writes PREFIX-loop.prof
and PREFIX-outputs.prof (see Profiles).
"""

from __future__ import annotations

import cProfile
import ctypes
import os
import pstats
import runpy
import signal
import sys
import threading

_PR_SET_NAME = 15


def name_os_threads(threads_to: str) -> None:
    """Every Python thread started from now on names its OS thread (15 bytes at most, prctl's
    limit) and appends "native id<TAB>name" to threads_to (threads it starts natively, such as
    its OpenMP team, inherit the OS name but are not listed)."""
    libc = ctypes.CDLL(None, use_errno=True)
    original = threading.Thread._bootstrap_inner  # type: ignore[attr-defined]
    with open(threads_to, "w") as f:
        f.write(f"{threading.main_thread().native_id}\tevent loop\n")

    def bootstrap(self) -> None:
        libc.prctl(_PR_SET_NAME, self.name.encode()[:15], 0, 0, 0)
        with open(threads_to, "a") as f:
            f.write(f"{threading.get_native_id()}\t{self.name}\n")
        original(self)

    threading.Thread._bootstrap_inner = bootstrap  # type: ignore[attr-defined]


class Profiles:
    """cProfile of the event loop (the main thread) between SIGUSR1 and SIGUSR2, and of the output
    thread (from its start: cProfile profiles only the thread that enables it), written at SIGUSR2
    to PREFIX-loop.prof and PREFIX-outputs.prof (pstats files)."""

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix
        self.loop = cProfile.Profile()
        self.outputs: cProfile.Profile | None = None
        signal.signal(signal.SIGUSR1, lambda *_: self.loop.enable())
        signal.signal(signal.SIGUSR2, lambda *_: self.dump())
        original = threading.Thread.run

        def run(thread: threading.Thread) -> None:
            if thread.name != "kiln-outputs":
                return original(thread)
            self.outputs = cProfile.Profile()
            self.outputs.enable()
            original(thread)

        threading.Thread.run = run  # type: ignore[method-assign]

    def dump(self) -> None:
        self.loop.disable()
        self.loop.dump_stats(f"{self.prefix}-loop.prof")
        self.loop = cProfile.Profile()
        if self.outputs is not None:
            self.outputs.snapshot_stats()  # (still enabled in its own thread)
            pstats.Stats(self.outputs).dump_stats(f"{self.prefix}-outputs.prof")


def main() -> None:
    threads_to, argv = sys.argv[1], sys.argv[2:]
    profile_to = None
    if argv[:1] == ["--profile-to"]:
        profile_to, argv = argv[1], argv[2:]
    if argv[:1] == ["--"]:
        argv = argv[1:]
    name_os_threads(threads_to)
    if profile_to:
        Profiles(profile_to)
    sys.path.insert(0, os.getcwd())  # the tree being measured, not this file's
    sys.argv = ["kiln", *argv]
    runpy.run_module("engine.entrypoints.cli", run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
