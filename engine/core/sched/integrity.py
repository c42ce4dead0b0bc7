"""The scheduler's invariants, checked by tests and benches after steps (never on the hot path)."""

from __future__ import annotations

import itertools
from typing import TYPE_CHECKING

from engine.core.request import SeqStatus

if TYPE_CHECKING:
    from engine.core.sched.scheduler import Scheduler


def check_scheduler(sched: "Scheduler") -> None:
    """The pool's own invariants plus: every reference is held by a live sequence, each sequence
    is queued once under its status, seats and reusable records agree with the queues."""
    swapped = sched.swapper.gpu_references() if sched.swapper is not None else None
    sched.kv.check_integrity(sched.running, sched.waiting, sched.swapped, swapped)
    if sched.swapper is not None:
        sched.swapper.check_integrity(sched.swapped)
    ids = [s.seq_id for s in itertools.chain(sched.waiting, sched.running, sched.swapped)]
    assert len(ids) == len(set(ids)), "a sequence is queued twice"
    for queue, status in (
        (sched.running, SeqStatus.RUNNING),
        (sched.waiting, SeqStatus.WAITING),
        (sched.swapped, SeqStatus.SWAPPED),
    ):
        assert all(s.status is status for s in queue), f"a sequence in the {status.value} queue is not"
    assert sched._seats_used() <= sched.config.max_num_seqs, "more running seats than max_num_seqs"
    assert set(sched._spare) <= {s.seq_id for s in itertools.chain(sched.running, sched.waiting, sched.swapped)}, (
        "a reusable record kept for a finished sequence"
    )
