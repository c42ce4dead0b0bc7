"""BlockPool: unit and property tests (no tensors)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from engine.core.kv.block_pool import BlockPool, NoFreeBlocksError


def test_null_block_is_never_handed_out():
    pool = BlockPool(5, 4)
    got = pool.allocate_many(4)
    assert sorted(got) == [1, 2, 3, 4]
    with pytest.raises(NoFreeBlocksError):
        pool.allocate()
    pool.check_integrity({b: 1 for b in got})


def test_double_free_is_caught():
    pool = BlockPool(4, 4)
    b = pool.allocate()
    pool.free(b)
    with pytest.raises(AssertionError):
        pool.free(b)


def test_prefix_cache_hit_and_lru_eviction():
    pool = BlockPool(4, 2)  # 3 usable
    tokens = [1, 2, 3, 4, 5, 6]
    blocks = pool.allocate_many(3)
    parent = None
    for i, b in enumerate(blocks):
        parent = pool.cache_block(b, parent, tokens[2 * i : 2 * i + 2])
    pool.free_all(blocks)  # all three become cached-idle
    assert pool.num_cached_idle == 3 and pool.num_in_use == 0
    hit, _ = pool.match_prefix(tokens, 3)
    assert hit == blocks
    # A different second block stops the match after the first.
    hit, _ = pool.match_prefix([1, 2, 9, 9, 5, 6], 3)
    assert hit == blocks[:1]
    # Allocation evicts in LRU order: free_all released the tail first, so the last block goes first.
    fresh = pool.allocate()
    assert fresh == blocks[2]
    assert pool.match_prefix(tokens, 3)[0] == blocks[:2]
    pool.free(fresh)
    pool.check_integrity({})


def test_digest_collision_cannot_return_wrong_kv():
    pool = BlockPool(4, 2)
    b = pool.allocate()
    digest = pool.cache_block(b, None, [1, 2])
    # Forge a collision: another token run pointing at the same digest.
    pool._by_digest[digest] = b
    pool._meta[b].tokens = (7, 7)
    assert pool.match_prefix([1, 2, 3, 4], 2)[0] == []
    pool._meta[b].tokens = (1, 2)
    pool.free(b)


def test_incref_of_cached_idle_block_revives_it():
    pool = BlockPool(3, 2)
    b = pool.allocate()
    pool.cache_block(b, None, [5, 6])
    pool.free(b)
    assert pool.num_cached_idle == 1
    pool.incref(b)
    assert pool.num_cached_idle == 0 and pool.ref_count(b) == 1
    pool.check_integrity({b: 1})
    pool.free(b)


class PoolMachine(RuleBasedStateMachine):
    """Random allocate / share / free / cache / lookup; accounting holds after every rule."""

    def __init__(self):
        super().__init__()
        self.pool = BlockPool(9, 2)
        self.owned: list[int] = []  # one entry per reference we hold
        self.next_token = 0

    @precondition(lambda self: self.pool.num_available > 0)
    @rule()
    def allocate(self):
        self.owned.append(self.pool.allocate())

    @precondition(lambda self: self.owned)
    @rule(i=st.integers(0, 100))
    def share(self, i):
        b = self.owned[i % len(self.owned)]
        self.pool.incref(b)
        self.owned.append(b)

    @precondition(lambda self: self.owned)
    @rule(i=st.integers(0, 100))
    def free(self, i):
        self.pool.free(self.owned.pop(i % len(self.owned)))

    @precondition(lambda self: self.owned)
    @rule(i=st.integers(0, 100), a=st.integers(0, 3), b=st.integers(0, 3))
    def cache(self, i, a, b):
        self.pool.cache_block(self.owned[i % len(self.owned)], None, [a, b])

    @rule(a=st.integers(0, 3), b=st.integers(0, 3))
    def lookup_and_take(self, a, b):
        hit, _ = self.pool.match_prefix([a, b, 0], 1)
        for block in hit:
            self.pool.incref(block)
            self.owned.append(block)

    @invariant()
    def accounting(self):
        refs: dict[int, int] = {}
        for b in self.owned:
            refs[b] = refs.get(b, 0) + 1
        self.pool.check_integrity(refs)
        assert self.pool.num_in_use == len(refs)

    def teardown(self):
        for b in self.owned:
            self.pool.free(b)
        self.pool.check_integrity({})
        assert self.pool.is_fully_free()


TestPoolMachine = PoolMachine.TestCase
TestPoolMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)


@given(st.lists(st.integers(0, 3), min_size=0, max_size=12))
@settings(max_examples=100, deadline=None)
def test_match_prefix_only_returns_verified_full_blocks(tokens):
    pool = BlockPool(16, 2)
    blocks = pool.allocate_many(len(tokens) // 2)
    parent = None
    for i, b in enumerate(blocks):
        parent = pool.cache_block(b, parent, tokens[2 * i : 2 * i + 2])
    hit, _ = pool.match_prefix(tokens, 8)
    assert len(hit) <= len(tokens) // 2
    for i, b in enumerate(hit):
        assert pool._meta[b].tokens == tuple(tokens[2 * i : 2 * i + 2])
    pool.free_all(blocks)
    pool.check_integrity({})
