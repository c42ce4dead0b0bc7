"""DecodeGraphRunner: CUDA graphs of decode steps over the runner's static buffers.

One graph per batch bucket (and, for a backend that bakes the context length in, per context
bucket): compiled forward + logits + greedy argmax, reading the InputBuffers and the forward
context's buffers in place and writing two shared output buffers. Speculative decoding's verify
steps have graphs of their own, keyed (rows, ctx, q): the same body over rows * q tokens, for
every q = 2..1 + drafts, all captured at start-up. A verify step whose sequences have up to q
tokens each (adaptive draft lengths: not all the same) replays the q graph: its tokens come first,
then padding sequences of q tokens, then unclaimed padding rows up to rows * q (every attention
backend zeroes rows no sequence claims; their slot is -1). A verify graph has at least
MIN_COMPILED_ROWS rows, as a compiled step of several tokens has (one sequence would make Dynamo
specialise, a compile more).

A proposer's runner (a draft model, an EAGLE head) needs only the hidden states: its graphs hold
no logits (`logits=False`), and the proposer computes the logits it samples from, once.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Callable

import torch

from compiler.compilation.capture import MIN_COMPILED_ROWS, CudaGraphSet, SimulatedGraphSet, bucket_for, graph_ctx

if TYPE_CHECKING:
    from engine.worker.step_builder import StepInputs

logger = logging.getLogger(__name__)

# (rows, max_seq_len, q, logits) -> the step's final hidden states [rows * q, hidden] and, when
# asked, its logits [rows * q, vocab] (else None), from the static input buffers read in place.
DecodeBody = Callable[[int, int, int, bool], "tuple[torch.Tensor, torch.Tensor | None]"]


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
        logits: bool = True,
    ) -> None:
        self.body = body
        self.pad = pad
        self.sizes = sizes
        self.logits = logits  # False: a proposer's runner (hidden states only; `tokens` is never written)
        # (a verify graph's rows: at least MIN_COMPILED_ROWS)
        self.max_batch = max(sizes[-1], MIN_COMPILED_ROWS if max_query > 1 else 1)
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
        self.replayed: dict[tuple[int, ...], int] = {}

    def rows_for(self, bucket: int, q: int) -> int:
        """A bucket's graph rows: a verify graph's at least MIN_COMPILED_ROWS."""
        return max(bucket, MIN_COMPILED_ROWS) if q > 1 else bucket

    def key_for(self, num_seqs: int, max_seq_len: int, q: int = 1) -> tuple[int, ...] | None:
        """(bucket, ctx) of a decode step; (rows, ctx, q) of a verify step of at most q tokens a
        sequence (rows: the bucket, at least MIN_COMPILED_ROWS)."""
        bucket = bucket_for(num_seqs, self.sizes)
        if bucket is None or q > self.max_query:
            return None
        rows = self.rows_for(bucket, q)
        if rows * q > self.max_tokens:
            return None
        ctx = graph_ctx(max_seq_len, self.max_model_len, self.device_reads_lengths)
        return (rows, ctx) if q == 1 else (rows, ctx, q)

    def _graph_body(self, rows: int, max_seq_len: int, q: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
        hidden, logits = self.body(rows, max_seq_len, q, self.logits)
        out = self.hidden[: rows * q]
        out.copy_(hidden)
        tokens = self.tokens[: rows * q]
        if logits is not None:
            torch.argmax(logits, dim=-1, out=tokens)
            tokens.masked_fill_(~torch.isfinite(logits.amax(dim=-1)), -1)  # as the sampler marks such rows
        return out, tokens

    @torch.inference_mode()
    def capture_startup(self) -> float:
        """Capture every bucket at the first context bucket, largest first, and with drafts the
        verify steps of every q = 2..max_query (none mid-serving), but those whose rows * q exceed
        max_tokens; returns seconds."""
        ctx = graph_ctx(1, self.max_model_len, self.device_reads_lengths)
        seconds = 0.0
        for q in range(1, self.max_query + 1):
            fit = [b for b in self.sizes if self.rows_for(b, q) * q <= self.max_tokens]
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
                rows = sorted({self.rows_for(b, q) for b in fit})
                self.pad(rows[-1], q)
                seconds += self.graphs.capture_all((r, ctx) if q == 1 else (r, ctx, q) for r in rows)
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
