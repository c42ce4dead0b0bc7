"""SwapSpace: the CPU side of preemption by swap, as plain Python over ints.

A swapped-out sequence's KV lives in a pool of CPU blocks (sized by `swap_space_gb`; the
tensors and the copies are engine/worker/block_swapper.py's `BlockSwapper`). This module only decides
which block goes where and keeps the books; the scheduler turns its answers into
`SchedulerOutput.blocks_to_swap_out / blocks_to_swap_in`.

Rules
  * Only the blocks that hold computed tokens are kept (ceil(num_computed / block_size));
    anything allocated beyond them is simply freed.
  * A GPU block with ref count > 1 (a prefix-cache block shared with another sequence, a
    fork's shared prompt, a pinned warm-up prefix) is *not* moved: the swapped sequence
    keeps its reference to it, and the scheduler reports that reference to the pool's
    integrity check (`gpu_references`). A block with ref count 1 is moved: copied to a CPU
    block, then its GPU reference is dropped (a hashed block then stays in the prefix cache
    as cached-idle until it is evicted, its content unchanged).
  * On swap-in, a moved block whose KV is still in the GPU prefix cache (same chained digest;
    nobody evicted it meanwhile) is taken from there by reference instead of copied back.
  * CPU blocks freed by a swap-in are held back until the next step begins
    (`begin_step`), so a swap-out scheduled in the same step can never be handed a CPU
    block whose copy to the GPU is still queued behind it.
Accounting: free + deferred + used == num_blocks on the CPU side, every used CPU block
belongs to exactly one swapped sequence, and every swapped sequence has exactly one entry.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import cast

from engine.core.kv.block_pool import BlockPool
from engine.core.request import Sequence


class NoSwapSpaceError(RuntimeError):
    pass


@dataclass
class _Swapped:
    """Where a swapped sequence's blocks are: one entry per block of its table, in order."""

    on_gpu: list[bool]  # True: a GPU block the sequence still references; False: a CPU block
    ids: list[int]

    @property
    def num_cpu(self) -> int:
        return self.on_gpu.count(False)


