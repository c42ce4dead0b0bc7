"""A start-up phase, logged when it starts and with how long it took, the process's CPU seconds in
it (all threads: on a busy machine the wall time says more about the neighbours than about kiln)
and its resident memory (now and at its peak) when it ends, so a cold start says what it is doing
and where the time and memory go (issue 40: weights, conversion, packing, KV, each phase's share)."""

from __future__ import annotations

import logging
import time

logger = logging.getLogger(__name__)


def resident_memory() -> tuple[int, int] | None:
    """(resident bytes now, peak resident bytes) of this process, from /proc (None elsewhere)."""
    try:
        with open("/proc/self/status") as f:
            fields = dict(line.split(":", 1) for line in f if line.startswith(("VmRSS", "VmHWM")))
        return int(fields["VmRSS"].split()[0]) * 1024, int(fields["VmHWM"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        return None


def describe_memory() -> str:
    """'RSS 2.61 GB, peak 2.70 GB', or '' where /proc says nothing."""
    rss = resident_memory()
    return "" if rss is None else f"RSS {rss[0] / 1e9:.2f} GB, peak {rss[1] / 1e9:.2f} GB"


class Phase:
    def __init__(self, what: str) -> None:
        self.what = what

    def __enter__(self) -> "Phase":
        logger.info("%s ...", self.what)
        self.t0, self.cpu0 = time.perf_counter(), time.process_time()
        return self

    def __exit__(self, *exc) -> None:
        self.seconds = time.perf_counter() - self.t0
        self.cpu_seconds = time.process_time() - self.cpu0
        if exc[0] is None:
            memory = describe_memory()
            logger.info(
                "%s: done in %.1fs (CPU %.1fs%s)",
                self.what,
                self.seconds,
                self.cpu_seconds,
                f"; {memory}" if memory else "",
            )
