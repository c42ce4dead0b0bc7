"""What a step's message says of each sequence's block table and tokens: deltas.

The worker keeps its own copy of each sequence it runs (engine/worker/seq_states.py); a record
carries only what changed since the last message that carried the sequence:
  * its block table from the first column that differs (`blocks_from`, `new_block_ids`): in a
    steady decode nothing, or the block a sequence just took. The core's allocator replaces a
    table list, or bumps `Sequence.table_version`, whenever it changes a table other than by
    appending (copy-on-write, trimmed drafts, preemption, swap, prefix hits): then it goes whole.
  * its tokens from the first position that may differ (`history_from`, `new_history`): tokens
    before the first placeholder are final once sent (only placeholders are ever replaced, and
    tokens after a stop are cut from a sequence that is finished then), so a steady decode sends
    the token its last step sampled and the placeholder of the step in flight.
A sequence seen for the first time, or again after a preemption, is sent whole. Applying a
delta twice changes nothing.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from engine.core.request import Sequence


class SeqDeltas:
    def __init__(self) -> None:
        # seq id -> [table list sent, its table_version then, columns sent, token list sent,
        #            tokens known (not placeholders) when sent]
        self._sent: dict[int, list] = {}
        self.dropped: list[int] = []  # sent sequences finished or preempted since the last message

    def delta(self, seq: Sequence) -> tuple[int, list[int], int, list[int]]:
        """(blocks_from, new_block_ids, history_from, new_history) for seq's record in the
        message being built."""
        blocks, ids = seq.block_ids, seq.token_ids
        sent = self._sent.get(seq.seq_id)
        if sent is None or sent[3] is not ids:
            self._sent[seq.seq_id] = [blocks, seq.table_version, len(blocks), ids, len(ids) - seq.num_pending]
            return 0, blocks[:], 0, ids[:]
        start = sent[4]
        sent[4] = len(ids) - seq.num_pending
        b = sent[2]
        if sent[0] is blocks and sent[1] == seq.table_version:
            if b == len(blocks):  # (the steady state: no new block)
                return b, [], start, ids[start:]
        else:
            b = 0
            sent[0], sent[1] = blocks, seq.table_version
        sent[2] = len(blocks)
        return b, blocks[b:], start, ids[start:]

    def history(self, seq: Sequence) -> tuple[int, list[int]]:
        """(history_from, new_history) of a sequence sent before: its tokens as they stand now
        (a deferred sampling's rows read what the previous step's processing learnt)."""
        sent = self._sent[seq.seq_id]
        ids = seq.token_ids
        start = sent[4]
        sent[4] = len(ids) - seq.num_pending
        return start, ids[start:]

    def drop(self, seq_id: int) -> None:
        """The sequence finished or was preempted: the next message that the worker builds tells
        it to drop its copy (a preempted one comes back whole)."""
        if self._sent.pop(seq_id, None) is not None:
            self.dropped.append(seq_id)

    def take_dropped(self) -> list[int]:
        dropped, self.dropped = self.dropped, []
        return dropped

    def sent(self) -> set[int]:
        """The sequences the worker holds a copy of, once it has built the messages so far."""
        return set(self._sent)
