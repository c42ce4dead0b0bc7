"""A KV block's bytes out of and into the paged KV cache, for the KV tiers.

The cache is [layers, 2, num_blocks, block_size, kv_heads, head_dim]; one block of every layer's K
and V, gathered block-major (engine/worker/block_swapper.py block_major), is one tier record's
payload, in the cache's own element type (fp8 stays fp8: its scales are part of the model's
fingerprint). Reads gather on the device and copy to the host once (on a GPU this waits for the
steps that wrote the blocks); writes upload once and scatter. On a GPU both copies go through
pinned host memory, queued on the stream (`non_blocking`): the read then waits for its own copy
only, and the write's upload does not block the host (torch's pinned allocator keeps the staging
until the copy has run).
"""

from __future__ import annotations

import numpy as np
import torch

from engine.worker.block_swapper import block_major
from engine.worker.host_upload import upload


class KVBlockIO:
    def __init__(self, cache: torch.Tensor) -> None:
        self.device = cache.device
        flat = cache.view(torch.uint8)  # (one byte per element of the innermost dim: any dtype)
        self.blocks = block_major(flat)
        self.block_shape = tuple(self.blocks.shape[1:])
        self.bytes_per_block = self.blocks[0].numel()
        self.pinned = self.device.type == "cuda"

    def _index(self, block_ids: list[int]) -> torch.Tensor:
        return upload(block_ids, torch.int64, self.device)

    def _host(self, n: int) -> torch.Tensor:
        return torch.empty((n, self.bytes_per_block), dtype=torch.uint8, pin_memory=self.pinned)

    def read(self, block_ids: list[int]) -> list[bytes]:
        """Each block's bytes (copies: the blocks may be overwritten once this returns)."""
        if not block_ids:
            return []
        gathered = self.blocks.index_select(0, self._index(block_ids))
        if self.pinned:
            host = self._host(len(block_ids))
            host.copy_(gathered.view(len(block_ids), -1), non_blocking=True)
            torch.cuda.current_stream(self.device).synchronize()  # (this copy, not the whole device)
        else:
            host = gathered.view(len(block_ids), -1)
        return [row.tobytes() for row in host.numpy()]

    def write(self, block_ids: list[int], payloads) -> None:
        """Fill these blocks with these bytes (one payload each)."""
        if not block_ids:
            return
        if len(block_ids) != len(payloads) or any(len(p) != self.bytes_per_block for p in payloads):
            raise ValueError(
                f"KV tier load: {len(payloads)} payloads for {len(block_ids)} blocks of {self.bytes_per_block} bytes"
            )
        host = self._host(len(block_ids))
        rows = host.numpy()
        for i, payload in enumerate(payloads):  # (one copy each, straight from the record's bytes)
            rows[i] = np.frombuffer(payload, dtype=np.uint8)
        data = host.view(len(block_ids), *self.block_shape).to(self.device, non_blocking=True)
        self.blocks.index_copy_(0, self._index(block_ids), data)
