"""InputBuffers: every static input of a step, host staging + device tensor, sized for the largest step.

A step fills the host side (numpy views), then `upload` copies the used prefix to the device
without blocking; block-table rows are rewritten only where they changed, and only the changed
cells go to the device. Compiled steps and captured CUDA graphs read the device tensors in
place, so nothing here is ever reallocated.

On a GPU the host side of a step's arrays is pinned staging that the host may refill only once
the copies reading it have run. With one set of staging (the target's runner: one step at a
time) the next build waits for the previous upload. A runner that queues several forwards a step
(a draft model's or an EAGLE head's: k + 1) takes a ring of staging slots (`use_staging_ring`):
each build fills the next slot and waits only for the copies of the build that used it `slots`
builds ago, so the host runs ahead of the device. The block table's host side stays one mirror
(only changed cells are sent, through the slot's staging); a whole-table copy from it, rare, is
waited for before the mirror changes again.
"""

from __future__ import annotations

import numpy as np
import torch

# The host arrays each build refills (one set per staging slot); the block table's mirror is apart.
_STAGED = (
    ("input_ids", "max_tokens", torch.int64),
    ("positions", "max_tokens", torch.int64),
    ("slot_mapping", "max_tokens", torch.int64),
    ("query_start_loc", "seqs_plus_one", torch.int32),
    ("seq_lens", "max_seqs", torch.int32),
    ("table_idx", "two_per_seq", torch.int64),  # block-table cells changed since the last upload
    ("table_val", "two_per_seq", torch.int32),
    ("feed_dst", "max_seqs", torch.int64),  # overlap scheduling: input rows fed the previous step's
    ("feed_src", "max_seqs", torch.int64),  # sampled rows
)
_NUMPY_VIEWS = ("input_ids", "positions", "slot_mapping", "query_start_loc", "seq_lens", "feed_dst", "feed_src")


class StagingRing:
    """Slots of host staging, each with the event its last copies recorded: `take()` moves to
    the next slot and waits (only) for that slot's copies if they have not run yet."""

    def __init__(self, slots: list[dict[str, torch.Tensor]], make_event) -> None:
        self.slots = slots
        self.events = [make_event() for _ in slots] if make_event is not None else None
        self.pending = [False] * len(slots)
        self.current = 0
        self.waits = 0  # times the host waited for a slot's copies (a test reads it)

    def take(self) -> dict[str, torch.Tensor]:
        self.current = (self.current + 1) % len(self.slots)
        i = self.current
        if self.pending[i]:
            assert self.events is not None  # (pending only where events are recorded)
            if not self.events[i].query():
                self.waits += 1
                self.events[i].synchronize()
            self.pending[i] = False
        return self.slots[i]

    def in_use(self) -> None:
        """Copies queued since the slot was taken read it: record when they have run."""
        if self.events is not None:
            self.events[self.current].record()
            self.pending[self.current] = True


