"""The scheduler's three queues, their orders, and the running seats.

  * waiting: priority, then arrival (lower `priority` value = more urgent), kept sorted as
    sequences come in;
  * running: the same order, most urgent first, kept sorted as it changes (the step does not
    sort it: admissions are rare); preemption takes its last one (engine/core/sched/preemption.py);
  * swapped: as they were swapped out; merged with waiting in admission order (`queue`).
A request with n > 1 samples stands for n running seats until it forks (`unforked`).
"""

from __future__ import annotations

import bisect
import heapq
import itertools
from typing import TYPE_CHECKING

from engine.core.request import SeqStatus

if TYPE_CHECKING:
    from collections.abc import Iterable

    from engine.core.request import Sequence


class SeqQueues:
    def __init__(self) -> None:
        self.waiting: list[Sequence] = []
        self.running: list[Sequence] = []  # kept in priority_key order (most urgent first)
        self.swapped: list[Sequence] = []
        self.order: dict[int, int] = {}  # seq id -> arrival order (FCFS tie-break)
        self.unforked: dict[int, Sequence] = {}  # n > 1 requests not forked yet: they hold n seats
        self._arrival = itertools.count()

    def arrived(self, seq: Sequence) -> None:
        """A new sequence takes its place in the arrival order."""
        self.order[seq.seq_id] = next(self._arrival)

    def priority_key(self, seq: Sequence) -> tuple[int, int]:
        return (seq.request.priority, self.order[seq.seq_id])

    def insert_waiting(self, seq: Sequence) -> None:
        seq.status = SeqStatus.WAITING
        bisect.insort(self.waiting, seq, key=self.priority_key)

    def insert_running(self, seq: Sequence) -> None:
        seq.status = SeqStatus.RUNNING
        bisect.insort(self.running, seq, key=self.priority_key)

    def remove(self, seq: Sequence) -> None:
        for queue in (self.waiting, self.running, self.swapped):
            if seq in queue:
                queue.remove(seq)

    def admit_key(self, seq: Sequence) -> tuple[int, int, int]:
        """Queue order for room: priority, swapped before waiting at equal priority, arrival."""
        return (seq.request.priority, 0 if seq.status is SeqStatus.SWAPPED else 1, self.order[seq.seq_id])

    def queue(self) -> "Iterable[Sequence]":
        """Swapped and waiting sequences in admission order (waiting is kept sorted already)."""
        if not self.swapped:
            return list(self.waiting)
        return heapq.merge(sorted(self.swapped, key=self.admit_key), list(self.waiting), key=self.admit_key)

    @staticmethod
    def seats(seq: Sequence) -> int:
        """Running slots a sequence stands for: a request that will fork holds all n."""
        return seq.request.params.n if not seq.request.forked else 1

    def seats_used(self) -> int:
        # No pass over the running queue: only unforked n > 1 requests hold extra seats.
        return len(self.running) + sum(
            s.request.params.n - 1
            for s in self.unforked.values()
            if s.status is SeqStatus.RUNNING and not s.request.forked
        )
