"""The worker's own block table of each sequence, kept from the messages' deltas.

A step's message carries, per scheduled sequence, the column from which its table changed
since the last message that carried it and the table from there (engine/core/sched/
table_deltas.py), and the sequences whose tables to drop (finished or preempted). A table the
delta only extends grows in place; one it rewrites becomes a new list, so the input buffers,
which compare rows by list identity and length (engine/worker/input_buffers.py), rewrite that
row. A delta applied twice changes nothing (a draft model's runner builds from the target's
records too).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from engine.core.sched.scheduler_output import ScheduledSeq


class BlockTables:
    def __init__(self) -> None:
        self.tables: dict[int, list[int]] = {}  # seq id -> its block ids

    def drop(self, seq_ids: list[int]) -> None:
        tables = self.tables
        for seq_id in seq_ids:
            tables.pop(seq_id, None)

    def apply(self, s: ScheduledSeq) -> list[int]:
        """s's table once its delta is applied."""
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
