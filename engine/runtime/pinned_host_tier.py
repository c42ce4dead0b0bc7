"""The host KV tier on a GPU: each record in pinned (page-locked) host memory.

A load copies a record's payload to the device; from pageable memory the driver first bounces it
through a pinned buffer of its own and the copy blocks the host, from pinned memory it is one DMA
queued on the stream. So on a GPU the host tier keeps its records pinned (one copy at `put`, on
the writer thread) and hands back views of them; the loads (engine/worker/kv_block_io.py) stage
through pinned memory as well. Records are allocated by torch's pinned-memory caching allocator,
which reuses freed blocks, and pinned pages count against the host's locked-memory budget: the
tier's capacity setting (kv_offloading_size) is what bounds them.
"""

from __future__ import annotations

import numpy as np
import torch

from engine.core.kv.tiers.host import HostTier


class PinnedHostTier(HostTier):
    """HostTier whose records live in pinned host tensors (`pin=False`: plain host tensors, the
    same code path where no GPU can pin memory)."""

    def __init__(self, capacity_bytes: int, pin: bool = True) -> None:
        super().__init__(capacity_bytes)
        self.pin = pin

    def _keep(self, record: bytes | memoryview) -> memoryview:
        held = torch.empty(len(record), dtype=torch.uint8, pin_memory=self.pin)
        rows = held.numpy()  # (shares the tensor's memory and keeps it alive while a view is out)
        rows[:] = np.frombuffer(record, dtype=np.uint8)
        return rows.data  # (a memoryview of the tensor's bytes)

    def is_pinned(self, key: str) -> bool:
        """Whether this record's memory is page-locked (a test's check)."""
        with self._lock:
            record = self._records.get(key)
        return record is not None and torch.frombuffer(record, dtype=torch.uint8).is_pinned()


def host_tier(capacity_bytes: int, device: torch.device) -> HostTier:
    """The host tier for a cache on `device`: pinned records on a GPU, bytes on the CPU (where a
    load is a memcpy either way)."""
    if device.type == "cuda":
        return PinnedHostTier(capacity_bytes)
    return HostTier(capacity_bytes)
