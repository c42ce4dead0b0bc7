"""DecodeGraphRunner: CUDA graphs of decode steps over the runner's static buffers.

One graph per batch bucket (and, for a backend that bakes the context length in, per context
bucket): compiled forward + logits + greedy argmax, reading the InputBuffers and the forward
context's buffers in place and writing two shared output buffers.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch

from compiler.capture import CudaGraphSet, SimulatedGraphSet, bucket_for, graph_ctx

if TYPE_CHECKING:
    from engine.runner import ModelRunner
    from engine.step_builder import StepInputs

logger = logging.getLogger(__name__)


class DecodeGraphRunner:
    """CUDA graphs of decode steps: compiled forward + logits + greedy argmax, per batch bucket.

    Each graph runs `bucket` rows of the runner's InputBuffers (block tables at full width
    [bucket, max_blocks_per_seq]) and writes its final hidden states and argmax tokens into two
    shared output buffers, so the number of graphs does not multiply output memory. The logits
    stay inside the graph (no [rows, vocab] copy per step); a step that samples otherwise than
    greedily computes them again from the hidden states. Keys are (rows, ctx) where ctx is the `max_seq_len` the graph was captured with
    (compiler.capture.graph_ctx): max_model_len for a backend that reads lengths on the
    device, else a power-of-two bucket captured on first use.
    """

    def __init__(self, runner: "ModelRunner", sizes: list[int], device_reads_lengths: bool,
                 simulate: bool = False) -> None:
        self.runner = runner
        self.sizes = sizes
        self.max_batch = sizes[-1]
        self.device_reads_lengths = device_reads_lengths
        max_rows = self.max_batch
        self.tokens = torch.zeros(max_rows, dtype=torch.int64, device=runner.device)
        self.hidden = torch.zeros(max_rows, runner.model.config.hidden_size, dtype=runner.kv_cache.model_dtype,
                                  device=runner.device)
        self.graphs = (SimulatedGraphSet if simulate else CudaGraphSet)(self._body, runner.device)
        self.num_replays = 0
        self.replayed: dict[tuple[int, int], int] = {}

    def rows_for(self, bucket: int) -> int:
        return bucket

    def key_for(self, num_seqs: int, max_seq_len: int) -> tuple[int, int] | None:
        bucket = bucket_for(num_seqs, self.sizes)
        if bucket is None:
            return None
        return (self.rows_for(bucket),
                graph_ctx(max_seq_len, self.runner.max_model_len, self.device_reads_lengths))

    def _body(self, rows: int, max_seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        r = self.runner
        buf = r.buffers
        meta = r.builder.compiled_meta(rows, rows, 1, max_seq_len)
        ctx = r.builder.features.context(rows)  # (static buffers too: the graph reads them in place)
        hidden = r.forward_fn(buf.input_ids[:rows], buf.positions[:rows], r.kv_cache.tensor, meta, ctx)
        out = self.hidden[:rows]
        out.copy_(hidden)
        logits = r.model.compute_logits(hidden)
        tokens = self.tokens[:rows]
        torch.argmax(logits, dim=-1, out=tokens)
        tokens.masked_fill_(~torch.isfinite(logits.amax(dim=-1)), -1)  # as the sampler marks such rows
        return out, tokens

    @torch.inference_mode()
    def capture_startup(self) -> float:
        """Capture every bucket at the first context bucket, largest first; returns seconds."""
        max_rows = self.rows_for(self.max_batch)
        self.runner.builder.fill_padding_step(max_rows)
        ctx = graph_ctx(1, self.runner.max_model_len, self.device_reads_lengths)
        seconds = self.graphs.capture_all((self.rows_for(b), ctx) for b in self.sizes)
        logger.debug("captured %d decode CUDA graphs (batch %s, max_seq_len %d) in %.1fs",
                    len(self.graphs), ",".join(map(str, self.sizes)), ctx, seconds)
        return seconds

    @torch.inference_mode()
    def ensure(self, num_seqs: int, max_seq_len: int) -> tuple[int, int] | None:
        """Capture now (over padding) the graph a decode of this shape would use; returns its key."""
        key = self.key_for(num_seqs, max_seq_len)
        if key is not None and key not in self.graphs:
            self.runner.builder.fill_padding_step(key[0])
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
