"""A KV block's bytes out of and into the paged KV cache, for the KV tiers.

The cache is [layers, 2, num_blocks, block_size, kv_heads, head_dim]; one block of every layer's K
and V, gathered block-major (engine/worker/block_swapper.py block_major), is one tier record's
payload, in the cache's own element type (fp8 stays fp8: its scales are part of the model's
fingerprint). Reads gather on the device and copy to the host once (on a GPU this waits for the
steps that wrote the blocks); writes upload once and scatter.
"""

from __future__ import annotations

import numpy as np
import torch

from engine.worker.block_swapper import block_major


class KVBlockIO:
    def __init__(self, cache: torch.Tensor) -> None:
        self.device = cache.device
        flat = cache.view(torch.uint8)  # (one byte per element of the innermost dim: any dtype)
        self.blocks = block_major(flat)
        self.block_shape = tuple(self.blocks.shape[1:])
        self.bytes_per_block = self.blocks[0].numel()

    def _index(self, block_ids: list[int]) -> torch.Tensor:
        return torch.tensor(block_ids, dtype=torch.int64, device=self.device)

    def read(self, block_ids: list[int]) -> list[bytes]:
        """Each block's bytes (copies: the blocks may be overwritten once this returns)."""
        if not block_ids:
            return []
        gathered = self.blocks.index_select(0, self._index(block_ids)).cpu()
        flat = gathered.view(len(block_ids), -1).numpy()
        return [row.tobytes() for row in flat]

    def write(self, block_ids: list[int], payloads) -> None:
        """Fill these blocks with these bytes (one payload each)."""
        if not block_ids:
            return
        if len(block_ids) != len(payloads) or any(len(p) != self.bytes_per_block for p in payloads):
            raise ValueError(
                f"KV tier load: {len(payloads)} payloads for {len(block_ids)} blocks of {self.bytes_per_block} bytes"
            )
        host = torch.empty((len(block_ids), self.bytes_per_block), dtype=torch.uint8)
        rows = host.numpy()
        for i, payload in enumerate(payloads):  # (one copy each, straight from the record's bytes)
            rows[i] = np.frombuffer(payload, dtype=np.uint8)
        data = host.view(len(block_ids), *self.block_shape).to(self.device)
        self.blocks.index_copy_(0, self._index(block_ids), data)
