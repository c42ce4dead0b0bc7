"""An embedding table read from a GGUF file's quantised blocks where they lie, not dequantised at load.

A lookup needs a few rows per step, so the table stays in the file: a private (copy-on-write) mapping
of its bytes, whose pages the kernel shares with the page cache and with every process that maps
the same file, and of which only the rows looked up become resident. Each lookup dequantises just
its rows (engine/layers/quant/gguf_blocks.py), the same values the dense table held. On a
Llama-3.2-1B-shaped Q4_K_M file the dense float32 table was 1.05 GB, more than all its quantised
layers (issue 40: peak RSS beside llama.cpp, which maps the file too). A tied LM head is then the
file's blocks in the CPU kernels' layout (the model's packed_head), not this table.
"""

from __future__ import annotations

import mmap
from pathlib import Path

import torch
from torch import nn

from engine.layers.quant.gguf_blocks import BLOCK_TYPES, dequantize


class BlockEmbedding(nn.Module):
    """ids [...] -> [..., embedding_dim] in `dtype`, from a GGUF tensor's rows of blocks."""

    def __init__(self, num_embeddings: int, embedding_dim: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.num_embeddings, self.embedding_dim, self.dtype = num_embeddings, embedding_dim, dtype
        # (a plain attribute, not a buffer: not the model's memory to move, cast, save or advise)
        self.blocks: torch.Tensor | None = None  # uint8 [num_embeddings, bytes per row]
        self.type_id = -1

    def map_file(self, path: str | Path, offset: int, nbytes: int, type_id: int) -> None:
        """Map the tensor's bytes (`nbytes` from `offset`, ggml type `type_id`) from the file."""
        _, block, block_bytes = BLOCK_TYPES[type_id]
        row = self.embedding_dim // block * block_bytes
        if self.embedding_dim % block or nbytes != self.num_embeddings * row:
            raise ValueError(
                f"gguf: embedding table of {nbytes} bytes is not {self.num_embeddings} rows of {self.embedding_dim}"
            )
        start = offset // mmap.ALLOCATIONGRANULARITY * mmap.ALLOCATIONGRANULARITY  # (only the table's pages)
        with open(path, "rb") as f:
            # (writable for torch, never written: copy-on-write, so the pages stay the page cache's)
            mapping = mmap.mmap(f.fileno(), offset + nbytes - start, offset=start, access=mmap.ACCESS_COPY)
        # (the tensor keeps the mapping alive)
        self.blocks = torch.frombuffer(mapping, dtype=torch.uint8, count=nbytes, offset=offset - start).view(
            self.num_embeddings, row
        )
        self.type_id = type_id

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.blocks is None:
            raise RuntimeError("BlockEmbedding: no table mapped yet (map_file)")
        flat = ids.reshape(-1)
        rows = self.blocks.index_select(0, flat.to(self.blocks.device))
        values = dequantize(rows, self.type_id, (flat.numel(), self.embedding_dim))
        return values.to(device=ids.device, dtype=self.dtype).reshape(*ids.shape, self.embedding_dim)

    def extra_repr(self) -> str:
        kind = BLOCK_TYPES[self.type_id][0] if self.type_id in BLOCK_TYPES else "unmapped"
        return f"{self.num_embeddings}, {self.embedding_dim}, {kind} blocks -> {self.dtype}"