class SwapSpace:
    """CPU block accounting for swapped-out sequences (no tensors here)."""

    def __init__(
        self, gpu_pool: BlockPool, num_cpu_blocks: int, bytes_per_block: int = 0, auto_min_tokens: int | None = None
    ) -> None:
        if num_cpu_blocks < 1:
            raise ValueError("a swap space needs at least one CPU block")
        self.gpu_pool = gpu_pool
        self.block_size = gpu_pool.block_size
        self.num_blocks = num_cpu_blocks
        self.bytes_per_block = bytes_per_block
        # auto mode's cost model (`auto_estimate`): both rates are measured while serving
        # (`observe_swap`, `observe_prefill`). Until both are known, auto swaps only a sequence
        # with at least auto_min_tokens tokens of KV to move.
        self.auto_min_tokens = self.block_size if auto_min_tokens is None else auto_min_tokens
        self.swap_seconds_per_byte: float | None = None
        self.recompute_seconds_per_token: float | None = None
        self._free: list[int] = list(range(num_cpu_blocks))  # a min-heap: low ids first, long runs
        self._deferred: list[int] = []
        self._entries: dict[int, _Swapped] = {}  # seq id -> its blocks
        # Counters (metrics): bytes scheduled to move each way, blocks kept on the GPU.
        self.bytes_out = 0
        self.bytes_in = 0
        self.blocks_out = 0
        self.blocks_in = 0
        self.blocks_kept = 0
        self.blocks_reused = 0  # swapped-out blocks found still cached on the GPU at swap-in: no copy
        self.blocks_discarded = 0  # swapped-out blocks dropped unread (request aborted or demoted)

    # ---- capacity ----
    @property
    def num_free(self) -> int:
        """CPU blocks a swap-out may take now."""
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free) - len(self._deferred)

    def usage(self) -> float:
        """Fraction of the CPU blocks holding swapped KV (metric cpu_cache_usage_perc)."""
        return self.num_used / self.num_blocks

    def is_fully_free(self) -> bool:
        return self.num_used == 0 and not self._entries

    def begin_step(self) -> None:
        """A new step: CPU blocks released by the previous step's swap-ins may be reused."""
        for block in self._deferred:
            heapq.heappush(self._free, block)
        self._deferred.clear()

    # ---- decisions ----
    def _kept_prefix(self, seq: Sequence) -> int:
        return -(-seq.num_computed_tokens // self.block_size)

    def _movable(self, seq: Sequence) -> tuple[int, int]:
        """(blocks, computed tokens in them) that a swap-out would copy: the kept blocks that
        only this sequence references (shared ones stay on the GPU)."""
        bs = self.block_size
        computed = seq.num_computed_tokens
        blocks = tokens = 0
        for i, block in enumerate(seq.block_ids[: self._kept_prefix(seq)]):
            if self.gpu_pool.ref_count(block) == 1:
                blocks += 1
                tokens += min(bs, computed - i * bs)
        return blocks, tokens

    def can_swap_out(self, seq: Sequence, mode: str) -> bool:
        """swap: whenever the CPU has room. auto: also only when the KV is worth keeping.

        Worth keeping (auto): copying the movable blocks out and back in is estimated to take
        less time than recomputing their tokens (`auto_estimate`); before both rates have been
        measured, when at least `auto_min_tokens` tokens would move. KV that sits in shared
        blocks stays on the GPU either way (and comes back as prefix hits), so it counts for
        neither side; with nothing movable, recompute.
        """
        movable, movable_tokens = self._movable(seq)
        if movable > self.num_free:
            return False
        if mode != "auto":
            return True
        if movable == 0:
            return False
        estimate = self.auto_estimate(seq)
        if estimate is None:
            return movable_tokens >= self.auto_min_tokens
        swap_seconds, recompute_seconds = estimate
        return swap_seconds < recompute_seconds

    def auto_estimate(self, seq: Sequence) -> tuple[float, float] | None:
        """(seconds to swap the movable blocks out and back in, seconds to recompute their
        tokens) at the measured rates; None until both rates are known."""
        if self.swap_seconds_per_byte is None or self.recompute_seconds_per_token is None:
            return None
        movable, movable_tokens = self._movable(seq)
        return (
            2 * movable * self.bytes_per_block * self.swap_seconds_per_byte,
            movable_tokens * self.recompute_seconds_per_token,
        )

    # ---- measured rates (auto mode's cost model) ----
    def observe_swap(self, num_bytes: int, seconds: float) -> None:
        """One batch of copies took `seconds` for `num_bytes` (both directions together)."""
        if num_bytes > 0 and seconds > 0:
            self.swap_seconds_per_byte = _moving_average(self.swap_seconds_per_byte, seconds / num_bytes)

    def observe_prefill(self, num_tokens: int, seconds: float) -> None:
        """A step that computed `num_tokens` tokens, mostly prefill, took `seconds`."""
        if num_tokens > 0 and seconds > 0:
            self.recompute_seconds_per_token = _moving_average(self.recompute_seconds_per_token, seconds / num_tokens)

    def blocks_needed(self, seq: Sequence) -> int:
        """GPU blocks a swap-in takes from the available ones (kept or still-shared blocks need none)."""
        entry = self._entries[seq.seq_id]
        cached = self._still_cached(seq, entry)
        return sum(
            1
            for i, on_gpu in enumerate(entry.on_gpu)
            if not on_gpu and not (i < len(cached) and self.gpu_pool.ref_count(cached[i]) > 0)
        )

    def _still_cached(self, seq: Sequence, entry: _Swapped) -> list[int]:
        """GPU blocks that still hold this sequence's leading full blocks in the prefix cache."""
        if not self.gpu_pool.enable_prefix_caching or entry.on_gpu.count(False) == 0:
            return []
        full = min(seq.num_computed_tokens // self.block_size, len(entry.ids))
        blocks, _ = self.gpu_pool.match_prefix(seq.token_ids, full, seq.request.prefix_root)
        return blocks

    def blocks_to_resume(self, seq: Sequence, num_new: int) -> int:
        """GPU blocks to bring `seq` back and compute `num_new` more tokens (incl. copy-on-write)."""
        entry = self._entries[seq.seq_id]
        need = self.blocks_needed(seq)
        total = -(-(seq.num_computed_tokens + num_new) // self.block_size)
        need += max(0, total - len(entry.ids))
        if (
            seq.num_computed_tokens % self.block_size
            and entry.ids
            and entry.on_gpu[-1]
            and self.gpu_pool.ref_count(entry.ids[-1]) > 1
        ):
            need += 1  # its partial last block is shared: the first write copies it
        return need

    def holds_gpu_blocks(self, seq: Sequence) -> bool:
        return any(self._entries[seq.seq_id].on_gpu)

    # ---- moves ----
    def swap_out(self, seq: Sequence) -> list[tuple[int, int]]:
        """Move `seq`'s private blocks to the CPU; returns (gpu block, cpu block) pairs to copy.

        Its GPU table is emptied (seq.block_ids = []): the entry here is now the table.
        """
        keep = self._kept_prefix(seq)
        blocks = seq.block_ids
        movable, _ = self._movable(seq)
        if movable > len(self._free):
            raise NoSwapSpaceError(f"need {movable} CPU blocks, {len(self._free)} free")
        entry = _Swapped([], [])
        pairs: list[tuple[int, int]] = []
        for block in blocks[:keep]:
            if self.gpu_pool.ref_count(block) == 1:
                cpu = heapq.heappop(self._free)
                pairs.append((block, cpu))
                entry.on_gpu.append(False)
                entry.ids.append(cpu)
            else:
                entry.on_gpu.append(True)
                entry.ids.append(block)
                self.blocks_kept += 1
        # Drop the GPU references of the moved blocks (tail first, like BlockPool.free_all) and of
        # any block beyond the computed tokens. The copies are queued before any later write.
        for block in reversed(blocks[keep:]):
            self.gpu_pool.free(block)
        for block, _ in reversed(pairs):
            self.gpu_pool.free(block)
        seq.block_ids = []
        self._entries[seq.seq_id] = entry
        self.blocks_out += len(pairs)
        self.bytes_out += len(pairs) * self.bytes_per_block
        return pairs

    def swap_in(self, seq: Sequence) -> list[tuple[int, int]]:
        """Bring `seq` back: allocate GPU blocks; returns (cpu block, gpu block) pairs to copy."""
        entry = self._entries[seq.seq_id]
        cached = self._still_cached(seq, entry)
        table: list[int | None] = []
        for i, (on_gpu, block) in enumerate(zip(entry.on_gpu, entry.ids)):
            if on_gpu:
                table.append(block)
            elif i < len(cached):
                self.gpu_pool.incref(cached[i])  # before allocating: it must not be evicted for us
                table.append(cached[i])
                self._deferred.append(block)
                self.blocks_reused += 1
            else:
                table.append(None)
        fresh = iter(self.gpu_pool.allocate_many(table.count(None)))
        pairs: list[tuple[int, int]] = []
        for i, slot in enumerate(table):
            if slot is None:
                gpu = next(fresh)
                pairs.append((entry.ids[i], gpu))
                table[i] = gpu
                self._deferred.append(entry.ids[i])
        del self._entries[seq.seq_id]
        seq.block_ids = cast("list[int]", table)  # every None was filled from `fresh` above
        self.blocks_in += len(pairs)
        self.bytes_in += len(pairs) * self.bytes_per_block
        return pairs

    def discard(self, seq: Sequence) -> None:
        """Forget a swapped sequence (finished, aborted, or falling back to recompute)."""
        entry = self._entries.pop(seq.seq_id, None)
        if entry is None:
            return
        for on_gpu, block in zip(reversed(entry.on_gpu), reversed(entry.ids)):
            if on_gpu:
                self.gpu_pool.free(block)
            else:
                # Nothing of it is read any more, but a swap-out into it may still be queued
                # this step: hold it back like a swapped-in block.
                self._deferred.append(block)
                self.blocks_discarded += 1
        seq.block_ids = []

    # ---- integrity ----
    def gpu_references(self) -> dict[int, int]:
        """GPU block -> references that swapped sequences still hold on it."""
        refs: dict[int, int] = {}
        for entry in self._entries.values():
            for on_gpu, block in zip(entry.on_gpu, entry.ids):
                if on_gpu:
                    refs[block] = refs.get(block, 0) + 1
        return refs

    def check_integrity(self, swapped: list[Sequence]) -> None:
        ids = {s.seq_id for s in swapped}
        assert ids == set(self._entries), f"swapped sequences {sorted(ids)} != swap entries {sorted(self._entries)}"
        for seq in swapped:
            assert not seq.block_ids, f"swapped seq {seq.seq_id} still has a GPU block table"
            entry = self._entries[seq.seq_id]
            assert len(entry.ids) == len(entry.on_gpu) == self._kept_prefix(seq), (
                f"swapped seq {seq.seq_id}: {len(entry.ids)} blocks for {seq.num_computed_tokens} tokens"
            )
        used = [b for e in self._entries.values() for g, b in zip(e.on_gpu, e.ids) if not g]
        free = list(self._free)
        everything = used + free + self._deferred
        assert len(everything) == len(set(everything)), "a CPU block is in two places"
        assert len(everything) == self.num_blocks, (
            f"CPU block accounting broken: used {len(used)} + free {len(free)} + deferred "
            f"{len(self._deferred)} != {self.num_blocks}"
        )
        assert all(0 <= b < self.num_blocks for b in everything), "CPU block id out of range"


def _moving_average(old: float | None, new: float, weight: float = 0.2) -> float:
    """Exponential moving average; the first observation is taken as is."""
    return new if old is None else (1 - weight) * old + weight * new
