"""The host KV tier as a GPU keeps it (records in pinned host tensors; here `pin=False`, the same
code path without a GPU to pin with): capacity and LRU as the plain host tier, records handed back
as views that still decode after eviction, and a store round trip through it."""

from __future__ import annotations

import pytest
import torch

from engine.core.kv.tiers import block_record
from engine.core.kv.tiers.host import HostTier
from engine.core.kv.tiers.store import BlockRef, TierStore
from engine.runtime.pinned_host_tier import PinnedHostTier, host_tier
from engine.worker.kv_block_io import KVBlockIO

FP = bytes(range(16))


def _record(i: int, payload_len: int = 64) -> tuple[BlockRef, bytes, bytes]:
    block = BlockRef(digest=bytes([i]) * 16, parent=None, tokens=tuple(range(i, i + 4)))
    payload = bytes((i * 7 + j) % 256 for j in range(payload_len))
    return block, payload, block_record.encode(FP, block.digest, block.parent, block.tokens, payload)


def test_records_are_views_that_decode_and_outlive_eviction():
    block, payload, record = _record(1)
    tier = PinnedHostTier(2 * len(record), pin=False)
    tier.put("a", record)
    held = tier.get("a")
    assert isinstance(held, memoryview) and bytes(held) == record
    for key, i in (("b", 2), ("c", 3)):  # two more records: "a" is the least recently used
        tier.put(key, _record(i)[2])
    assert not tier.contains("a") and tier.stats.evictions == 1 and len(tier) == 2
    assert tier.num_bytes == 2 * len(record)
    # The view taken before the eviction still holds the record (its tensor lives while it does).
    assert bytes(block_record.decode(held, FP, block.digest, None, block.tokens, len(payload))) == payload
    assert not tier.is_pinned("b")  # (pin=False)


def test_a_store_round_trip_through_the_tier():
    tier = PinnedHostTier(1 << 20, pin=False)
    store = TierStore([tier], FP, 64)
    blocks = [_record(i) for i in range(3)]
    for block, payload, _ in blocks:
        assert store.save(block, payload)
    store.flush()
    out = store.read_run([b for b, _, _ in blocks])
    assert [bytes(p) for p in out] == [p for _, p, _ in blocks] and tier.stats.hits == 3
    store.close()


def test_host_tier_by_device():
    assert type(host_tier(1 << 20, torch.device("cpu"))) is HostTier
    assert type(host_tier(1 << 20, torch.device("cuda"))) is PinnedHostTier  # (made, not used: no pinning yet)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_block_io_round_trip_on_cpu(dtype):
    cache = torch.randn(2, 2, 6, 4, 2, 8).to(dtype)
    io = KVBlockIO(cache)
    assert not io.pinned
    payloads = io.read([1, 4])
    io.write([2, 5], payloads)
    assert torch.equal(cache[:, :, 2], cache[:, :, 1]) and torch.equal(cache[:, :, 5], cache[:, :, 4])
