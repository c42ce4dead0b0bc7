"""The worker's own copy of each sequence it runs: its block table and its token history, kept
from the messages' deltas (engine/core/sched/deltas.py).

A scheduled record says from which column its sequence's block table changed since the last
message that carried it, and from which position its tokens did, with a copy of each from
there; the message lists the sequences to drop (finished or preempted; a preempted one comes
back whole). A table the delta only extends grows in place, one it rewrites becomes a new list,
so the input buffers, which compare rows by list identity and length (engine/worker/
input_buffers.py), rewrite that row. A history is always updated in place: the sampler rows
that read it (penalties, logits processors, seeds, min_tokens) see it as it stands. Applying a
delta twice changes nothing (a draft model's runner builds from the target's records too).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from engine.core.sched.scheduler_output import ScheduledSeq


class SeqStates:
    def __init__(self) -> None:
        self.tables: dict[int, list[int]] = {}  # seq id -> its block ids
        self.histories: dict[int, list[int]] = {}  # seq id -> prompt + output tokens (PLACEHOLDER in flight)

    def held(self):
        """(table of, history of) a record, as held (its deltas applied already)."""
        tables, histories = self.tables, self.histories
        return (lambda s: tables[s.seq_id]), (lambda s: histories[s.seq_id])

    def drop(self, seq_ids: list[int]) -> None:
        tables, histories = self.tables, self.histories
        for seq_id in seq_ids:
            tables.pop(seq_id, None)
            histories.pop(seq_id, None)

    def table(self, s: ScheduledSeq) -> list[int]:
        """s's block table once its delta is applied."""
        start, new = s.blocks_from, s.new_block_ids
        table = self.tables.get(s.seq_id)
        if table is None:
            if start:
                raise RuntimeError(f"seq {s.seq_id}: a block-table delta from column {start} for a table never sent")
            table = self.tables[s.seq_id] = list(new)
            return table
        held = len(table)
        if start == held:
            table.extend(new)
        elif start > held:
            raise RuntimeError(f"seq {s.seq_id}: a block-table delta from column {start} past its {held} columns")
        elif table[start:] != new:  # (equal: this delta was applied already)
            table = self.tables[s.seq_id] = table[:start] + list(new)
        return table

    def history(self, s: ScheduledSeq) -> list[int]:
        """s's token history once its delta is applied."""
        return self.update_history(s.seq_id, s.history_from, s.new_history)

    def update_history(self, seq_id: int, start: int, new: list[int]) -> list[int]:
        history = self.histories.get(seq_id)
        if history is None:
            if start:
                raise RuntimeError(f"seq {seq_id}: a token delta from position {start} for a history never sent")
            history = self.histories[seq_id] = list(new)
            return history
        if start > len(history):
            raise RuntimeError(f"seq {seq_id}: a token delta from position {start} past its {len(history)} tokens")
        history[start:] = new
        return history