class InputBuffers:
    """Every static input of a step, host staging + device tensor, sized for the largest step."""

    # Device tensors (_STAGED: set in __init__, never replaced) and the current staging slot's host
    # arrays and their numpy views (rebound per build by _bind).
    input_ids: torch.Tensor
    positions: torch.Tensor
    slot_mapping: torch.Tensor
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    table_idx: torch.Tensor
    table_val: torch.Tensor
    feed_dst: torch.Tensor
    feed_src: torch.Tensor
    input_ids_host: torch.Tensor
    positions_host: torch.Tensor
    slot_mapping_host: torch.Tensor
    query_start_loc_host: torch.Tensor
    seq_lens_host: torch.Tensor
    table_idx_host: torch.Tensor
    table_val_host: torch.Tensor
    feed_dst_host: torch.Tensor
    feed_src_host: torch.Tensor
    np_input_ids: np.ndarray
    np_positions: np.ndarray
    np_slot_mapping: np.ndarray
    np_query_start_loc: np.ndarray
    np_seq_lens: np.ndarray
    np_feed_dst: np.ndarray
    np_feed_src: np.ndarray

    def __init__(self, max_tokens: int, max_seqs: int, max_blocks_per_seq: int, device: torch.device) -> None:
        self.max_tokens = max_tokens
        self.max_seqs = max_seqs
        self.max_blocks_per_seq = max_blocks_per_seq
        self.device = device
        self._pin = device.type == "cuda"
        on_cpu = device.type == "cpu"
        self._sizes = {
            "max_tokens": max_tokens,
            "seqs_plus_one": max_seqs + 1,
            "max_seqs": max_seqs,
            "two_per_seq": max_seqs * 2,
        }
        host = self._host_set()
        # On the CPU the host staging is the device tensor (nothing to copy, and no ring).
        for name, size, dtype in _STAGED:
            dev = host[name] if on_cpu else torch.zeros(self._sizes[size], dtype=dtype, device=device)
            setattr(self, name, dev)
        self.block_tables_host = torch.zeros((max_seqs, max_blocks_per_seq), dtype=torch.int32, pin_memory=self._pin)
        self.block_tables = (
            self.block_tables_host
            if on_cpu
            else torch.zeros((max_seqs, max_blocks_per_seq), dtype=torch.int32, device=device)
        )
        self.np_block_tables = self.block_tables_host.numpy()
        self._ring = StagingRing([host], torch.cuda.Event if device.type == "cuda" else None)
        self._views: dict[int, dict[str, object]] = {}  # id(slot) -> its attributes (_bind)
        self._bind(host)
        # What each block-table row holds on the host: (the sequence's block list, columns
        # written); a row is rewritten only from the first column that changed. The lists are the
        # worker's own tables (engine/worker/seq_states.py): only ever extended in place, so a
        # list and its length name what a row holds.
        self._rows: list[tuple[list[int] | None, int]] = [(None, 0)] * max_seqs
        self._table_updates: list[tuple[int, int]] = []
        self._max_table_updates = max_seqs * 2  # (the cells table_idx / table_val hold)
        # On the CPU the host table is the device table: no changed cells to send anywhere.
        self._table_dirty = on_cpu  # too many changes: copy the used table region whole
        # A whole-table copy reads the mirror: it may change again only once that copy has run.
        self._mirror_copied = torch.cuda.Event() if device.type == "cuda" else None
        self._mirror_pending = False

    def _host_set(self) -> dict[str, torch.Tensor]:
        return {
            name: torch.zeros(self._sizes[size], dtype=dtype, pin_memory=self._pin) for name, size, dtype in _STAGED
        }

    def _bind(self, host: dict[str, torch.Tensor]) -> None:
        """The builder fills `<name>_host` / `np_<name>`: point them at this slot's arrays."""
        views = self._views.get(id(host))
        if views is None:
            views = {f"{name}_host": tensor for name, tensor in host.items()}
            views.update({f"np_{name}": host[name].numpy() for name in _NUMPY_VIEWS})
            self._views[id(host)] = views
        self.__dict__.update(views)

    def use_staging_ring(self, slots: int) -> None:
        """Give the host side `slots` staging slots (a GPU runner that queues several forwards a
        step); on the CPU there is nothing to stage."""
        if self.device.type != "cuda" or slots <= len(self._ring.slots):
            return
        self.wait_staging()  # (the current slot's copies, before its arrays join the ring)
        current = self._ring.slots[self._ring.current]
        ring = [current] + [self._host_set() for _ in range(slots - 1)]
        self._ring = StagingRing(ring, torch.cuda.Event)
        self._bind(current)

    @property
    def staging_waits(self) -> int:
        return self._ring.waits

    def wait_staging(self) -> None:
        """Before a build fills the host side: the next staging slot, once its copies have run
        (and the block-table mirror, after a whole-table copy)."""
        ring = self._ring
        if len(ring.slots) > 1:
            self._bind(ring.take())
        elif ring.pending[0]:
            ring.take()
        if self._mirror_pending:
            assert self._mirror_copied is not None  # (pending only on a GPU)
            self._mirror_copied.synchronize()
            self._mirror_pending = False

    def staging_in_use(self) -> None:
        """Copies queued since upload() read the host staging too: wait for them as well."""
        self._ring.in_use()

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

    def fill_tail(self, start: int, end: int) -> None:
        """Host token rows [start, end) as rows no sequence claims: token 0, position 0, slot -1."""
        self.np_input_ids[start:end] = 0
        self.np_positions[start:end] = 0
        self.np_slot_mapping[start:end] = -1

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
            assert self._mirror_copied is not None  # (uploads happen on a GPU only)
            self._mirror_copied.record()
            self._mirror_pending = True
        elif updates:
            k = len(updates)
            cells = np.array(updates, dtype=np.int64).reshape(k, 2)
            self.table_idx_host.numpy()[:k] = cells[:, 0]
            self.table_val_host.numpy()[:k] = cells[:, 1]
            self.table_idx[:k].copy_(self.table_idx_host[:k], non_blocking=True)
            self.table_val[:k].copy_(self.table_val_host[:k], non_blocking=True)
            self.block_tables.view(-1).index_copy_(0, self.table_idx[:k], self.table_val[:k])
        self.staging_in_use()
