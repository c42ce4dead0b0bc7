"""StepBuilder: a SchedulerOutput -> one step's inputs, written into the static InputBuffers.

Two paths:
  - decode (every sequence computes one token and samples it once, the CUDA-graph shape): the
    per-sequence values are collected once in a few list comprehensions and written with
    vectorised numpy fills; block-table rows are touched only where they changed and sampler
    rows are reused from the previous step. No per-sequence Python branching.
  - general (prefill chunks, forks, drafts, tasks that read hidden states): one pass per sequence.
Then padding rows (slot -1, length 0) for the compiled forward or the graph's bucket, the
upload, the feed of the previous step's device tokens to PLACEHOLDER rows (overlap scheduling),
and the attention metadata and forward context.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np
import torch

from compiler.compilation.capture import MIN_COMPILED_ROWS, mark_static_dims
from engine.core.sched.scheduler_output import PLACEHOLDER, ScheduledSeq, SchedulerOutput
from engine.layers.attention.base import AttentionMetadata
from engine.layers.forward_context import ForwardContext
from engine.worker.host_upload import upload
from engine.worker.input_buffers import InputBuffers
from engine.worker.sample.sampler import SampleRow
from engine.worker.sample.sampler_output import LastSampled
from engine.worker.seq_states import SeqStates
from engine.worker.step_features import StepFeatures


@dataclass
class StepInputs:
    num_tokens: int
    num_seqs: int
    meta: AttentionMetadata | None  # None: a decode graph replays over the static buffers
    ctx: ForwardContext | None
    sample_indices: list[int]  # rows of the hidden states to sample from (repeated for forks)
    rows: list[SampleRow]
    # (rows, ctx) of the decode graph to replay; (rows, ctx, q): a verify graph (up to q tokens a sequence)
    graph_key: tuple[int, ...] | None = None
    # Tasks that read this step's hidden states: (task, seq id, its plan) (engine/core/request_kinds.py).
    reads: list[tuple[Any, int, Any]] = field(default_factory=list)


def _sample_row(s: ScheduledSeq, history: list[int], k: int = 0, extra: list[int] | None = None) -> SampleRow:
    index = s.sample_index + k
    return SampleRow(
        s.params,
        history,
        s.num_prompt_tokens,
        index,
        s.constrained and extra is None,
        extra=extra or [],
        key=s.seq_id,
    )


class StepBuilder:
    def __init__(self, buffers: InputBuffers, features: StepFeatures, block_size: int) -> None:
        self.buffers = buffers
        self.features = features
        self.block_size = block_size
        # The worker's copy of each sequence (block table, tokens), kept from the messages' deltas.
        # A draft model's or head's builder reads its target's (`share_states`) and applies none:
        # it builds from records the target's builder applied already, some after the core
        # refreshed a history (a deferred sampling), which applying them again would undo.
        self.states = SeqStates()
        self.applies_deltas = True
        self.compiled = False  # the forward is torch.compile'd: pad steps, full-width block tables
        self.graph_key: Callable[..., tuple[int, ...] | None] | None = None  # set with decode graphs
        # The last launched step's sampled tokens (device), for the next step's placeholders.
        self.last_sampled = LastSampled(torch.zeros(0, dtype=torch.int64))
        # A decoding sequence's sampler row does not change from step to step: kept by seq id.
        self._rows: dict[int, SampleRow] = {}
        self._views: dict[tuple[int, int, int], tuple[torch.Tensor, ...]] = {}  # eager metadata's buffer views
        # Whose last step's verify outcome moves this builder's positions: its own (the target's),
        # or the target's for a draft model's or head's builder (engine/spec_decode/verify.py).
        self.shifts_from: StepBuilder = self
        self._arange = np.arange(buffers.max_seqs + 1, dtype=np.int32)
        self._range = list(range(buffers.max_seqs + 1))  # (sliced: a fresh list each time)

    def build(self, sched: SchedulerOutput) -> StepInputs:
        self.buffers.wait_staging()
        seqs = sched.seqs
        if sched.dropped_seqs:
            if self.applies_deltas:
                self.states.drop(sched.dropped_seqs)
            for seq_id in sched.dropped_seqs:
                self._rows.pop(seq_id, None)
        # No prefill token and one decode token per sequence: each computes one token past its
        # prompt and samples it once (a request forks where its prompt ends, a prefill step), and
        # no task reads it (tasks read prompt positions only, engine/core/request_kinds.py).
        if sched.num_prefill_tokens == 0 and sched.num_decode_tokens == len(seqs):
            step = self._build_decode(seqs)
        else:
            step = self._build_general(seqs)
        verify = self.shifts_from.last_sampled.verify
        if verify is not None and any([s.after_verify for s in seqs]):
            self._shift_positions(seqs, verify)
        return step

    def _build_general(self, seqs: list[ScheduledSeq]) -> StepInputs:
        buf = self.buffers
        bs = self.block_size
        t = max_q = max_len = 0
        max_cols = 1
        sample_indices: list[int] = []
        rows: list[SampleRow] = []
        reads: list[tuple[Any, int, Any]] = []
        feed_rows: list[int] = []  # input rows whose token is the previous step's sampled one...
        feed_ids: list[int] = []  # ...for these sequences
        buf.np_query_start_loc[0] = 0
        num_decodes = 0  # leading one-token sequences (the scheduler puts decodes first)
        # Token ids, and each sequence's first position and token count, gathered here; positions
        # and slots are then computed for the whole step in a few numpy calls (a prefill step of
        # many sequences would otherwise pay several small numpy calls per sequence).
        all_ids: list[int] = []
        starts: list[int] = []
        counts: list[int] = []
        states = self.states
        table_of, history_of = (states.table, states.history) if self.applies_deltas else states.held()
        for i, s in enumerate(seqs):
            n = s.num_tokens
            if n == 1 and num_decodes == i:
                num_decodes += 1
            start = s.start_pos
            end = start + n
            all_ids += s.token_ids
            starts.append(start)
            counts.append(n)
            if s.token_ids[0] == PLACEHOLDER:  # (a verify chunk's last token may be one too)
                feed_rows.append(t)
                feed_ids.append(s.seq_id)
            self.features.write(t, n, s)
            max_cols = max(max_cols, buf.write_table_row(i, table_of(s)))
            history = history_of(s)
            buf.np_seq_lens[i] = end
            if s.task.reads_hidden:
                plan = s.task.plan(s, t, history)
                if plan is not None:
                    reads.append((s.task, s.seq_id, plan))
            t += n
            buf.np_query_start_loc[i + 1] = t
            max_q = max(max_q, n)
            max_len = max(max_len, end)
            num_rows = s.task.sample_rows(s)
            if num_rows and s.draft_token_ids:
                # Speculative: every position is sampled, each row with its own history (the
                # sequence, then the drafts before that position).
                for j in range(n):
                    sample_indices.append(t - n + j)
                    rows.append(_sample_row(s, history, extra=s.draft_token_ids[:j]))
            else:
                for k in range(num_rows):
                    sample_indices.append(t - 1)
                    rows.append(_sample_row(s, history, k))
        if seqs:
            buf.np_input_ids[:t] = all_ids
            # token j of sequence i sits at position starts[i] + (j - query_start[i])
            pos = buf.np_positions[:t]
            np.add(
                np.arange(t, dtype=np.int64),
                np.repeat(np.asarray(starts, dtype=np.int64) - buf.np_query_start_loc[: len(seqs)], counts),
                out=pos,
            )
            row_of = np.repeat(self._arange[: len(seqs)], counts)
            np.add(buf.np_block_tables[row_of, pos // bs].astype(np.int64) * bs, pos % bs, out=buf.np_slot_mapping[:t])
        key = None
        # Every row sampled once, in order (verify sequences of up to max_q tokens, one-token
        # decodes): a verify graph's output rows are then the sampler's rows.
        if self.graph_key is not None and seqs and max_q > 1 and not reads and sample_indices == list(range(t)):
            key = self.graph_key(len(seqs), max_len, max_q)
        step = self._finish(
            t, len(seqs), max_q, max_len, max_cols, sample_indices, rows, key, num_decodes, feed_rows, feed_ids
        )
        step.reads = reads
        return step

    def _build_decode(self, seqs: list[ScheduledSeq]) -> StepInputs:
        """One token per sequence, each sampled once: the CUDA-graph shape."""
        buf = self.buffers
        bs = self.block_size
        n = len(seqs)
        # Plain lists from one pass each, then one numpy fill per buffer (small numpy calls cost
        # microseconds each: fewer of them beats vectorising the arithmetic).
        states = self.states
        held, histories = states.tables, states.histories
        if not self.applies_deltas:
            tables = [held[s.seq_id] for s in seqs]
        else:
            tables = []
            for s in seqs:  # the deltas: in the steady state no new block, the tokens since the last step
                t = held.get(s.seq_id)
                if t is None or s.new_block_ids or s.blocks_from != len(t):
                    t = states.table(s)
                tables.append(t)
                h = histories.get(s.seq_id)
                if h is not None and s.history_from <= len(h):
                    h[s.history_from :] = s.new_history
                else:
                    states.history(s)
        keys = [(t, len(t)) for t in tables]
        buf.write_table_rows(keys)
        tokens = [s.token_ids[0] for s in seqs]
        positions = [s.start_pos for s in seqs]
        buf.np_input_ids[:n] = tokens
        buf.np_positions[:n] = positions
        buf.np_slot_mapping[:n] = [t[(p := s.start_pos) // bs] * bs + p % bs for s, t in zip(seqs, tables)]
        max_len = max(positions) + 1
        buf.np_seq_lens[:n] = [p + 1 for p in positions]
        buf.np_query_start_loc[: n + 1] = self._arange[: n + 1]
        self.features.write_decode(seqs)
        feed_rows: list[int] = []
        feed_ids: list[int] = []
        if PLACEHOLDER in tokens:
            if tokens.count(PLACEHOLDER) == n:  # (overlap scheduling's steady state)
                feed_rows = self._range[:n]
                feed_ids = [s.seq_id for s in seqs]
            else:
                feed_rows = [i for i, token in enumerate(tokens) if token == PLACEHOLDER]
                feed_ids = [seqs[i].seq_id for i in feed_rows]
        key = self.graph_key(n, max_len) if self.graph_key is not None else None
        return self._finish(
            n,
            n,
            1,
            max_len,
            max([k[1] for k in keys]),
            self._range[:n],
            self._decode_rows(seqs),
            key,
            n,
            feed_rows,
            feed_ids,
        )

    def share_states(self, target: "StepBuilder") -> None:
        """Read the target builder's copies of the sequences (a draft model's or head's builder)."""
        self.states = target.states
        self.applies_deltas = False

    def _decode_rows(self, seqs: list[ScheduledSeq]) -> list[SampleRow]:
        """The sampler rows of a decode step: each sequence's row of its previous step (a
        sequence's params, token list (never replaced, only appended to), sample index and
        grammar are its own for good; its history is the worker's copy, updated in place)."""
        known = self._rows
        rows = [known.get(s.seq_id) for s in seqs]  # (seq ids are never reused)
        missing = [i for i, r in enumerate(rows) if r is None]
        if missing:
            histories = self.states.histories
            for i in missing:
                rows[i] = known[seqs[i].seq_id] = _sample_row(seqs[i], histories[seqs[i].seq_id])
            if len(known) > 2 * len(seqs) + 64:  # forget finished sequences now and then
                self._rows = {s.seq_id: r for s, r in zip(seqs, rows)}
        return rows

    def _finish(
        self,
        t: int,
        num_seqs: int,
        max_q: int,
        max_len: int,
        max_cols: int,
        sample_indices: list[int],
        rows: list[SampleRow],
        graph_key: tuple[int, ...] | None,
        num_decodes: int,
        feed_rows: list[int],
        feed_ids: list[int],
    ) -> StepInputs:
        buf = self.buffers
        padded_seqs = num_seqs
        q = 1  # tokens per padding sequence (a verify graph's rows have q each)
        if graph_key is not None:
            padded_seqs = graph_key[0]
            q = graph_key[2] if len(graph_key) > 2 else 1
        elif self.compiled and t > 1:
            # A one-sequence step of several tokens gets a padding sequence: Dynamo would
            # otherwise specialise (and compile) a graph for exactly one sequence.
            padded_seqs = max(num_seqs, MIN_COMPILED_ROWS)
        extra = padded_seqs - num_seqs
        buf.fill_padding(t, num_seqs, extra, q)
        t_padded = t + extra * q
        if graph_key is not None and q > 1:
            # A verify graph reads rows * q tokens: its sequences' shortfall (fewer drafts than q - 1)
            # is left as rows no sequence claims (attention zeroes them, slot -1 writes nothing).
            buf.fill_tail(t_padded, padded_seqs * q)
            t_padded = padded_seqs * q
        self.features.pad(t, t_padded - t)
        self.features.upload(t_padded)
        buf.upload(t_padded, padded_seqs, max_cols)
        if feed_rows:
            self._feed_sampled(feed_rows, feed_ids)
        if graph_key is not None:
            return StepInputs(t_padded, padded_seqs, None, None, sample_indices, rows, graph_key)
        if self.compiled:
            meta = self.compiled_meta(t_padded, padded_seqs, max_q, max_len, num_decodes)
        else:
            views = self._views.get((t, num_seqs, max_cols))
            if views is None:  # (a steady decode batch asks for the same views step after step)
                if len(self._views) > 1024:
                    self._views.clear()
                views = self._views[t, num_seqs, max_cols] = (
                    buf.slot_mapping[:t],
                    buf.query_start_loc[: num_seqs + 1],
                    buf.seq_lens[:num_seqs],
                    buf.block_tables[:num_seqs, :max_cols],
                )
            meta = AttentionMetadata(*views, max_query_len=max_q, max_seq_len=max_len, num_decodes=num_decodes)
        return StepInputs(t_padded, padded_seqs, meta, self.features.context(t_padded), sample_indices, rows)

    def fill_padding_step(self, num_seqs: int, num_tokens: int | None = None, q: int = 1) -> None:
        """A step of padding only (compile warm-ups, graph captures): num_seqs sequences of q
        tokens each, the last one taking any extra tokens; nothing is written or read."""
        buf = self.buffers
        num_tokens = num_tokens or num_seqs * q
        buf.wait_staging()
        buf.np_query_start_loc[0] = 0
        buf.fill_padding(0, 0, num_seqs, q)
        buf.np_query_start_loc[num_seqs] = num_tokens
        buf.np_input_ids[:num_tokens] = 0
        buf.np_positions[:num_tokens] = 0
        buf.np_slot_mapping[:num_tokens] = -1
        self.features.pad(0, num_tokens)
        self.features.upload(num_tokens)
        buf.upload(num_tokens, num_seqs, 1)

    def _feed_sampled(self, rows: list[int], seq_ids: list[int]) -> None:
        """Overlap scheduling: input `rows` (a PLACEHOLDER on the host) take the tokens the previous
        step sampled for `seq_ids`, read from its device tensor, with no host round trip."""
        last = self.last_sampled
        prev_tokens = last.tokens
        buf = self.buffers
        k = len(rows)
        if last.verify is not None and any(i in last.verify.index for i in seq_ids):
            self._feed_verified(rows, seq_ids)
            return
        # (feed rows ascend: the last one is k - 1 only when they are 0..k-1)
        if rows[-1] == k - 1 and last.leads_with(seq_ids):
            # A steady decode batch: rows [0, k) take the previous step's rows [0, k) (one copy;
            # clamped as below). On the CPU the tokens are computed already: numpy, no op dispatch.
            if buf.device.type == "cpu":
                np.maximum(prev_tokens.numpy()[:k], 0, out=buf.np_input_ids[:k])
            else:
                torch.clamp(prev_tokens[:k], min=0, out=buf.input_ids[:k])
            return
        buf.np_feed_dst[:k] = rows
        buf.np_feed_src[:k] = last.rows_of(seq_ids)
        if buf.device.type != "cpu":
            buf.feed_dst[:k].copy_(buf.feed_dst_host[:k], non_blocking=True)
            buf.feed_src[:k].copy_(buf.feed_src_host[:k], non_blocking=True)
        # A failed row (-1) feeds token 0: that sequence is failed and its extra token discarded.
        buf.input_ids.index_copy_(0, buf.feed_dst[:k], prev_tokens.index_select(0, buf.feed_src[:k]).clamp(min=0))
        if buf.device.type != "cpu":
            buf.staging_in_use()  # the staging above is in use until these copies ran

    def _feed_verified(self, rows: list[int], seq_ids: list[int]) -> None:
        """Like _feed_sampled, where some sequences' last step was a verify step: each continues
        with its sampled row `accepted` (found on the device), the others with their one row."""
        last = self.last_sampled
        verify = last.verify
        device = self.buffers.device
        plain = [i for i in seq_ids if i not in verify.index]
        known = dict(zip(plain, last.rows_of(plain))) if plain else {}
        src = upload([known.get(i, 0) for i in seq_ids], torch.int64, device)
        at = [m for m, i in enumerate(seq_ids) if i in verify.index]
        which = upload([verify.index[seq_ids[m]] for m in at], torch.int64, device)
        src[upload(at, torch.int64, device)] = verify.feed_rows[which]
        dst = upload(rows, torch.int64, device)
        self.buffers.input_ids.index_copy_(0, dst, last.tokens.index_select(0, src).clamp(min=0))

    def _shift_positions(self, seqs: list[ScheduledSeq], verify) -> None:
        """Sequences whose last step was a verify step still in flight were placed as if all its
        drafts were kept: move their rows back by what was not (positions, slots, lengths), on
        the device, after the upload."""
        hit = [(i, verify.index[s.seq_id]) for i, s in enumerate(seqs) if s.after_verify]
        buf = self.buffers
        device = buf.device
        starts = buf.np_query_start_loc
        token_rows = [r for i, _ in hit for r in range(int(starts[i]), int(starts[i + 1]))]
        row_seq = [i for i, _ in hit for _ in range(int(starts[i]), int(starts[i + 1]))]
        shift = verify.shift[upload([v for _, v in hit], torch.int64, device)]
        per_row = torch.repeat_interleave(
            shift,
            upload([int(starts[i + 1] - starts[i]) for i, _ in hit], torch.int64, device),
            output_size=len(token_rows),  # (known here: no device-to-host read of the total)
        )
        rows = upload(token_rows, torch.int64, device)
        seq_index = upload([i for i, _ in hit], torch.int64, device)
        buf.positions.index_add_(0, rows, per_row.to(buf.positions.dtype))
        buf.seq_lens.index_add_(0, seq_index, shift.to(buf.seq_lens.dtype))
        pos = buf.positions[rows]
        bs = self.block_size
        blocks = buf.block_tables[upload(row_seq, torch.int64, device), pos // bs].to(torch.int64)
        buf.slot_mapping[rows] = blocks * bs + pos % bs

    def compiled_meta(
        self, num_tokens: int, num_seqs: int, max_q: int, max_len: int, num_decodes: int = 0
    ) -> AttentionMetadata:
        """Metadata for the compiled forward: full-width (static) block tables, max_seq_len >= 2."""
        buf = self.buffers
        tables = buf.block_tables[:num_seqs]
        mark_static_dims((tables,), (1,))
        return AttentionMetadata(
            slot_mapping=buf.slot_mapping[:num_tokens],
            query_start_loc=buf.query_start_loc[: num_seqs + 1],
            seq_lens=buf.seq_lens[:num_seqs],
            block_tables=tables,
            max_query_len=max_q,
            max_seq_len=max(max_len, MIN_COMPILED_ROWS),
            num_decodes=num_decodes,
        )
