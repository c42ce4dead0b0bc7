"""The process-level settings that must precede torch, applied in one place: `prepare_process()`.

torch's runtimes read them once, when torch loads, so each entry point calls it before it imports
torch (the `kiln` command, `engine/entrypoints/llm.py`, the tensor-parallel workers, the benchmarks
run as modules); importing `engine` itself changes nothing. It decides and exports, once per
process, and records what it decided in one `ProcessSetup`, which the engine reads at start-up.

- How idle OpenMP threads wait. OpenMP's default lets a thread spin for a long while after each
  parallel region; when another process holds the cores, the spinning threads steal the time
  the working ones need (measured on this 2-core machine: 339 ms per token with spinning, 69 ms
  passive), and fully passive waiting costs 20-45% on a quiet machine (every parallel region
  wakes sleeping threads; in a VM a wake-up of an idle vCPU costs tens of microseconds). So kiln
  sets libgomp's GOMP_SPINCOUNT by what it finds: if other processes keep kiln's cores busy at
  start, 1000 rounds of `pause` (~11-50 µs, then sleep), which measured faster than passive
  waiting with a busy neighbour (benchmarks/2026-11-30.md, session 4, and session 16: 0.77x with 10000
  there); on cores that are otherwise idle, 10000 (~0.1-0.5 ms): a decode step at batch 64 is
  ~300 parallel regions with Python between them, and with the short spin the second thread
  slept through most gaps (SmolLM2 bf16 offline 1.32x, session 16). A wait policy or spin count
  the user set is kept.
- KILN_CPU_ISA's cap on torch's own kernels (ATen's dispatch, oneDNN, MKL; engine/worker/cpu_isa.py
  caps kiln's kernels at engine start-up). A bad value is reported then, not here.
"""

from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass, field

from engine.config.process_env import cpu_isa_limit, export_openmp_spin, export_torch_isa_limit, openmp_wait_set_by_user

# GOMP_SPINCOUNT (libgomp is the OpenMP runtime of torch's Linux CPU builds): rounds of `pause`, which
# takes ~11 ns on Intel Sapphire Rapids, ~20 ns on AMD Zen 3, ~50 ns on Intel Skylake-SP.
QUIET_SPIN_COUNT = "10000"  # kiln's cores otherwise idle at start
SHARED_SPIN_COUNT = "1000"  # other processes busy on them
SHARED_FROM_CORES = 0.5  # other processes' load on kiln's cores, in cores, that makes them shared
PROBE_SECONDS = 0.1  # how long the start-up look at the cores' load takes


@dataclass(frozen=True)
class ProcessSetup:
    """What prepare_process decided for this process."""

    before_torch: bool  # whether torch had not loaded yet (else its runtimes had read their settings)
    openmp_wait: str = ""  # the OpenMP wait policy in force, in words ("": the runtime's default)
    cpu_isa: str | None = None  # KILN_CPU_ISA's level (None: no limit)
    cpu_isa_error: str | None = None  # a bad KILN_CPU_ISA, raised at engine start-up
    torch_isa: dict[str, str] = field(default_factory=dict)  # torch's ISA variables in force

    def wait_policy(self) -> str:
        """The OpenMP wait policy in force, in words, for the start-up log."""
        if not self.before_torch:
            return (
                f"runtime default (torch was imported before kiln; set GOMP_SPINCOUNT={QUIET_SPIN_COUNT} "
                f"before starting)"
            )
        return self.openmp_wait.lower() or "runtime default"


_SETUP: ProcessSetup | None = None  # (one per process: the environment torch read is the process's)


def prepare_process() -> ProcessSetup:
    """Apply the settings that must precede torch (the first call; later ones return its record).
    Called after torch loaded, it records that and changes nothing."""
    global _SETUP
    if _SETUP is None:
        _SETUP = _decide("torch" not in sys.modules)
    return _SETUP


def current_setup() -> ProcessSetup | None:
    """What prepare_process decided; None where it has not run."""
    return _SETUP


def _decide(before_torch: bool) -> ProcessSetup:
    try:
        level, error = cpu_isa_limit(), None
    except ValueError as exc:
        level, error = None, str(exc)
    if not before_torch:
        return ProcessSetup(before_torch=False, cpu_isa=level, cpu_isa_error=error)
    count, why = (None, "") if openmp_wait_set_by_user() else spin_count_for(cores_busy_elsewhere())
    policy = export_openmp_spin(count)
    return ProcessSetup(
        before_torch=True,
        openmp_wait=f"{policy} ({why})" if why and policy else policy,
        cpu_isa=level,
        cpu_isa_error=error,
        torch_isa=export_torch_isa_limit(level) if level is not None else {},
    )


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


def available_cores() -> list[int]:
    """The cores this process may run on (its affinity mask, which containers and taskset narrow)."""
    if hasattr(os, "sched_getaffinity"):
        return sorted(os.sched_getaffinity(0))
    return list(range(os.cpu_count() or 1))
