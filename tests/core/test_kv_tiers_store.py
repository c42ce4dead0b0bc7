"""The KV tiers' store without an engine: records that check themselves, the disk tier's atomic
files, index rebuild, LRU capacity and sharing, the host tier, the fingerprint, and that a corrupt,
truncated, swapped or foreign record is never served."""

from __future__ import annotations

import os
import threading

import pytest

from engine.core.kv.block_pool import chain_digest
from engine.core.kv.tiers import block_record
from engine.core.kv.tiers.disk import DiskTier
from engine.core.kv.tiers.fingerprint import model_fingerprint
from engine.core.kv.tiers.host import HostTier
from engine.core.kv.tiers.store import BlockRef, TierStore

FP = b"F" * 16
PAYLOAD = 64
BS = 4


def chain(n: int, start: int = 0, root: bytes | None = None) -> list[BlockRef]:
    out, parent = [], root
    for i in range(n):
        toks = tuple(range(start + i * BS, start + (i + 1) * BS))
        d = chain_digest(parent, toks)
        out.append(BlockRef(d, parent, toks))
        parent = d
    return out


def payload(i: int) -> bytes:
    return bytes((i + j) % 256 for j in range(PAYLOAD))


def sizes() -> tuple[int, int]:
    lo = block_record.record_size(None, BS, PAYLOAD)
    return lo, lo + 64


def disk(path, capacity=1 << 20) -> DiskTier:
    return DiskTier(path, FP.hex(), capacity, sizes())


def store_of(*tiers, fp=FP) -> TierStore:
    return TierStore(list(tiers), fp, PAYLOAD)


