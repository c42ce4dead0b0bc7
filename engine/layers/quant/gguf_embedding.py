"""An embedding table read from a GGUF file's quantised blocks where they lie, not dequantised at load.

A lookup needs a few rows per step, so the table stays in the file: each lookup reads just its rows
with positioned reads (`os.preadv`) and dequantises them (engine/layers/quant/gguf_blocks.py), the
same values the dense table held. The rows come through the page cache, shared with every process
that reads the same file, and none of the table is mapped into this process: a mapping would count
the pages it touched in the process's resident memory for as long as it lives, and the kernel maps
64 KB around each faulted row, so a run of random prompts on a 1.2B model's Q8_0 table (279 MB)
grew RSS by ~0.2 GB (issue 40: peak RSS beside llama.cpp). On a Llama-3.2-1B-shaped Q4_K_M file the
dense float32 table was 1.05 GB, more than all its quantised layers. A tied LM head is then the
file's blocks in the CPU kernels' layout (the model's packed_head), not this table.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
from torch import nn

from engine.layers.quant.gguf_blocks import BLOCK_TYPES, dequantize


class BlockEmbedding(nn.Module):
    """ids [...] -> [..., embedding_dim] in `dtype`, from a GGUF tensor's rows of blocks."""

    def __init__(self, num_embeddings: int, embedding_dim: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.num_embeddings, self.embedding_dim, self.dtype = num_embeddings, embedding_dim, dtype
        # (plain attributes, not buffers: not the model's memory to move, cast, save or advise)
        self.file = None  # the GGUF file, opened unbuffered (closed with the module)
        self.offset = 0  # the table's first byte in the file
        self.row_bytes = 0
        self.type_id = -1

    def read_from(self, path: str | Path, offset: int, nbytes: int, type_id: int) -> None:
        """Read lookups from the file's tensor of `nbytes` at `offset`, of ggml type `type_id`."""
        _, block, block_bytes = BLOCK_TYPES[type_id]
        row = self.embedding_dim // block * block_bytes
        if self.embedding_dim % block or nbytes != self.num_embeddings * row:
            raise ValueError(
                f"gguf: embedding table of {nbytes} bytes is not {self.num_embeddings} rows of {self.embedding_dim}"
            )
        if os.path.getsize(path) < offset + nbytes:
            raise ValueError(f"gguf: {path} ends inside its embedding table")
        self.file = open(path, "rb", buffering=0)
        self.offset, self.row_bytes, self.type_id = offset, row, type_id

    def rows(self, ids: list[int]) -> torch.Tensor:
        """The table's raw rows of `ids`: uint8 [len(ids), row bytes]."""
        if self.file is None:
            raise RuntimeError("BlockEmbedding: no table to read yet (read_from)")
        if ids and not (0 <= min(ids) and max(ids) < self.num_embeddings):
            bad = next(i for i in ids if not 0 <= i < self.num_embeddings)
            raise IndexError(f"token id {bad} is outside the embedding table's {self.num_embeddings} rows")
        row, at, fd = self.row_bytes, self.offset, self.file.fileno()
        out = torch.empty(len(ids), row, dtype=torch.uint8)
        view = memoryview(out.numpy()).cast("B")
        for i, token in enumerate(ids):
            dest = view[i * row : (i + 1) * row]
            if os.preadv(fd, [dest], at + token * row) != row:  # (a regular file: short only at its end)
                raise ValueError(f"gguf: {self.file.name} ends inside embedding row {token}")
        return out

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        flat = ids.reshape(-1)
        raw = self.rows(flat.tolist())
        values = dequantize(raw, self.type_id, (flat.numel(), self.embedding_dim))
        return values.to(device=ids.device, dtype=self.dtype).reshape(*ids.shape, self.embedding_dim)

    def extra_repr(self) -> str:
        kind = BLOCK_TYPES[self.type_id][0] if self.type_id in BLOCK_TYPES else "unread"
        return f"{self.num_embeddings}, {self.embedding_dim}, {kind} blocks -> {self.dtype}"
