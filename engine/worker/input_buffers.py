"""InputBuffers: every static input of a step, host staging + device tensor, sized for the largest step.

A step fills the host side (numpy views), then `upload` copies the used prefix to the device
without blocking; block-table rows are rewritten only where they changed, and only the changed
cells go to the device. Compiled steps and captured CUDA graphs read the device tensors in
place, so nothing here is ever reallocated.
"""

from __future__ import annotations

import numpy as np
import torch


class InputBuffers:
    """Every static input of a step, host staging + device tensor, sized for the largest step."""

    def __init__(self, max_tokens: int, max_seqs: int, max_blocks_per_seq: int, device: torch.device) -> None:
        self.max_tokens = max_tokens
        self.max_seqs = max_seqs
        self.max_blocks_per_seq = max_blocks_per_seq
        self.device = device
        pin = device.type == "cuda"

        def pair(shape, dtype):
            host = torch.zeros(shape, dtype=dtype, pin_memory=pin)
            dev = host if device.type == "cpu" else torch.zeros(shape, dtype=dtype, device=device)
            return host, dev

        self.input_ids_host, self.input_ids = pair(max_tokens, torch.int64)
        self.positions_host, self.positions = pair(max_tokens, torch.int64)
        self.slot_mapping_host, self.slot_mapping = pair(max_tokens, torch.int64)
        self.query_start_loc_host, self.query_start_loc = pair(max_seqs + 1, torch.int32)
        self.seq_lens_host, self.seq_lens = pair(max_seqs, torch.int32)
        self.block_tables_host, self.block_tables = pair((max_seqs, max_blocks_per_seq), torch.int32)
        # Block-table cells changed since the last upload (flat index, block id): only those go to
        # the device, unless a step changes more than a row's worth per sequence.
        self.table_idx_host, self.table_idx = pair(max_seqs * 2, torch.int64)
        self.table_val_host, self.table_val = pair(max_seqs * 2, torch.int32)
        # Overlap scheduling: input rows whose token is the previous step's sampled row.
        self.feed_dst_host, self.feed_dst = pair(max_seqs, torch.int64)
        self.feed_src_host, self.feed_src = pair(max_seqs, torch.int64)
        # numpy views of the host side for fast filling
        self.np_input_ids = self.input_ids_host.numpy()
        self.np_positions = self.positions_host.numpy()
        self.np_slot_mapping = self.slot_mapping_host.numpy()
        self.np_query_start_loc = self.query_start_loc_host.numpy()
        self.np_seq_lens = self.seq_lens_host.numpy()
        self.np_block_tables = self.block_tables_host.numpy()
        self.np_feed_dst = self.feed_dst_host.numpy()
        self.np_feed_src = self.feed_src_host.numpy()
        # What each block-table row holds on the host: (the sequence's block list, columns
        # written); a row is rewritten only from the first column that changed. The lists are the
        # worker's own tables (engine/worker/seq_states.py): only ever extended in place, so a
        # list and its length name what a row holds.
        self._rows: list[tuple[list[int] | None, int]] = [(None, 0)] * max_seqs
        self._table_updates: list[tuple[int, int]] = []
        self._max_table_updates = max_seqs * 2  # (the cells table_idx / table_val hold)
        # On the CPU the host table is the device table: no changed cells to send anywhere.
        self._table_dirty = device.type == "cpu"  # too many changes: copy the used table region whole
        # Host staging may be refilled only once the previous step's async copies have read it.
        self._copied = torch.cuda.Event() if device.type == "cuda" else None
        self._pending = False

    def wait_staging(self) -> None:
        if self._pending:
            self._copied.synchronize()
            self._pending = False

    def staging_in_use(self) -> None:
        """Copies queued since upload() read the host staging too: wait for them as well."""
        self._copied.record()
        self._pending = True

    def fill_padding(self, t: int, n: int, count: int, q: int = 1) -> None:
        """Host sequences [n, n+count), q tokens each from row t (a verify graph's rows: q > 1):
        slot -1, length 0."""
        if count <= 0:
            return
        end = t + count * q
        self.np_input_ids[t:end] = 0
        self.np_positions[t:end] = 0
        self.np_slot_mapping[t:end] = -1
        self.np_seq_lens[n : n + count] = 0
        self.np_query_start_loc[n + 1 : n + count + 1] = np.arange(t + q, end + 1, q)

    def write_table_rows(self, keys: list[tuple[list[int], int]]) -> None:
        """Rows [0, len(keys)) of the block table := keys[i] = (block list, its length): only the
        rows that differ from what the host holds are written (in a decode step, the few
        sequences that just took a new block)."""
        held = self._rows
        n = len(keys)
        if keys == held[:n]:  # (lists compare by identity first: no element walk when unchanged)
            return
        where: dict[int, int] | None = None  # id(block list) -> a row holding (a prefix of) it
        i = 0
        while i < n:
            blocks = keys[i][0]
            if keys[i] == held[i]:
                i += 1
                continue
            if where is None:
                where = {id(h[0]): j for j, h in enumerate(held) if h[0] is not None}
            j = where.get(id(blocks), -1)
            if j > i and held[j][0] is blocks:
                # Sequences before this one left the batch: a run of rows moved up by j - i. One
                # numpy copy of the run (rows below i are not read again), then any new columns.
                k = j - i
                end = i + 1
                while end < n and end + k < len(held) and held[end + k][0] is keys[end][0]:
                    end += 1
                self.np_block_tables[i:end] = self.np_block_tables[i + k : end + k]
                held[i:end] = held[i + k : end + k]
                self._table_dirty = True  # (the device gets the used region whole)
                for r in range(i, end):
                    if keys[r] != held[r]:
                        self.write_table_row(r, keys[r][0])
                i = end
                continue
            self.write_table_row(i, blocks)
            i += 1

    def write_table_row(self, i: int, blocks: list[int]) -> int:
        """Row i of the block table := blocks (the columns not written there already); returns
        the row's width."""
        held, written = self._rows[i]
        cols = len(blocks)
        start = written if held is blocks and written <= cols else 0
        if start < cols:
            self.np_block_tables[i, start:cols] = blocks[start:]
            self._rows[i] = (blocks, cols)
            if not self._table_dirty:
                if len(self._table_updates) + cols - start > self._max_table_updates:
                    self._table_dirty = True
                else:
                    base = i * self.max_blocks_per_seq
                    self._table_updates.extend((base + c, blocks[c]) for c in range(start, cols))
        return cols

    def upload(self, num_tokens: int, num_seqs: int, num_block_cols: int) -> None:
        """Copy the filled host prefix to the device (no-op on the CPU)."""
        if self.device.type == "cpu":
            return
        updates, self._table_updates = self._table_updates, []
        dirty, self._table_dirty = self._table_dirty, False
        for host, dev, n in (
            (self.input_ids_host, self.input_ids, num_tokens),
            (self.positions_host, self.positions, num_tokens),
            (self.slot_mapping_host, self.slot_mapping, num_tokens),
            (self.query_start_loc_host, self.query_start_loc, num_seqs + 1),
            (self.seq_lens_host, self.seq_lens, num_seqs),
        ):
            dev[:n].copy_(host[:n], non_blocking=True)
        if dirty:
            self.block_tables[:num_seqs, :num_block_cols].copy_(
                self.block_tables_host[:num_seqs, :num_block_cols], non_blocking=True
            )
        elif updates:
            k = len(updates)
            cells = np.array(updates, dtype=np.int64).reshape(k, 2)
            self.table_idx_host.numpy()[:k] = cells[:, 0]
            self.table_val_host.numpy()[:k] = cells[:, 1]
            self.table_idx[:k].copy_(self.table_idx_host[:k], non_blocking=True)
            self.table_val[:k].copy_(self.table_val_host[:k], non_blocking=True)
            self.block_tables.view(-1).index_copy_(0, self.table_idx[:k], self.table_val[:k])
        self.staging_in_use()
