"""CPU thread settings: how many compute threads, where they run, and how they wait.

Three things decide batch-1 CPU speed on a machine shared with other work:

- How idle threads wait. OpenMP's default lets a thread spin for a long while after each
  parallel region; when another process holds the cores, the spinning threads steal the time
  the working ones need (measured on this 2-core machine: 339 ms per token with spinning, 69 ms
  passive), and fully passive waiting costs 20-45% on a quiet machine (every parallel region
  wakes sleeping threads; in a VM a wake-up of an idle vCPU costs tens of microseconds). So kiln
  sets libgomp's GOMP_SPINCOUNT before torch loads, by what it finds: if other processes keep
  kiln's cores busy at start, 1000 rounds of `pause` (~11-50 µs, then sleep), which measured
  faster than passive waiting with a busy neighbour (BENCHMARKS.md, session 4, and session 16:
  0.77x with 10000 there); on cores that are otherwise idle, 10000 (~0.1-0.5 ms): a decode step
  at batch 64 is ~300 parallel regions with Python between them, and with the short spin the
  second thread slept through most gaps (SmolLM2 bf16 offline 1.32x, session 16). The runtime
  reads this once, when torch loads it, so `set_openmp_spin()` runs from `engine/__init__`,
  before anything imports torch. A wait policy or spin count the user set is kept.
- How many threads. The compute threads share the cores with the engine loop, the server and
  the tokenizer; from four cores up kiln leaves one core to them (vLLM's CPU backend does the
  same). On one or two cores it uses them all: leaving one of two idle halves the compute, and
  on a busy shared machine a single compute thread was measured 3-6x slower than two
  (BENCH_cpu.md; the engine loop is itself one of the compute threads, and with passive
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
import sys
import time
from dataclasses import dataclass

from engine.config.values import parse_core_list

logger = logging.getLogger(__name__)

# GOMP_SPINCOUNT (libgomp is the OpenMP runtime of torch's Linux CPU builds): rounds of `pause`, which
# takes ~11 ns on Intel Sapphire Rapids, ~20 ns on AMD Zen 3, ~50 ns on Intel Skylake-SP.
QUIET_SPIN_COUNT = "10000"  # kiln's cores otherwise idle at start
SHARED_SPIN_COUNT = "1000"  # other processes busy on them
SHARED_FROM_CORES = 0.5  # other processes' load on kiln's cores, in cores, that makes them shared
PROBE_SECONDS = 0.1  # how long the start-up look at the cores' load takes
# From this many cores up, one is left to the engine loop, the server and the tokenizer.
RESERVE_FROM_CORES = 4
# The wait policy in force, in words, and whether it was set before the OpenMP runtime loaded.
_WAIT_POLICY_STATE = {"policy": None, "in_time": False}


def set_openmp_spin() -> None:
    """Choose how long idle OpenMP threads spin before sleeping (spin_count_for, from the load other
    processes put on this process's cores), unless the environment already sets a wait policy or
    spin count. Effective only before torch is first imported (the runtime reads it at load)."""
    if _WAIT_POLICY_STATE["policy"] is not None:
        return
    from engine.config.process_env import export_openmp_spin, openmp_wait_set_by_user

    in_time = "torch" not in sys.modules  # (too late otherwise: the runtime has read its settings)
    policy = ""
    if in_time:
        count, why = (None, "") if openmp_wait_set_by_user() else spin_count_for(cores_busy_elsewhere())
        policy = export_openmp_spin(count)
        if why and policy:
            policy = f"{policy} ({why})"
    _WAIT_POLICY_STATE["policy"] = policy
    _WAIT_POLICY_STATE["in_time"] = in_time


def spin_count_for(busy_elsewhere: float | None) -> tuple[str, str]:
    """GOMP_SPINCOUNT for cores that other processes keep `busy_elsewhere` cores busy (None: not
    known), and why, in words."""
    if busy_elsewhere is None:
        return QUIET_SPIN_COUNT, "the cores' load could not be read"
    if busy_elsewhere >= SHARED_FROM_CORES:
        return SHARED_SPIN_COUNT, f"other processes kept {busy_elsewhere:.1f} of kiln's cores busy at start"
    return QUIET_SPIN_COUNT, "kiln's cores were otherwise idle at start"


def cores_busy_elsewhere(seconds: float = PROBE_SECONDS) -> float | None:
    """How many of this process's cores other processes keep busy, in cores: /proc/stat over
    `seconds`, less this process's own CPU time. None where /proc/stat cannot be read."""
    cores = available_cores()
    t0, own0, before = time.monotonic(), _own_cpu_seconds(), _cpu_ticks(cores)
    time.sleep(seconds)
    t1, own1, after = time.monotonic(), _own_cpu_seconds(), _cpu_ticks(cores)
    if before is None or after is None or after[1] <= before[1] or t1 <= t0:
        return None
    busy = len(cores) * (after[0] - before[0]) / (after[1] - before[1])
    return max(0.0, busy - (own1 - own0) / (t1 - t0))


def _cpu_ticks(cores: list[int]) -> tuple[int, int] | None:
    """(busy, all) clock ticks of `cores` since boot, from /proc/stat."""
    try:
        with open("/proc/stat") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    wanted = {f"cpu{c}" for c in cores}
    busy = total = 0
    for line in lines:
        fields = line.split()
        if fields and fields[0] in wanted:
            ticks = [int(x) for x in fields[1:9]]  # user nice system idle iowait irq softirq steal
            total += sum(ticks)
            busy += sum(ticks) - ticks[3] - ticks[4]
    return (busy, total) if total else None


def _own_cpu_seconds() -> float:
    t = os.times()
    return t.user + t.system


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


def wait_policy() -> str:
    """The OpenMP wait policy in force, in words, for the start-up log."""
    policy = _WAIT_POLICY_STATE["policy"]
    if policy is None or not _WAIT_POLICY_STATE["in_time"]:
        return (f"runtime default (torch was imported before kiln; set GOMP_SPINCOUNT={QUIET_SPIN_COUNT} "
                f"before starting)")
    return policy.lower() or "runtime default"


def available_cores() -> list[int]:
    """The cores this process may run on (its affinity mask, which containers and taskset narrow)."""
    if hasattr(os, "sched_getaffinity"):
        return sorted(os.sched_getaffinity(0))
    return list(range(os.cpu_count() or 1))


@dataclass(frozen=True)
class ThreadPlan:
    threads: int
    cores: list[int] | None  # pinned to these, or None: the OS places threads
    available: int  # cores the process could use before pinning

    def describe(self) -> str:
        where = f"pinned to cores {_compact(self.cores)}" if self.cores else "not pinned"
        return (f"{self.threads} compute thread{'s' if self.threads != 1 else ''} of {self.available} "
                f"available core{'s' if self.available != 1 else ''}, {where}, OpenMP wait policy {wait_policy()}")


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
            raise ValueError(f"cpu_bind: cores {outside} are not available to this process "
                             f"(available: {_compact(available)})")
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
    logger.info("CPU threads: %s", plan.describe())
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
