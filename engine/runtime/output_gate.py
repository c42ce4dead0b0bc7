"""The step_waits_for_outputs setting: the step thread starts the next step only once the output
side has handed out the previous one (the output thread has built its outputs and the event loop
has run their delivery).

Why: on a CPU whose cores all run the forward's thread team, the output thread's detokenising and
the event loop's streaming share those cores with the next forward; a team thread that loses its
core holds every other thread at the next barrier, so a few milliseconds of output work can
stretch a step by more than their own length, at random: the inter-token tail. Waiting puts that
work between the steps instead (the step loop is idle for it: a cost per step, measured in
docs/benchmarks.md). Off by default; a no-op object when off.
"""

from __future__ import annotations

import threading
from typing import Any, Callable

# Longest wait for one step's hand-out: past this the step goes ahead (a stalled loop must not
# stop generation; back-pressure is the outbox's business, not this gate's).
MAX_WAIT_S = 1.0


class OutputGate:
    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self._done = threading.Event()
        self._lock = threading.Lock()
        self._left = 0  # event loops yet to run this step's delivery

    def before_send(self) -> None:
        """(step thread) A step's outputs are about to go to the output thread."""
        if self.enabled:
            self._done.clear()

    def wait(self, output_thread_alive: Callable[[], bool]) -> None:
        """(step thread) Until the outputs sent last were delivered (or MAX_WAIT_S passed)."""
        if not self.enabled:
            return
        waited = 0.0
        while not self._done.wait(0.05):
            waited += 0.05
            if waited >= MAX_WAIT_S or not output_thread_alive():
                return

    def delivered(self, loops: list[Any]) -> None:
        """(output thread) The step's outputs were posted to these event loops: the gate opens
        when each has run a callback queued behind them (at once when there are none)."""
        if not self.enabled:
            return
        with self._lock:
            self._left = len(loops)
        for loop in loops:
            try:
                loop.call_soon_threadsafe(self._one_done)
            except RuntimeError:  # (a closed loop)
                self._one_done()
        if not loops:
            self._done.set()

    def _one_done(self) -> None:
        with self._lock:
            self._left -= 1
            if self._left > 0:
                return
        self._done.set()
