"""KVAllocator: a scheduler's KV block accounting over the BlockPool, as plain Python over ints.

The scheduler decides who runs; this object answers "how many blocks would that take" and
does the taking and giving back:
  * blocks needed for N new tokens, counting the copy-on-write of a shared partial last block
    (a fork's prompt tail, a block a swapped-in sequence kept shared);
  * grow a sequence's block table (copy-on-write first), release it, trim blocks beyond its
    tokens (rejected speculative drafts);
  * prefix caching: take cached full blocks at admission (and drop them again if the sequence
    cannot start), register full computed blocks under their chained digests;
  * the reserve (blocks only urgent requests may take) and the watermark (blocks admission
    leaves for running sequences to grow);
  * the references the scheduler's sequences hold, for the pool's integrity check.
"""

from __future__ import annotations

import itertools
from typing import TYPE_CHECKING, Iterable

from engine.core.kv.block_pool import BlockPool

if TYPE_CHECKING:
    from engine.core.request import Sequence


class KVAllocator:
    def __init__(
        self,
        pool: BlockPool,
        *,
        reserved_blocks_fraction: float = 0.0,
        reserved_priority: int = 0,
        watermark_fraction: float = 0.01,
    ) -> None:
        self.pool = pool
        self.block_size = pool.block_size
        self.reserved_priority = reserved_priority
        # Both are fractions of a pool whose size never changes: computed once.
        self.reserved_blocks = int(reserved_blocks_fraction * pool.num_usable)
        self.watermark_blocks = int(watermark_fraction * pool.num_usable)
        self.digests: dict[int, list[bytes]] = {}  # seq id -> digests of its cached full blocks

    # ---- how much room ----
    def blocks_needed(self, seq: Sequence, num_new: int) -> int:
        """Blocks `seq` must take to compute `num_new` more tokens (incl. copy-on-write)."""
        bs = self.block_size
        computed = seq.num_computed_tokens
        blocks = seq.block_ids
        need = max(0, -(-(computed + num_new) // bs) - len(blocks))
        # Copy-on-write: the first write into a shared partial block needs a private copy.
        if computed % bs and blocks and self.pool.ref_count(blocks[(computed - 1) // bs]) > 1:
            need += 1
        return need

    def available_for(self, priority: int) -> int:
        """Blocks a request of this priority may take: the reserve is only for urgent ones."""
        available = self.pool.num_available
        if priority > self.reserved_priority:
            available -= self.reserved_blocks
        return available

    def can_grow(self, seq: Sequence, num_new: int) -> bool:
        return self.blocks_needed(seq, num_new) <= self.available_for(seq.request.priority)

    def watermark(self, any_running: bool) -> int:
        # Room kept for running sequences to grow; with none running it would only lock out a
        # sequence that needs the whole cache.
        return self.watermark_blocks if any_running else 0

    def can_admit(self, seq: Sequence, num_new: int, any_running: bool) -> bool:
        return self.blocks_needed(seq, num_new) <= self.available_for(seq.request.priority) - self.watermark(
            any_running
        )

    def blocks_freed_by(self, victims: Iterable[Sequence]) -> int:
        """GPU blocks releasing all of `victims` would free: those no one else references."""
        held: dict[int, int] = {}
        for v in victims:
            for b in v.block_ids:
                held[b] = held.get(b, 0) + 1
        return sum(1 for b, n in held.items() if self.pool.ref_count(b) == n)

    def usable_blocks(self, priority: int) -> int:
        """The blocks a request of this priority may hold when alone in the cache (admission's KV
        rule: engine/core/admission_rules/engine_limits.py kv_capacity)."""
        # Pinned (warm-up) blocks are never freed; the reserve is out of reach of less urgent requests.
        usable = self.pool.num_usable - self.pool.num_pinned
        if priority > self.reserved_priority:
            usable -= self.reserved_blocks
        return usable

    # ---- taking and giving back ----
    def grow(self, seq: Sequence, num_new: int, blocks_to_copy: list[tuple[int, int]]) -> None:
        """Make room for `num_new` more tokens: copy a shared partial last block (the copy is
        appended to blocks_to_copy), then allocate the blocks the new tokens reach."""
        bs = self.block_size
        computed = seq.num_computed_tokens
        if computed % bs and seq.block_ids:
            idx = (computed - 1) // bs
            last = seq.block_ids[idx]
            if self.pool.ref_count(last) > 1:
                fresh = self.pool.allocate()
                blocks_to_copy.append((last, fresh))
                self.pool.free(last)
                seq.block_ids[idx] = fresh
                seq.table_version += 1  # (the runner's block-table row must be rewritten)
        total = -(-(computed + num_new) // bs)
        if total > len(seq.block_ids):
            seq.block_ids.extend(self.pool.allocate_many(total - len(seq.block_ids)))

    def release(self, seq: Sequence) -> None:
        """Give back every block of seq's table (its cached full blocks stay in the prefix cache)."""
        self.pool.free_all(seq.block_ids)
        seq.block_ids = []
        self.digests.pop(seq.seq_id, None)

    def trim(self, seq: Sequence) -> int:
        """Free the blocks beyond seq's tokens (KV that rejected drafts wrote and nothing will
        read); returns how many. The next step's tokens need only the blocks kept."""
        keep = -(-seq.num_tokens // self.block_size)
        extra = seq.block_ids[keep:]
        if not extra:
            return 0
        del seq.block_ids[keep:]
        self.pool.free_all(extra)
        seq.table_version += 1  # (a block appended later may land in a column the runner holds)
        return len(extra)

    def share(self, parent: Sequence, child: Sequence) -> None:
        """A fork: the child references all of the parent's blocks (copy-on-write later)."""
        for block in parent.block_ids:
            self.pool.incref(block)
        child.block_ids = list(parent.block_ids)
        self.digests[child.seq_id] = list(self.digests.get(parent.seq_id, []))

    def forget(self, seq: Sequence) -> None:
        """seq's table is gone (swapped out and discarded): drop its digests."""
        self.digests.pop(seq.seq_id, None)

    # ---- prefix cache ----
    def take_prefix_hits(self, seq: Sequence) -> int:
        """Reuse cached full blocks at the start of seq's tokens; always leaves one token to
        compute (for its logits). Returns how many prompt tokens were found in the cache."""
        bs = self.block_size
        max_blocks = (seq.num_tokens - 1) // bs
        blocks, digests = self.pool.match_prefix(seq.token_ids, max_blocks, seq.request.prefix_root)
        for block in blocks:
            self.pool.incref(block)
        seq.block_ids = list(blocks)
        seq.num_computed_tokens = len(blocks) * bs
        seq.num_cached_tokens = min(seq.num_computed_tokens, seq.num_prompt_tokens)
        self.digests[seq.seq_id] = list(digests)
        return seq.num_cached_tokens

    def drop_prefix_hits(self, seq: Sequence) -> None:
        """The sequence could not start after all: give the hits back."""
        self.release(seq)
        seq.num_computed_tokens = 0
        seq.num_cached_tokens = 0

    def cache_full_blocks(self, seq: Sequence) -> None:
        """Register seq's full, computed, known blocks in the prefix cache (placeholders are not hashed)."""
        if not self.pool.enable_prefix_caching:
            return
        bs = self.block_size
        full = min(seq.num_computed_tokens, len(seq.token_ids) - seq.num_pending) // bs
        digests = self.digests.get(seq.seq_id)
        if digests is None:
            digests = self.digests[seq.seq_id] = []
        elif len(digests) >= full:
            return  # (a decode fills a block once every block_size tokens: most calls end here)
        while len(digests) < full:
            i = len(digests)
            parent = digests[-1] if digests else seq.request.prefix_root
            digests.append(self.pool.cache_block(seq.block_ids[i], parent, seq.token_ids[i * bs : (i + 1) * bs]))

    # ---- books ----
    def references(self, seqs: Iterable[Sequence], swapped_refs: dict[int, int] | None = None) -> dict[int, int]:
        """Block -> references held by `seqs` (plus those swapped sequences keep on the GPU)."""
        refs: dict[int, int] = dict(swapped_refs or {})
        for seq in seqs:
            for block in seq.block_ids:
                refs[block] = refs.get(block, 0) + 1
        return refs

    def check_integrity(
        self,
        running: list[Sequence],
        waiting: list[Sequence],
        swapped: list[Sequence],
        swapped_refs: dict[int, int] | None = None,
    ) -> None:
        """The pool's invariants, every reference held by a live sequence, each running
        sequence's table covering its computed tokens, no digests kept for a finished one."""
        self.pool.check_integrity(self.references(itertools.chain(running, waiting), swapped_refs))
        live = {s.seq_id for s in itertools.chain(running, waiting, swapped)}
        for seq in running:
            assert len(seq.block_ids) * self.block_size >= seq.num_computed_tokens, (
                f"seq {seq.seq_id}: {len(seq.block_ids)} blocks for {seq.num_computed_tokens} computed tokens"
            )
        for seq_id in self.digests:
            assert seq_id in live, f"digests kept for seq {seq_id}, which is not queued"

    def fragmentation(self, running: list[Sequence]) -> float:
        """Allocated slots not holding a computed token / allocated slots."""
        slots = used = 0
        for seq in running:
            slots += len(seq.block_ids) * self.block_size
            used += seq.num_computed_tokens
        return (slots - used) / slots if slots else 0.0
