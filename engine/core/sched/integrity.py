"""The scheduler's invariants, checked by tests and benches after steps (never on the hot path)."""

from __future__ import annotations

import itertools
from typing import TYPE_CHECKING

from engine.core.request import SeqStatus

if TYPE_CHECKING:
    from engine.core.kv.allocator import KVAllocator
    from engine.core.kv.swap_space import SwapSpace
    from engine.core.request import Sequence


def check_queues(
    kv: "KVAllocator",
    swapper: "SwapSpace | None",
    running: "list[Sequence]",
    waiting: "list[Sequence]",
    swapped: "list[Sequence]",
    spare: dict,
) -> None:
    """The pool's own invariants plus: every reference is held by a live sequence, each sequence
    is queued once under its status, reusable decode records (`spare`) belong to live sequences."""
    swapped_refs = swapper.gpu_references() if swapper is not None else None
    kv.check_integrity(running, waiting, swapped, swapped_refs)
    if swapper is not None:
        swapper.check_integrity(swapped)
    ids = [s.seq_id for s in itertools.chain(waiting, running, swapped)]
    assert len(ids) == len(set(ids)), "a sequence is queued twice"
    for queue, status in ((running, SeqStatus.RUNNING), (waiting, SeqStatus.WAITING), (swapped, SeqStatus.SWAPPED)):
        assert all(s.status is status for s in queue), f"a sequence in the {status.value} queue is not"
    assert set(spare) <= set(ids), "a reusable record kept for a finished sequence"
