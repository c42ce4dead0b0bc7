"""DecodeGraphRunner: CUDA graphs of decode steps over the runner's static buffers.

One graph per batch bucket (and, for a backend that bakes the context length in, per context
bucket): compiled forward + logits + greedy argmax, reading the InputBuffers and the forward
context's buffers in place and writing two shared output buffers. Speculative decoding's verify
steps (every sequence the same q = 1 + drafts tokens) have graphs of their own, keyed
(rows, ctx, q): the same body over rows * q tokens.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Callable

import torch

from compiler.compilation.capture import CudaGraphSet, SimulatedGraphSet, bucket_for, graph_ctx

if TYPE_CHECKING:
    from engine.worker.step_builder import StepInputs

logger = logging.getLogger(__name__)

# (rows, max_seq_len, q) -> the step's final hidden states [rows * q, hidden] and logits
# [rows * q, vocab], computed from the static input buffers the graph reads in place.
DecodeBody = Callable[[int, int, int], "tuple[torch.Tensor, torch.Tensor]"]


class DecodeGraphRunner:
    """CUDA graphs of decode steps: compiled forward + logits + greedy argmax, per batch bucket.

    `body(rows, max_seq_len)` is the owner's forward over its static buffers (first `rows` rows);
    `pad(rows)` fills those rows with a padding step before a capture (writes nothing, reads
    nothing). Each graph writes its final hidden states and argmax tokens into two shared output
    buffers, so the number of graphs does not multiply output memory. The logits stay inside the
    graph (no [rows, vocab] copy per step); a step that samples otherwise than greedily computes
    them again from the hidden states. Keys are (rows, ctx) where ctx is the `max_seq_len` the
    graph was captured with (compiler.compilation.capture.graph_ctx): max_model_len for a backend that reads
    lengths on the device, else a power-of-two bucket captured on first use.
    """

    def __init__(
        self,
        body: DecodeBody,
        pad: Callable[[int, int], None],
        sizes: list[int],
        *,
        max_model_len: int,
        device_reads_lengths: bool,
        hidden_size: int,
        dtype: torch.dtype,
        device: torch.device,
        simulate: bool = False,
        max_query: int = 1,
        max_tokens: int | None = None,
    ) -> None:
        self.body = body
        self.pad = pad
        self.sizes = sizes
        self.max_batch = sizes[-1]
        self.max_model_len = max_model_len
        self.device_reads_lengths = device_reads_lengths
        self.max_query = max_query  # verify steps: 1 + the most drafts a sequence gets
        # the rows of the static buffers the body reads (its slices would clip past them): a step of
        # more tokens (a verify bucket of rows * q) has no graph and runs eagerly
        self.max_tokens = max_tokens if max_tokens is not None else self.max_batch * max_query
        self.tokens = torch.zeros(self.max_batch * max_query, dtype=torch.int64, device=device)
        self.hidden = torch.zeros(self.max_batch * max_query, hidden_size, dtype=dtype, device=device)
        self.graphs = (SimulatedGraphSet if simulate else CudaGraphSet)(self._graph_body, device)
        self.num_replays = 0
        self.replayed: dict[tuple[int, int], int] = {}

    def key_for(self, num_seqs: int, max_seq_len: int, q: int = 1) -> tuple[int, ...] | None:
        """(bucket, ctx) of a decode step; (bucket, ctx, q) of a verify step of q tokens per row."""
        bucket = bucket_for(num_seqs, self.sizes)
        if bucket is None or q > self.max_query or bucket * q > self.max_tokens:
            return None
        ctx = graph_ctx(max_seq_len, self.max_model_len, self.device_reads_lengths)
        return (bucket, ctx) if q == 1 else (bucket, ctx, q)

    def _graph_body(self, rows: int, max_seq_len: int, q: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
        hidden, logits = self.body(rows, max_seq_len, q)
        out = self.hidden[: rows * q]
        out.copy_(hidden)
        tokens = self.tokens[: rows * q]
        torch.argmax(logits, dim=-1, out=tokens)
        tokens.masked_fill_(~torch.isfinite(logits.amax(dim=-1)), -1)  # as the sampler marks such rows
        return out, tokens

    @torch.inference_mode()
    def capture_startup(self) -> float:
        """Capture every bucket at the first context bucket, largest first (and, with drafts, the
        verify step of the most drafts), but those whose rows * q exceed max_tokens; returns seconds."""
        ctx = graph_ctx(1, self.max_model_len, self.device_reads_lengths)
        seconds = 0.0
        for q in sorted({1, self.max_query}):
            fit = [b for b in self.sizes if b * q <= self.max_tokens]
            if len(fit) < len(self.sizes):
                logger.info(
                    "no %s CUDA graph for batch %s: %d tokens a row exceed the %d rows of the static "
                    "input buffers (those steps run eagerly)",
                    "decode" if q == 1 else "verify",
                    ",".join(str(b) for b in self.sizes if b not in fit),
                    q,
                    self.max_tokens,
                )
            if fit:
                self.pad(fit[-1], q)
                seconds += self.graphs.capture_all((b, ctx) if q == 1 else (b, ctx, q) for b in fit)
        logger.debug(
            "captured %d decode CUDA graphs (batch %s, max_seq_len %d) in %.1fs",
            len(self.graphs),
            ",".join(map(str, self.sizes)),
            ctx,
            seconds,
        )
        return seconds

    @torch.inference_mode()
    def ensure(self, num_seqs: int, max_seq_len: int) -> tuple[int, int] | None:
        """Capture now (over padding) the graph a decode of this shape would use; returns its key."""
        key = self.key_for(num_seqs, max_seq_len)
        if key is not None and key not in self.graphs:
            self.pad(key[0], 1)
            self.graphs.capture(key)
        return key

    def can_replay(self, step: "StepInputs") -> bool:
        return step.graph_key is not None

    def replay(self, step: "StepInputs") -> tuple[torch.Tensor, torch.Tensor]:
        key = step.graph_key
        if key not in self.graphs:
            captured = self.graphs.capture(key)  # reference attention, a longer context bucket
            logger.info(
                "captured %s CUDA graph rows=%d max_seq_len=%d in %.2fs",
                "decode" if len(key) == 2 else f"verify ({key[2]} tokens a row)",
                key[0],
                key[1],
                captured.seconds,
            )
        self.num_replays += 1
        self.replayed[key] = self.replayed.get(key, 0) + 1
        return self.graphs.replay(key)
