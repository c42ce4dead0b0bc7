"""Block tables as deltas: what a step's message says of each sequence's table.

The worker keeps its own block table per sequence (engine/worker/block_tables.py); a record
carries only what changed since the last message that carried the sequence: the column from
which its table differs (`blocks_from`) and a copy of the table from there. In a steady decode
that is nothing, or the one block a sequence just took. A table the core changed other than by
appending (copy-on-write, trimmed drafts, a table rebuilt after preemption, swap or prefix
hits) is sent whole. Applying a delta twice changes nothing (a draft model's runner builds
from the same records as the target's).

The core's allocator replaces a sequence's table list, or bumps `Sequence.table_version`,
whenever it changes a table other than by appending; so (list, version, length sent) tells
what the worker holds.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from engine.core.request import Sequence


class TableDeltas:
    def __init__(self) -> None:
        # seq id -> (the table list last sent, its table_version then, columns sent)
        self._sent: dict[int, tuple[list[int], int, int]] = {}
        self._dropped: list[int] = []  # sent sequences finished or preempted since the last message

    def delta(self, seq: Sequence) -> tuple[int, list[int]]:
        """(blocks_from, new_block_ids) for seq's record in the message being built."""
        blocks = seq.block_ids
        n = len(blocks)
        sent = self._sent.get(seq.seq_id)
        if sent is not None and sent[0] is blocks and sent[1] == seq.table_version:
            start = sent[2]
            if start == n:
                return n, []
        else:
            start = 0
        self._sent[seq.seq_id] = (blocks, seq.table_version, n)
        return start, blocks[start:]

    def drop(self, seq_id: int) -> None:
        """The sequence finished or was preempted: the next message that the worker builds tells
        it to drop its table (a preempted one comes back with a whole table)."""
        if self._sent.pop(seq_id, None) is not None:
            self._dropped.append(seq_id)

    def take_dropped(self) -> list[int]:
        dropped, self._dropped = self._dropped, []
        return dropped

    def pending_drops(self) -> list[int]:
        """Tables to drop that no message has carried yet."""
        return list(self._dropped)

    def sent(self) -> set[int]:
        """The sequences whose tables the worker holds, once it has built the messages so far."""
        return set(self._sent)
