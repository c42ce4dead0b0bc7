"""TierStore: the tiers in order (host, disk, remote), read through and written behind.

Keys: blake2b(model fingerprint + a block's prefix-chain digest), so a block is found by the
chain of the tokens before it and the model that computed it, nothing else.

Writes (`save`) are queued to one writer thread, which encodes the record once and puts it in
every tier; if the queue is full the block is not kept (counted in `dropped`), never blocking the
step thread. Reads (`read_run`) walk a prefix's blocks in order and stop at the first block no
tier holds intact: a corrupt, truncated or mismatched record is logged, removed from its tier and
looked for in the next; a hit in a lower tier is copied up into the tiers above it. Reads run on
the caller's thread (the engine's loader thread).
"""

from __future__ import annotations

import hashlib
import logging
import queue
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass

from engine.core.kv.tiers import block_record
from engine.core.kv.tiers.base import Tier

logger = logging.getLogger(__name__)

SEEN_KEYS = 1 << 18  # keys this process knows are stored (saves of them are skipped): ~40 MB at most
QUEUED_BYTES = 256 << 20  # blocks waiting for the writer, at most (more are dropped, not waited for)


@dataclass(frozen=True)
class BlockRef:
    """A full block of a prompt, as its chain names it."""

    digest: bytes
    parent: bytes | None
    tokens: tuple[int, ...]


class TierStore:
    def __init__(
        self, tiers: list[Tier], fingerprint: bytes, payload_bytes: int, max_queued_bytes: int = QUEUED_BYTES
    ) -> None:
        if not tiers:
            raise ValueError("a tier store needs at least one tier")
        self.tiers = tiers
        self.fingerprint = fingerprint
        self.payload_bytes = payload_bytes
        self.dropped = 0  # saves not queued (the writer was behind)
        self._closed = False
        self._seen: OrderedDict[str, None] = OrderedDict()
        self._seen_lock = threading.Lock()
        # Queued, not yet written: served from here meanwhile (a prefix may return at once).
        self._pending: dict[str, bytes] = {}
        self.pending_hits = 0
        self._queue: queue.Queue = queue.Queue(max(4, max_queued_bytes // payload_bytes))
        self._writer = threading.Thread(target=self._write_loop, name="kiln-kv-tier-writer", daemon=True)
        self._writer.start()

    def key(self, digest: bytes) -> str:
        return hashlib.blake2b(self.fingerprint + digest, digest_size=16).hexdigest()

    @property
    def has_remote(self) -> bool:
        return any(not t.local for t in self.tiers)

    def held_locally(self, digest: bytes) -> bool:
        """A local tier (host, disk) holds this block (no round trip: asked at admission)."""
        key = self.key(digest)
        return key in self._pending or any(t.local and t.contains(key) for t in self.tiers)

    def _mark_seen(self, key: str) -> bool:
        """Remember key; False if it was known already."""
        with self._seen_lock:
            if key in self._seen:
                self._seen.move_to_end(key)
                return False
            self._seen[key] = None
            if len(self._seen) > SEEN_KEYS:
                self._seen.popitem(last=False)
            return True

    # ---- writing ----
    def save(self, block: BlockRef, payload: bytes) -> bool:
        """Queue a block's bytes for every tier; False if it was known or the queue was full."""
        if len(payload) != self.payload_bytes:
            raise ValueError(f"a KV block of {len(payload)} bytes; this store keeps {self.payload_bytes}")
        key = self.key(block.digest)
        if not self._mark_seen(key):
            return False
        self._pending[key] = payload
        try:
            self._queue.put_nowait((key, block, payload))
        except queue.Full:
            self._pending.pop(key, None)
            self.dropped += 1
            with self._seen_lock:
                self._seen.pop(key, None)
            return False
        return True

    def knows(self, digest: bytes) -> bool:
        """This process stored or loaded the block already (its save can be skipped)."""
        return self.key(digest) in self._seen

    def _write_loop(self) -> None:
        while True:
            item = self._queue.get()
            try:
                if item is None:
                    return
                key, block, payload = item
                record = block_record.encode(self.fingerprint, block.digest, block.parent, block.tokens, payload)
                for tier in self.tiers:
                    try:
                        tier.put(key, record)
                    except Exception as exc:  # a full disk, a lost server: the block just isn't kept there
                        tier.stats.errors += 1
                        logger.warning("KV %s tier: writing a block failed: %s", tier.name, exc)
                self._pending.pop(key, None)
            finally:
                self._queue.task_done()

    def flush(self) -> None:
        """Wait until every queued save is written (tests, shutdown)."""
        self._queue.join()

    # ---- reading ----
    def read_run(self, blocks: list[BlockRef]) -> list[bytes | memoryview]:
        """The payloads of the longest run of `blocks`, from the start, that some tier holds intact."""
        payloads: list[bytes | memoryview] = []
        for block in blocks:
            payload = self._read_one(block)
            if payload is None:
                break
            payloads.append(payload)
        return payloads

    def _read_one(self, block: BlockRef) -> bytes | memoryview | None:
        key = self.key(block.digest)
        pending = self._pending.get(key)
        if pending is not None:
            self.pending_hits += 1
            return pending
        missed: list[Tier] = []
        for tier in self.tiers:
            t0 = time.perf_counter()
            try:
                record = tier.get(key)
            except Exception as exc:
                tier.stats.errors += 1
                logger.warning("KV %s tier: reading a block failed: %s", tier.name, exc)
                continue
            if record is None:
                tier.stats.misses += 1
                missed.append(tier)
                continue
            try:
                payload = block_record.decode(
                    record, self.fingerprint, block.digest, block.parent, block.tokens, self.payload_bytes
                )
            except block_record.BadRecord as exc:
                tier.stats.errors += 1
                logger.warning("KV %s tier: block %s not served (%s); it is recomputed", tier.name, key, exc)
                try:
                    tier.discard(key)
                except Exception:
                    pass
                missed.append(tier)
                continue
            tier.stats.hits += 1
            tier.stats.bytes_in += len(record)
            tier.stats.load_seconds += time.perf_counter() - t0
            for upper in missed:  # (copied up: the next read is nearer)
                try:
                    upper.put(key, bytes(record))  # (a lower tier's record: bytes already, not copied)
                except Exception:
                    upper.stats.errors += 1
            self._mark_seen(key)
            return payload
        return None

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._queue.put(None)
        self._writer.join(timeout=30)
        for tier in self.tiers:
            tier.close()
