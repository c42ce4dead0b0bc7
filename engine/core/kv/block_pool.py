"""BlockPool: fixed-size KV blocks with reference counts, prefix caching and LRU eviction.

Plain Python over ints; no tensors. Block 0 is the *null block*: never handed out,
so padded rows of a batch can point their writes and reads at it harmlessly.

Each usable block is in exactly one of three states:
  free         ref 0, holds nothing reusable          (in `_free`, a min-heap: the lowest id is
               taken first, so the KV pages in use stay at the bottom of the reservation and
               the memory the cache touches follows the tokens held, not its whole size)
  in use       ref > 0                                 (owned by sequences)
  cached-idle  ref 0, holds a full hashed block        (in `_idle`, LRU order; evicted last)

Prefix caching keys a full block by a chained 128-bit digest of (parent digest, its
tokens). A lookup also compares the block's stored tokens and parent digest, so a
digest collision can never hand back the wrong KV.
"""

from __future__ import annotations

import hashlib
import heapq
from array import array
from collections import OrderedDict
from dataclasses import dataclass, field

NULL_BLOCK = 0


class NoFreeBlocksError(RuntimeError):
    pass


def chain_digest(parent: bytes | None, tokens: list[int] | tuple[int, ...]) -> bytes:
    h = hashlib.blake2b(digest_size=16)
    h.update(parent or b"root")
    h.update(array("q", tokens).tobytes())
    return h.digest()


@dataclass
class _CachedBlock:
    digest: bytes
    parent: bytes | None
    tokens: tuple[int, ...]


@dataclass
class PoolCounters:
    prefix_queries: int = 0  # prompt tokens looked up
    prefix_hits: int = 0  # of those, tokens found in the cache
    evictions: int = 0
    allocations: int = 0


