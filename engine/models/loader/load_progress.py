"""Feedback while a checkpoint's weights load: how much is read, of how much, and how long it took.

On a terminal (stderr is a TTY, INFO logging on) a tqdm bar counts the bytes; otherwise (a
server's log, a pipe) a log line says where loading stands every PROGRESS_INTERVAL_S seconds.
Either way one line opens the load (files, size) and one closes it (tensors, size, seconds,
rate), so a log shows what a slow start spent its time on.
"""

from __future__ import annotations

import logging
import sys
import time
from typing import TextIO

logger = logging.getLogger(__name__)

PROGRESS_INTERVAL_S = 5.0  # between progress lines when there is no terminal


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


class LoadProgress:
    """Counts what was loaded against `total` (bytes, or tensors with unit="tensors")."""

    def __init__(
        self, source: str, total: int, num_files: int, unit: str = "bytes", stream: TextIO | None = None
    ) -> None:
        self.source, self.total, self.unit = source, max(total, 0), unit
        self.done = 0
        self.tensors = 0
        self.nbytes = 0
        self.t0 = self.last = time.perf_counter()
        stream = stream if stream is not None else sys.stderr
        self.bar = None
        amount = _size(self.total) if unit == "bytes" else f"{self.total} tensors"
        logger.info("loading weights from %s: %d file%s, %s", source, num_files, "" if num_files == 1 else "s", amount)
        if logger.isEnabledFor(logging.INFO) and getattr(stream, "isatty", lambda: False)():
            from tqdm import tqdm

            self.bar = tqdm(
                total=self.total,
                desc="loading weights",
                file=stream,
                leave=False,
                dynamic_ncols=True,
                **(
                    {"unit": "B", "unit_scale": True, "unit_divisor": 1024} if unit == "bytes" else {"unit": " tensors"}
                ),
            )

    def advance(self, nbytes: int) -> None:
        """One tensor of nbytes (as stored in the checkpoint) was loaded."""
        self.tensors += 1
        self.nbytes += nbytes
        step = nbytes if self.unit == "bytes" else 1
        self.done += step
        if self.bar is not None:
            self.bar.update(step)
            return
        now = time.perf_counter()
        if now - self.last >= PROGRESS_INTERVAL_S:
            self.last = now
            logger.info(
                "loading weights: %s of %s (%.0f%%), %d tensors, %.1fs",
                self._amount(self.done),
                self._amount(self.total),
                100.0 * self.done / max(self.total, 1),
                self.tensors,
                now - self.t0,
            )

    def loaded_elsewhere(self, count: int) -> None:
        """`count` of the total were loaded by another path (GGUF tensors kept quantised): the bar
        reaches its end."""
        if count <= 0:
            return
        self.done += count
        if self.bar is not None:
            self.bar.update(count)

    def finish(self) -> float:
        """Close the bar and log the totals; returns the seconds it took."""
        seconds = time.perf_counter() - self.t0
        if self.bar is not None:
            self.bar.close()
            self.bar = None
        logger.info(
            "loaded %d tensors (%s) from %s in %.1fs (%s/s)",
            self.tensors,
            _size(self.nbytes),
            self.source,
            seconds,
            _size(self.nbytes / max(seconds, 1e-9)),
        )
        return seconds

    def _amount(self, n: int) -> str:
        return _size(n) if self.unit == "bytes" else str(n)
