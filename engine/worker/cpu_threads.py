"""CPU thread settings: how many compute threads, where they run, and how they wait.

Three things decide batch-1 CPU speed on a machine shared with other work:

- How idle threads wait: libgomp's spin before sleeping, chosen by the load other processes put on
  kiln's cores, must be set before torch loads (engine/config/process_setup.py: prepare_process);
  the start-up log says what it chose (apply_cpu_threads).
- How many threads. The compute threads share the cores with the engine loop, the server and
  the tokenizer; from four cores up kiln leaves one core to them (vLLM's CPU backend does the
  same). On one or two cores it uses them all: leaving one of two idle halves the compute, and
  on a busy shared machine a single compute thread was measured 3-6x slower than two
  (benchmarks/2026-11-29.md, CPU; the engine loop is itself one of the compute threads, and with passive
  waiting an idle thread costs nothing).
- Where they run. `cpu_bind` pins the process's threads to a list of cores (for a machine
  reserved to kiln); the default leaves placement to the OS, which can move a thread away from
  a core another process is busy on (a pinned thread cannot).

`apply_cpu_threads()` is called once at engine start-up and logs what it chose.

One more thing decides how long idle threads really spin: libgomp counts the threads of every
thread's team, and once they outnumber the available cores it cuts the spin of every idle thread
to 100 rounds of `pause`, whatever GOMP_SPINCOUNT says (its documented throttle). The server
builds the engine on the main thread (whose parallel regions leave it a team) and steps it on
another one (which makes a second team): on 2 cores, 3 threads; every idle thread then slept
between the ~150 parallel regions of a batch-16 step. So the thread that hands the engine to a
step thread gives its team back first (`release_openmp_team`).
"""

from __future__ import annotations

import ctypes
import logging
import os
import re
from dataclasses import dataclass

from engine.config.process_setup import available_cores, prepare_process
from engine.config.values import parse_core_list

logger = logging.getLogger(__name__)

# From this many cores up, one is left to the engine loop, the server and the tokenizer.
RESERVE_FROM_CORES = 4
# The OpenMP runtimes torch builds with (libgomp, LLVM's libomp, Intel's libiomp5), as loaded: the
# wheels' copies carry a hash (libgomp-a34b3233.so.1).
_OPENMP_LIBRARY = re.compile(r"/lib(gomp|omp|iomp5)([-.][^/]*)?\.so[^/]*$")
_OMP_PAUSE_SOFT = 1  # omp_pause_resource_t: the team's threads exit, the runtime stays initialised


def release_openmp_team() -> bool:
    """Give back the calling thread's OpenMP team (OpenMP 5.0's omp_pause_resource_all): its idle
    threads exit, and a later parallel region on this thread makes a new team. Call it on a thread
    that is done with parallel work and hands the engine to another one (see the module docstring).
    False where no OpenMP runtime is loaded or it cannot pause."""
    path = _loaded_openmp_library()
    if path is None:
        return False
    try:
        pause = ctypes.CDLL(path).omp_pause_resource_all  # (dlopen of a loaded library: the same copy)
    except (OSError, AttributeError):
        return False
    pause.argtypes, pause.restype = [ctypes.c_int], ctypes.c_int
    return pause(_OMP_PAUSE_SOFT) == 0


def _loaded_openmp_library() -> str | None:
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                path = line.rstrip("\n").partition("/")[2]
                if path and _OPENMP_LIBRARY.search("/" + path):
                    return "/" + path
    except OSError:
        pass
    return None


@dataclass(frozen=True)
class ThreadPlan:
    threads: int
    cores: list[int] | None  # pinned to these, or None: the OS places threads
    available: int  # cores the process could use before pinning

    def describe(self) -> str:
        where = f"pinned to cores {_compact(self.cores)}" if self.cores else "not pinned"
        return (
            f"{self.threads} compute thread{'s' if self.threads != 1 else ''} of {self.available} "
            f"available core{'s' if self.available != 1 else ''}, {where}"
        )


def plan_threads(cpu_threads: int | None, cpu_bind: str, available: list[int]) -> ThreadPlan:
    """Decide the thread count and pinning from the settings (pure: no side effects).

    cpu_threads None: one thread per core the process may use, minus one for the engine loop,
    server and tokenizer from RESERVE_FROM_CORES cores up. cpu_bind 'auto' and 'none' pin nothing; a core list
    pins to exactly those cores, which must be ones the process may use, and then the default
    thread count is one per listed core.
    """
    mode = cpu_bind.strip().lower()
    cores: list[int] | None = None
    if mode not in ("auto", "none"):
        cores = parse_core_list(mode)
        outside = [c for c in cores if c not in available]
        if outside:
            raise ValueError(
                f"cpu_bind: cores {outside} are not available to this process (available: {_compact(available)})"
            )
    if cpu_threads is not None:
        threads = cpu_threads
    elif cores is not None:
        threads = len(cores)
    else:
        threads = len(available) - 1 if len(available) >= RESERVE_FROM_CORES else max(1, len(available))
    return ThreadPlan(threads=threads, cores=cores, available=len(available))


def apply_cpu_threads(cpu_threads: int | None, cpu_bind: str) -> ThreadPlan:
    """Plan, then set torch's intra-op thread count and pin every thread of the process (threads
    started later, such as OpenMP's pool, inherit the mask). Logs the choice."""
    import torch

    plan = plan_threads(cpu_threads, cpu_bind, available_cores())
    if plan.cores is not None:
        _pin_process(plan.cores)
    if torch.get_num_threads() != plan.threads:
        torch.set_num_threads(plan.threads)
    logger.info("CPU threads: %s, OpenMP wait policy %s", plan.describe(), prepare_process().wait_policy())
    return plan


def _pin_process(cores: list[int]) -> None:
    try:
        tids = [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:
        tids = [0]
    for tid in tids:
        try:
            os.sched_setaffinity(tid, cores)
        except (OSError, ProcessLookupError):  # a thread that has just exited
            continue


def _compact(cores: list[int]) -> str:
    """[0, 1, 2, 5] -> '0-2,5'."""
    parts, start = [], None
    for i, c in enumerate(cores):
        if start is None:
            start = c
        if i + 1 == len(cores) or cores[i + 1] != c + 1:
            parts.append(str(start) if start == c else f"{start}-{c}")
            start = None
    return ",".join(parts)
