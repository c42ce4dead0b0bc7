"""The host tier: records in this process's memory, least recently used dropped past a capacity.

How a record is kept is `_keep`'s choice: bytes here; on a GPU, pinned host memory
(engine/runtime/pinned_host_tier.py), which the loads copy from without a pageable bounce."""

from __future__ import annotations

import threading
from collections import OrderedDict

from engine.core.kv.tiers.base import TierStats


class HostTier:
    name = "host"
    local = True

    def __init__(self, capacity_bytes: int) -> None:
        if capacity_bytes <= 0:
            raise ValueError("the host KV tier needs a positive capacity")
        self.capacity_bytes = capacity_bytes
        self.stats = TierStats()
        self.num_bytes = 0
        self._records: OrderedDict[str, bytes | memoryview] = OrderedDict()
        self._lock = threading.Lock()  # (the writer and loader threads and the step thread share it)

    def __len__(self) -> int:
        return len(self._records)

    def contains(self, key: str) -> bool:
        return key in self._records

    def _keep(self, record: bytes | memoryview) -> bytes | memoryview:
        """The record as this tier holds it (what `get` hands back)."""
        return bytes(record)

    def get(self, key: str) -> bytes | memoryview | None:
        with self._lock:
            record = self._records.get(key)
            if record is not None:
                self._records.move_to_end(key)
            return record

    def put(self, key: str, record: bytes | memoryview) -> None:
        if len(record) > self.capacity_bytes:
            return
        with self._lock:
            if key in self._records:
                self._records.move_to_end(key)
                return
        kept = self._keep(record)  # (outside the lock: a copy the loads need not wait for)
        with self._lock:
            if key in self._records:
                return
            self._records[key] = kept
            self.num_bytes += len(record)
            self.stats.bytes_out += len(record)
            while self.num_bytes > self.capacity_bytes:
                _, old = self._records.popitem(last=False)
                self.num_bytes -= len(old)
                self.stats.evictions += 1

    def discard(self, key: str) -> None:
        with self._lock:
            record = self._records.pop(key, None)
            if record is not None:
                self.num_bytes -= len(record)

    def close(self) -> None:
        with self._lock:
            self._records.clear()
            self.num_bytes = 0
