"""DecodeGraphRunner: CUDA graphs of decode steps over the runner's static buffers.

One graph per batch bucket (and, for a backend that bakes the context length in, per context
bucket): compiled forward + logits + greedy argmax, reading the InputBuffers and the forward
context's buffers in place and writing two shared output buffers.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Callable

import torch

from compiler.capture import CudaGraphSet, SimulatedGraphSet, bucket_for, graph_ctx

if TYPE_CHECKING:
    from engine.worker.step_builder import StepInputs

logger = logging.getLogger(__name__)

# (rows, max_seq_len) -> the step's final hidden states [rows, hidden] and logits [rows, vocab],
# computed from the static input buffers the graph reads in place.
DecodeBody = Callable[[int, int], "tuple[torch.Tensor, torch.Tensor]"]


class DecodeGraphRunner:
    """CUDA graphs of decode steps: compiled forward + logits + greedy argmax, per batch bucket.

    `body(rows, max_seq_len)` is the owner's forward over its static buffers (first `rows` rows);
    `pad(rows)` fills those rows with a padding step before a capture (writes nothing, reads
    nothing). Each graph writes its final hidden states and argmax tokens into two shared output
    buffers, so the number of graphs does not multiply output memory. The logits stay inside the
    graph (no [rows, vocab] copy per step); a step that samples otherwise than greedily computes
    them again from the hidden states. Keys are (rows, ctx) where ctx is the `max_seq_len` the
    graph was captured with (compiler.capture.graph_ctx): max_model_len for a backend that reads
    lengths on the device, else a power-of-two bucket captured on first use.
    """

    def __init__(self, body: DecodeBody, pad: Callable[[int], None], sizes: list[int], *, max_model_len: int,
                 device_reads_lengths: bool, hidden_size: int, dtype: torch.dtype, device: torch.device,
                 simulate: bool = False) -> None:
        self.body = body
        self.pad = pad
        self.sizes = sizes
        self.max_batch = sizes[-1]
        self.max_model_len = max_model_len
        self.device_reads_lengths = device_reads_lengths
        self.tokens = torch.zeros(self.max_batch, dtype=torch.int64, device=device)
        self.hidden = torch.zeros(self.max_batch, hidden_size, dtype=dtype, device=device)
        self.graphs = (SimulatedGraphSet if simulate else CudaGraphSet)(self._graph_body, device)
        self.num_replays = 0
        self.replayed: dict[tuple[int, int], int] = {}

    def key_for(self, num_seqs: int, max_seq_len: int) -> tuple[int, int] | None:
        bucket = bucket_for(num_seqs, self.sizes)
        if bucket is None:
            return None
        return bucket, graph_ctx(max_seq_len, self.max_model_len, self.device_reads_lengths)

    def _graph_body(self, rows: int, max_seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        hidden, logits = self.body(rows, max_seq_len)
        out = self.hidden[:rows]
        out.copy_(hidden)
        tokens = self.tokens[:rows]
        torch.argmax(logits, dim=-1, out=tokens)
        tokens.masked_fill_(~torch.isfinite(logits.amax(dim=-1)), -1)  # as the sampler marks such rows
        return out, tokens

    @torch.inference_mode()
    def capture_startup(self) -> float:
        """Capture every bucket at the first context bucket, largest first; returns seconds."""
        self.pad(self.max_batch)
        ctx = graph_ctx(1, self.max_model_len, self.device_reads_lengths)
        seconds = self.graphs.capture_all((b, ctx) for b in self.sizes)
        logger.debug("captured %d decode CUDA graphs (batch %s, max_seq_len %d) in %.1fs",
                     len(self.graphs), ",".join(map(str, self.sizes)), ctx, seconds)
        return seconds

    @torch.inference_mode()
    def ensure(self, num_seqs: int, max_seq_len: int) -> tuple[int, int] | None:
        """Capture now (over padding) the graph a decode of this shape would use; returns its key."""
        key = self.key_for(num_seqs, max_seq_len)
        if key is not None and key not in self.graphs:
            self.pad(key[0])
            self.graphs.capture(key)
        return key

    def can_replay(self, step: "StepInputs") -> bool:
        return step.graph_key is not None

    def replay(self, step: "StepInputs") -> tuple[torch.Tensor, torch.Tensor]:
        key = step.graph_key
        if key not in self.graphs:
            captured = self.graphs.capture(key)  # reference attention, a longer context bucket
            logger.info("captured decode CUDA graph rows=%d max_seq_len=%d in %.2fs", key[0], key[1],
                        captured.seconds)
        self.num_replays += 1
        self.replayed[key] = self.replayed.get(key, 0) + 1
        return self.graphs.replay(key)