def test_record_round_trip_and_every_mismatch_refused():
    b = chain(2)[1]
    rec = block_record.encode(FP, b.digest, b.parent, b.tokens, payload(1))
    assert bytes(block_record.decode(rec, FP, b.digest, b.parent, b.tokens, PAYLOAD)) == payload(1)
    assert len(rec) == block_record.record_size(b.parent, BS, PAYLOAD)
    flipped = bytearray(rec)
    flipped[len(rec) // 2] ^= 1
    bad = [
        (bytes(flipped), FP, b.tokens),  # a flipped byte
        (rec[:-5], FP, b.tokens),  # truncated
        (rec, b"G" * 16, b.tokens),  # another model
        (rec, FP, (9,) * BS),  # other tokens (a digest collision)
    ]
    for data, fp, toks in bad:
        with pytest.raises(block_record.BadRecord):
            block_record.decode(data, fp, b.digest, b.parent, toks, PAYLOAD)


def test_disk_store_serves_a_new_process_and_skips_partial_files(tmp_path):
    blocks = chain(3)
    s = store_of(disk(tmp_path))
    for i, b in enumerate(blocks):
        assert s.save(b, payload(i))
    assert not s.save(blocks[0], payload(0))  # known: not written twice
    s.flush()
    s.close()
    # A partial file (a writer killed mid-file before the rename would leave a .tmp; a torn copy
    # by hand leaves a short .kvb): skipped and removed at start.
    victim = tmp_path / FP.hex() / (s.key(blocks[2].digest) + ".kvb")
    victim.write_bytes(victim.read_bytes()[:20])
    fresh = store_of(disk(tmp_path))
    assert len(fresh.tiers[0]) == 2 and not victim.exists()
    assert fresh.read_run(blocks) == [payload(0), payload(1)]  # stops at the missing block
    assert fresh.tiers[0].stats.hits == 2 and fresh.tiers[0].stats.misses == 1
    fresh.close()


def test_corrupt_or_swapped_records_are_recomputed_not_served(tmp_path):
    blocks = chain(3)
    s = store_of(disk(tmp_path))
    for i, b in enumerate(blocks):
        s.save(b, payload(i))
    s.flush()
    d = tmp_path / FP.hex()
    f0, f1, f2 = (d / (s.key(b.digest) + ".kvb") for b in blocks)
    # Block 0 intact; block 1's file holds block 2's record (swapped); block 2 has a flipped byte.
    f1.write_bytes(f2.read_bytes())
    data = bytearray(f2.read_bytes())
    data[-30] ^= 0xFF
    f2.write_bytes(bytes(data))
    fresh = store_of(disk(tmp_path))
    assert fresh.read_run(blocks) == [payload(0)]
    assert fresh.tiers[0].stats.errors == 1 and not f1.exists()  # (the bad record is removed)
    assert fresh.read_run(blocks[2:]) == [] and not f2.exists()
    assert f0.exists()
    s.close()
    fresh.close()


def test_model_change_never_reuses_old_kv(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text('{"hidden_size": 8}')
    facts = {"dtype": "float32", "kv": "auto", "block_size": BS}
    fp1 = model_fingerprint(model, facts)
    assert model_fingerprint(model, dict(facts)) == fp1  # stable
    assert model_fingerprint(model, facts | {"kv": "fp8", "scales": [[1.0, 2.0]]}) != fp1
    s = store_of(DiskTier(tmp_path / "kv", fp1.hex(), 1 << 20, sizes()), fp=fp1)
    s.save(chain(1)[0], payload(0))
    s.flush()
    s.close()
    (model / "config.json").write_text('{"hidden_size": 9}')
    fp2 = model_fingerprint(model, facts)
    assert fp2 != fp1
    other = store_of(DiskTier(tmp_path / "kv", fp2.hex(), 1 << 20, sizes()), fp=fp2)
    assert other.read_run(chain(1)) == []
    # Even a record placed under the new model's key by hand is refused: it names the old model.
    old = tmp_path / "kv" / fp1.hex() / (store_of(disk(tmp_path), fp=fp1).key(chain(1)[0].digest) + ".kvb")
    (tmp_path / "kv" / fp2.hex() / (other.key(chain(1)[0].digest) + ".kvb")).write_bytes(old.read_bytes())
    assert other.read_run(chain(1)) == []
    other.close()


def test_disk_capacity_evicts_least_recently_used(tmp_path):
    rec = block_record.record_size(None, BS, PAYLOAD) + 16
    t = DiskTier(tmp_path, FP.hex(), 3 * rec, sizes())
    s = store_of(t)
    blocks = chain(4)
    for i, b in enumerate(blocks[:3]):
        s.save(b, payload(i))
    s.flush()
    assert s.read_run(blocks[:1]) == [payload(0)]  # block 0 used again: block 1 is the oldest now
    s.save(blocks[3], payload(3))
    s.flush()
    assert t.stats.evictions == 1 and len(t) == 3
    assert not t.contains(s.key(blocks[1].digest)) and t.contains(s.key(blocks[0].digest))
    assert len(os.listdir(t.dir)) == 3
    s.close()


def test_two_writers_on_one_directory(tmp_path):
    a, b = store_of(disk(tmp_path)), store_of(disk(tmp_path))
    blocks = chain(40)
    threads = [
        threading.Thread(target=lambda s=s: [s.save(x, payload(i)) for i, x in enumerate(blocks)]) for s in (a, b)
    ]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    a.flush()
    b.flush()
    assert a.read_run(blocks) == [payload(i) for i in range(40)]
    assert not [n for n in os.listdir(tmp_path / FP.hex()) if n.endswith(".tmp")]
    c = store_of(disk(tmp_path))  # a third process sees what a wrote after b's scan too
    a.save(chain(1, start=999)[0], payload(7))
    a.flush()
    assert c.read_run(chain(1, start=999)) == [payload(7)]
    for s in (a, b, c):
        s.close()


def test_host_tier_above_disk_is_filled_by_reads(tmp_path):
    d = disk(tmp_path)
    s = store_of(d)
    blocks = chain(2)
    for i, b in enumerate(blocks):
        s.save(b, payload(i))
    s.flush()
    s.close()
    host = HostTier(1 << 20)
    s2 = store_of(host, disk(tmp_path))
    assert s2.read_run(blocks) == [payload(0), payload(1)]
    assert host.stats.misses == 2 and len(host) == 2
    assert s2.read_run(blocks) == [payload(0), payload(1)]
    assert host.stats.hits == 2 and s2.tiers[1].stats.hits == 2
    small = HostTier(100)
    small.put("a", b"x" * 60)
    small.put("b", b"y" * 60)
    assert not small.contains("a") and small.contains("b") and small.stats.evictions == 1
    s2.close()


WRITER = """
import sys
from pathlib import Path
sys.path.insert(0, sys.argv[2])
from engine.core.kv.block_pool import chain_digest
from engine.core.kv.tiers import block_record
from engine.core.kv.tiers.disk import DiskTier
from engine.core.kv.tiers.store import BlockRef, TierStore
FP, BS, PAYLOAD = b"F" * 16, 4, 64
lo = block_record.record_size(None, BS, PAYLOAD)
tier = DiskTier(Path(sys.argv[1]), FP.hex(), 1 << 20, (lo, lo + 64))
s = TierStore([tier], FP, PAYLOAD)
parent, blocks = None, []
for i in range(60):
    toks = tuple(range(i * BS, (i + 1) * BS))
    blocks.append(BlockRef(chain_digest(parent, toks), parent, toks))
    parent = blocks[-1].digest
for rnd in range(3):
    for i, b in enumerate(blocks):
        if rnd:
            tier.discard(s.key(b.digest))  # (and write the same file again)
        s._seen.clear()
        s.save(b, bytes((i + j) % 256 for j in range(PAYLOAD)))
    s.flush()
s.close()
"""


def test_two_processes_writing_one_directory_never_tear_a_read(tmp_path):
    """Replicas on one host: two writer processes rewrite the same 60 records three times while
    this one reads them; every read is a whole, verified record or a miss, never a torn one."""
    import subprocess
    import sys
    from pathlib import Path

    repo = str(Path(__file__).resolve().parents[2])
    procs = [subprocess.Popen([sys.executable, "-c", WRITER, str(tmp_path), repo]) for _ in range(2)]
    reader = store_of(disk(tmp_path))
    blocks = chain(60)
    reads = 0
    while any(p.poll() is None for p in procs):
        for i, b in enumerate(blocks):
            got = reader.read_run([b])
            assert got in ([], [payload(i)])
            reads += len(got)
    assert all(p.wait() == 0 for p in procs)
    assert reader.tiers[0].stats.errors == 0  # (no torn or partial record was ever seen)
    assert reader.read_run(blocks) == [payload(i) for i in range(60)]
    assert not [n for n in os.listdir(tmp_path / FP.hex()) if n.endswith(".tmp")]
    reader.close()