@dataclass
class BlockPool:
    num_blocks: int  # including the null block
    block_size: int
    enable_prefix_caching: bool = True
    counters: PoolCounters = field(default_factory=PoolCounters)

    def __post_init__(self) -> None:
        if self.num_blocks < 2:
            raise ValueError("a block pool needs at least 2 blocks (one is the null block)")
        self._ref = [0] * self.num_blocks
        self.ref_counts = self._ref  # read-only view by block id (hot loops index it directly)
        self._free: list[int] = list(range(1, self.num_blocks))  # (sorted: already a heap)
        self._idle: OrderedDict[int, None] = OrderedDict()
        self._by_digest: dict[bytes, int] = {}
        self._meta: dict[int, _CachedBlock] = {}
        self._pinned: set[int] = set()
        # KV tiers (engine/runtime/kv_tiers.py) set this to a list: each hashed block that turns
        # cached-idle is logged (id, digest, parent, tokens) so its bytes can be kept below the pool
        # before anything overwrites it.
        self.idle_log: list[tuple[int, bytes, bytes | None, tuple[int, ...]]] | None = None

    # ---- capacity ----
    @property
    def num_usable(self) -> int:
        return self.num_blocks - 1

    @property
    def num_available(self) -> int:
        """Blocks that an allocation can take now (free, or cached-idle and evictable)."""
        return len(self._free) + len(self._idle)

    @property
    def num_in_use(self) -> int:
        return self.num_usable - self.num_available

    @property
    def num_cached_idle(self) -> int:
        return len(self._idle)

    def usage(self) -> float:
        return self.num_in_use / self.num_usable

    def ref_count(self, block_id: int) -> int:
        return self._ref[block_id]

    # ---- allocation ----
    def allocate(self) -> int:
        if self._free:
            block = heapq.heappop(self._free)
        elif self._idle:
            block, _ = self._idle.popitem(last=False)  # least recently used
            self._forget(block)
            self.counters.evictions += 1
        else:
            raise NoFreeBlocksError("no free KV blocks")
        self._ref[block] = 1
        self.counters.allocations += 1
        return block

    def allocate_many(self, count: int) -> list[int]:
        if count > self.num_available:
            raise NoFreeBlocksError(f"need {count} KV blocks, {self.num_available} available")
        return [self.allocate() for _ in range(count)]

    def incref(self, block_id: int) -> None:
        self._check_id(block_id)
        if self._ref[block_id] == 0:
            if block_id not in self._idle:
                raise AssertionError(f"incref of free block {block_id}")
            del self._idle[block_id]
        self._ref[block_id] += 1

    def free(self, block_id: int) -> None:
        self._check_id(block_id)
        if self._ref[block_id] <= 0:
            raise AssertionError(f"double free of block {block_id}")
        self._ref[block_id] -= 1
        if self._ref[block_id] == 0:
            meta = self._meta.get(block_id)
            if meta is not None:
                self._idle[block_id] = None  # most recently used end
                if self.idle_log is not None:
                    self.idle_log.append((block_id, meta.digest, meta.parent, meta.tokens))
            else:
                heapq.heappush(self._free, block_id)

    def free_all(self, block_ids: list[int]) -> None:
        # Free the tail first, so that a sequence's later blocks are evicted before its prefix.
        for block in reversed(block_ids):
            self.free(block)

    # ---- prefix cache ----
    def match_prefix(
        self, token_ids: list[int], max_blocks: int, root: bytes | None = None
    ) -> tuple[list[int], list[bytes]]:
        """Longest run of cached full blocks at the start of `token_ids` (at most max_blocks),
        in the namespace `root` (the first block's parent: None for the base model, an adapter's
        own root for its requests).

        Returns their ids (not yet referenced: call incref on each to take them) and digests.
        """
        if not self.enable_prefix_caching:
            return [], []
        bs = self.block_size
        blocks: list[int] = []
        digests: list[bytes] = []
        parent: bytes | None = root
        for i in range(max_blocks):
            tokens = tuple(token_ids[i * bs : (i + 1) * bs])
            if len(tokens) < bs:
                break
            digest = chain_digest(parent, tokens)
            block = self._by_digest.get(digest)
            if block is None:
                break
            meta = self._meta[block]
            if meta.tokens != tokens or meta.parent != parent:
                break  # a digest collision: treat as a miss
            blocks.append(block)
            digests.append(digest)
            parent = digest
        return blocks, digests

    def record_prefix_query(self, queried_tokens: int, hit_tokens: int) -> None:
        self.counters.prefix_queries += queried_tokens
        self.counters.prefix_hits += hit_tokens

    def cache_block(self, block_id: int, parent: bytes | None, tokens: list[int]) -> bytes:
        """Register a full, computed block under its chained digest; returns the digest."""
        digest = chain_digest(parent, tokens)
        if not self.enable_prefix_caching:
            return digest
        if block_id in self._meta or digest in self._by_digest:
            return digest  # already registered (this block, or an identical one)
        self._by_digest[digest] = block_id
        self._meta[block_id] = _CachedBlock(digest, parent, tuple(tokens))
        return digest

    def pin(self, block_id: int) -> None:
        """Keep a block referenced for good (prefix warm-up): it is never evicted."""
        self.incref(block_id)
        self._pinned.add(block_id)

    @property
    def num_pinned(self) -> int:
        return len(self._pinned)

    def reset_prefix_cache(self) -> int:
        """Drop every cached-idle block's hash (in-use blocks keep theirs); returns how many."""
        dropped = 0
        for block in list(self._idle):
            del self._idle[block]
            self._forget(block)
            heapq.heappush(self._free, block)
            dropped += 1
        return dropped

    def _forget(self, block_id: int) -> None:
        meta = self._meta.pop(block_id, None)
        if meta is not None and self._by_digest.get(meta.digest) == block_id:
            del self._by_digest[meta.digest]

    def _check_id(self, block_id: int) -> None:
        if not 0 < block_id < self.num_blocks:
            raise AssertionError(f"block id {block_id} out of range (null block is {NULL_BLOCK})")

    # ---- integrity ----
    def check_integrity(self, expected_refs: dict[int, int] | None = None) -> None:
        """free + in use + cached-idle == usable, states disjoint, ref counts consistent.

        expected_refs: block -> number of references its owners hold (from the scheduler);
        pinned blocks add one each.
        """
        free = set(self._free)
        idle = set(self._idle)
        assert len(free) == len(self._free), "duplicate block in the free list"
        assert not (free & idle), "a block is both free and cached-idle"
        in_use = {b for b in range(1, self.num_blocks) if self._ref[b] > 0}
        assert not (in_use & (free | idle)), "a referenced block is on a free list"
        assert len(free) + len(idle) + len(in_use) == self.num_usable, (
            f"block accounting broken: free {len(free)} + idle {len(idle)} + in use {len(in_use)} != {self.num_usable}"
        )
        assert self._ref[NULL_BLOCK] == 0 and NULL_BLOCK not in free | idle, "null block escaped"
        assert all(self._ref[b] >= 0 for b in range(self.num_blocks)), "negative ref count"
        for b in idle:
            assert b in self._meta, f"cached-idle block {b} has no hash"
        for b in free:
            assert b not in self._meta, f"free block {b} still has a hash"
        for digest, b in self._by_digest.items():
            assert self._meta[b].digest == digest, "digest index out of sync"
        if expected_refs is not None:
            for b in range(1, self.num_blocks):
                want = expected_refs.get(b, 0) + (1 if b in self._pinned else 0)
                assert self._ref[b] == want, f"block {b}: ref count {self._ref[b]}, owners hold {want}"

    def is_fully_free(self) -> bool:
        """No block referenced (cached-idle blocks count as free), pinned blocks aside."""
        return self.num_in_use == len(self._pinned)
