"""ModelRunner: turns a SchedulerOutput into one forward pass and sampled tokens.

All per-step inputs are written into persistent buffers (`InputBuffers`): host staging
arrays and device tensors allocated once at their largest size. A step fills the host
side, copies the used prefix to the device, and runs the model on views of those
tensors, so captured CUDA graphs (compiler/capture.py) can replay over the same storage.

Unless `enforce_eager`, the forward is compiled (Inductor) and, on a GPU, decode steps
replay CUDA graphs (`DecodeGraphRunner`): the smallest captured bucket >= the batch,
with unused rows padded so they write nothing (slot -1) and read nothing (length 0).
Prefill/mixed steps and batches above the largest bucket run compiled without graphs.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from compiler.capture import (MIN_COMPILED_ROWS, CudaGraphSet, SimulatedGraphSet, bucket_for, compile_forward,
                              graph_ctx, mark_static_dims)
from engine.attention.base import AttentionMetadata
from engine.kv.cache import KVCache
from engine.sampler import HostCopy, PendingSample, Sampler, SampleRow, SamplerOutput, prompt_token_logprobs
from engine.scheduler import PLACEHOLDER, SchedulerOutput, sample_row_ranges

logger = logging.getLogger(__name__)

# Prompt logprobs: logits are computed for at most this many prompt rows at a time (each row is
# a vocabulary of float32; a whole chunk's at once could take gigabytes).
PROMPT_LOGPROB_ROWS = 256


class InputBuffers:
    """Every static input of a step, host staging + device tensor, sized for the largest step."""

    def __init__(self, max_tokens: int, max_seqs: int, max_blocks_per_seq: int, device: torch.device) -> None:
        self.max_tokens = max_tokens
        self.max_seqs = max_seqs
        self.max_blocks_per_seq = max_blocks_per_seq
        self.device = device
        pin = device.type == "cuda"

        def pair(shape, dtype):
            host = torch.zeros(shape, dtype=dtype, pin_memory=pin)
            dev = host if device.type == "cpu" else torch.zeros(shape, dtype=dtype, device=device)
            return host, dev

        self.input_ids_host, self.input_ids = pair(max_tokens, torch.int64)
        self.positions_host, self.positions = pair(max_tokens, torch.int64)
        self.slot_mapping_host, self.slot_mapping = pair(max_tokens, torch.int64)
        self.query_start_loc_host, self.query_start_loc = pair(max_seqs + 1, torch.int32)
        self.seq_lens_host, self.seq_lens = pair(max_seqs, torch.int32)
        self.block_tables_host, self.block_tables = pair((max_seqs, max_blocks_per_seq), torch.int32)
        self.lora_slots_host, self.lora_slots = pair(max_tokens, torch.int64)
        # Block-table cells changed since the last upload (flat index, block id): only those go to
        # the device, unless a step changes more than a row's worth per sequence.
        self.table_idx_host, self.table_idx = pair(max_seqs * 2, torch.int64)
        self.table_val_host, self.table_val = pair(max_seqs * 2, torch.int32)
        # Overlap scheduling: input rows whose token is the previous step's sampled row.
        self.feed_dst_host, self.feed_dst = pair(max_seqs, torch.int64)
        self.feed_src_host, self.feed_src = pair(max_seqs, torch.int64)
        # numpy views of the host side for fast filling
        self.np_input_ids = self.input_ids_host.numpy()
        self.np_positions = self.positions_host.numpy()
        self.np_slot_mapping = self.slot_mapping_host.numpy()
        self.np_query_start_loc = self.query_start_loc_host.numpy()
        self.np_seq_lens = self.seq_lens_host.numpy()
        self.np_block_tables = self.block_tables_host.numpy()
        self.np_lora_slots = self.lora_slots_host.numpy()
        # What each block-table row holds on the host: (the sequence's block list, its table
        # version, columns written); a row is rewritten only from the first column that changed.
        self._rows: list[tuple[list[int] | None, int, int]] = [(None, 0, 0)] * max_seqs
        self._table_updates: list[tuple[int, int]] = []
        self._table_dirty = False  # too many changes: copy the used table region whole
        # Host staging may be refilled only once the previous step's async copies have read it.
        self._copied = torch.cuda.Event() if device.type == "cuda" else None
        self._pending = False

    def wait_staging(self) -> None:
        if self._pending:
            self._copied.synchronize()
            self._pending = False

    def fill_padding(self, t: int, n: int, count: int) -> None:
        """Host rows [t, t+count) / sequences [n, n+count): one token each, slot -1, length 0."""
        if count <= 0:
            return
        self.np_input_ids[t:t + count] = 0
        self.np_positions[t:t + count] = 0
        self.np_slot_mapping[t:t + count] = -1
        self.np_lora_slots[t:t + count] = -1
        self.np_seq_lens[n:n + count] = 0
        self.np_query_start_loc[n + 1:n + count + 1] = np.arange(t + 1, t + count + 1)

    def write_table_row(self, i: int, blocks: list[int], version: int) -> int:
        """Row i of the block table := blocks (the columns not written there already); returns
        the row's width."""
        held, held_version, written = self._rows[i]
        cols = len(blocks)
        start = written if held is blocks and held_version == version and written <= cols else 0
        if start < cols:
            self.np_block_tables[i, start:cols] = blocks[start:]
            self._rows[i] = (blocks, version, cols)
            if not self._table_dirty:
                if len(self._table_updates) + cols - start > len(self.table_val_host):
                    self._table_dirty = True
                else:
                    base = i * self.max_blocks_per_seq
                    self._table_updates.extend((base + c, blocks[c]) for c in range(start, cols))
        return cols

    def upload(self, num_tokens: int, num_seqs: int, num_block_cols: int) -> None:
        """Copy the filled host prefix to the device (no-op on the CPU)."""
        updates, self._table_updates = self._table_updates, []
        dirty, self._table_dirty = self._table_dirty, False
        if self.device.type == "cpu":
            return
        for host, dev, n in ((self.input_ids_host, self.input_ids, num_tokens),
                             (self.positions_host, self.positions, num_tokens),
                             (self.slot_mapping_host, self.slot_mapping, num_tokens),
                             (self.lora_slots_host, self.lora_slots, num_tokens),
                             (self.query_start_loc_host, self.query_start_loc, num_seqs + 1),
                             (self.seq_lens_host, self.seq_lens, num_seqs)):
            dev[:n].copy_(host[:n], non_blocking=True)
        if dirty:
            self.block_tables[:num_seqs, :num_block_cols].copy_(
                self.block_tables_host[:num_seqs, :num_block_cols], non_blocking=True)
        elif updates:
            k = len(updates)
            self.table_idx_host[:k] = torch.tensor([u[0] for u in updates])
            self.table_val_host[:k] = torch.tensor([u[1] for u in updates], dtype=torch.int32)
            self.table_idx[:k].copy_(self.table_idx_host[:k], non_blocking=True)
            self.table_val[:k].copy_(self.table_val_host[:k], non_blocking=True)
            self.block_tables.view(-1).index_copy_(0, self.table_idx[:k], self.table_val[:k])
        self._copied.record()
        self._pending = True


@dataclass
class StepInputs:
    num_tokens: int
    num_seqs: int
    meta: AttentionMetadata
    sample_indices: list[int]  # rows of the hidden states to sample from (repeated for forks)
    rows: list[SampleRow]
    graph_key: tuple[int, int] | None = None  # (rows, ctx) of the decode graph to replay
    prompt_scores: list[PromptScore] = field(default_factory=list)
    # Embedding requests' chunks: (seq id, first hidden row, rows, pooling type, first position, ends the prompt)
    pools: list[tuple[int, int, int, str, int, bool]] = field(default_factory=list)


@dataclass
class PromptScore:
    """Prompt tokens to score this step for one sequence (SamplingParams.prompt_logprobs):
    hidden row `row + k` predicts prompt token `first_index + k`, which is `targets[k]`."""

    seq_id: int
    row: int
    first_index: int
    targets: list[int]
    top_n: int


class ModelRunner:
    def __init__(self, model: torch.nn.Module, kv_cache: KVCache, sampler: Sampler, device: torch.device,
                 block_size: int, max_num_seqs: int, max_num_batched_tokens: int, max_model_len: int) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.sampler = sampler
        self.device = device
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.max_blocks_per_seq = -(-max_model_len // block_size)
        # Room for the padding rows of compiled steps (>= MIN_COMPILED_ROWS tokens and sequences).
        max_seqs = max(max_num_seqs, MIN_COMPILED_ROWS + 4) + 1
        self.buffers = InputBuffers(max(max_num_batched_tokens, max_seqs) + MIN_COMPILED_ROWS + 2, max_seqs,
                                    self.max_blocks_per_seq, device)
        self.forward_fn = model.forward  # replaced by the compiled forward (compiler/capture.py)
        self.compiled = False  # forward_fn is torch.compile'd: pad steps, full-width block tables
        self.graph_runner: DecodeGraphRunner | None = None  # set when decode CUDA graphs are captured
        # The last launched step's sampled tokens (device) and seq id -> row in them.
        self._last_sampled: tuple[torch.Tensor, dict[int, int]] = (torch.zeros(0, dtype=torch.int64), {})

    # ---- inputs ----
    def prepare(self, sched: SchedulerOutput) -> StepInputs:
        buf = self.buffers
        buf.wait_staging()
        seqs = sched.seqs
        if all(s.num_tokens == 1 and s.do_sample and s.num_samples == 1 and not s.pooling for s in seqs):
            return self._prepare_decode(seqs)
        bs = self.block_size
        t = 0
        max_q = 0
        max_len = 0
        max_cols = 1
        sample_indices: list[int] = []
        rows: list[SampleRow] = []
        scores: list[PromptScore] = []
        pools: list[tuple[int, int, int, str, int, bool]] = []
        feed: list[tuple[int, int]] = []  # (input row, seq id): the previous step's sampled token
        buf.np_query_start_loc[0] = 0
        num_decodes = 0  # leading one-token sequences (the scheduler puts decodes first)
        for i, s in enumerate(seqs):
            n = s.num_tokens
            if n == 1 and num_decodes == i:
                num_decodes += 1
            start = s.start_pos
            end = start + n
            buf.np_input_ids[t:t + n] = s.token_ids
            if n == 1 and s.token_ids[0] == PLACEHOLDER:
                feed.append((t, s.seq_id))
            buf.np_lora_slots[t:t + n] = s.lora_slot
            pos = np.arange(start, end, dtype=np.int64)
            buf.np_positions[t:t + n] = pos
            table = np.asarray(s.block_ids, dtype=np.int64)
            buf.np_slot_mapping[t:t + n] = table[pos // bs] * bs + pos % bs
            cols = buf.write_table_row(i, s.block_ids, s.seq.table_version if s.seq is not None else 0)
            max_cols = max(max_cols, cols)
            buf.np_seq_lens[i] = end
            last_scored = min(end, s.num_prompt_tokens - 1)  # position j predicts prompt token j + 1
            if s.params.prompt_logprobs is not None and start < last_scored:
                scores.append(PromptScore(s.seq_id, t, start + 1, s.all_token_ids[start + 1:last_scored + 1],
                                          s.params.prompt_logprobs))
            if s.pooling:
                pools.append((s.seq_id, t, n, s.pooling, start, s.do_sample))
            t += n
            buf.np_query_start_loc[i + 1] = t
            max_q = max(max_q, n)
            max_len = max(max_len, end)
            if s.pooling:
                pass  # its hidden states are pooled (StepInputs.pools), nothing is sampled
            elif s.do_sample and s.draft_token_ids:
                # Speculative: every position is sampled, each row with its own history (the
                # sequence, then the drafts before that position).
                first = t - n
                for j in range(n):
                    sample_indices.append(first + j)
                    rows.append(SampleRow(s.params, s.all_token_ids, s.num_prompt_tokens, s.sample_index,
                                          extra=s.draft_token_ids[:j], key=s.seq_id))
            elif s.do_sample:
                for k in range(s.num_samples):
                    sample_indices.append(t - 1)
                    rows.append(SampleRow(s.params, s.all_token_ids, s.num_prompt_tokens, s.sample_index + k,
                                          s.grammars[s.sample_index + k] if s.grammars else None, key=s.seq_id))
        step = self._finish_prepare(t, len(seqs), max_q, max_len, max_cols, sample_indices, rows, None,
                                    num_decodes, feed)
        step.prompt_scores = scores
        step.pools = pools
        return step

    def _prepare_decode(self, seqs) -> StepInputs:
        """One token per sequence, each sampled once: the CUDA-graph shape. One pass, no numpy temporaries."""
        buf = self.buffers
        bs = self.block_size
        ids, positions, slots, lens = buf.np_input_ids, buf.np_positions, buf.np_slot_mapping, buf.np_seq_lens
        adapters = buf.np_lora_slots
        max_cols = 1
        max_len = 0
        rows: list[SampleRow] = []
        feed: list[tuple[int, int]] = []
        write_row = buf.write_table_row
        for i, s in enumerate(seqs):
            p = s.start_pos
            blocks = s.block_ids
            token = s.token_ids[0]
            ids[i] = token
            if token == PLACEHOLDER:
                feed.append((i, s.seq_id))
            adapters[i] = s.lora_slot
            positions[i] = p
            slots[i] = blocks[p // bs] * bs + p % bs
            lens[i] = p + 1
            cols = write_row(i, blocks, s.seq.table_version if s.seq is not None else 0)
            if cols > max_cols:
                max_cols = cols
            if p >= max_len:
                max_len = p + 1
            rows.append(SampleRow(s.params, s.all_token_ids, s.num_prompt_tokens, s.sample_index,
                                  s.grammars[s.sample_index] if s.grammars else None, key=s.seq_id))
        n = len(seqs)
        buf.np_query_start_loc[:n + 1] = np.arange(n + 1)
        key = self.graph_runner.key_for(n, max_len) if self.graph_runner is not None else None
        return self._finish_prepare(n, n, 1, max_len, max_cols, list(range(n)), rows, key, n, feed)

    def _finish_prepare(self, t: int, num_seqs: int, max_q: int, max_len: int, max_cols: int,
                        sample_indices: list[int], rows: list[SampleRow],
                        graph_key: tuple[int, int] | None, num_decodes: int,
                        feed: list[tuple[int, int]]) -> StepInputs:
        buf = self.buffers
        padded_seqs = num_seqs
        if graph_key is not None:
            padded_seqs = graph_key[0]
        elif self.compiled and t > 1:
            # A one-sequence step of several tokens gets a padding sequence: Dynamo would
            # otherwise specialise (and compile) a graph for exactly one sequence.
            padded_seqs = max(num_seqs, MIN_COMPILED_ROWS)
        extra = padded_seqs - num_seqs
        buf.fill_padding(t, num_seqs, extra)
        t_padded = t + extra
        buf.upload(t_padded, padded_seqs, max_cols)
        if feed:
            self._feed_sampled(feed)
        if graph_key is not None:
            meta = None  # the graph replays over the static buffers
        elif self.compiled:
            meta = self._compiled_meta(t_padded, padded_seqs, max_q, max_len, num_decodes)
        else:
            meta = AttentionMetadata(
                slot_mapping=buf.slot_mapping[:t],
                query_start_loc=buf.query_start_loc[:num_seqs + 1],
                seq_lens=buf.seq_lens[:num_seqs],
                block_tables=buf.block_tables[:num_seqs, :max_cols],
                max_query_len=max_q,
                max_seq_len=max_len,
                num_decodes=num_decodes,
                lora_slots=buf.lora_slots[:t] if self.model.lora_slots else None,
            )
        return StepInputs(t_padded, padded_seqs, meta, sample_indices, rows, graph_key)

    def _feed_sampled(self, feed: list[tuple[int, int]]) -> None:
        """Overlap scheduling: rows whose input is a token the previous step sampled (a
        PLACEHOLDER on the host) read it from that step's device tensor, with no host round trip."""
        prev_tokens, prev_rows = self._last_sampled
        buf = self.buffers
        k = len(feed)
        buf.feed_dst_host[:k] = torch.tensor([row for row, _ in feed])
        buf.feed_src_host[:k] = torch.tensor([prev_rows[seq_id] for _, seq_id in feed])
        if self.device.type != "cpu":
            buf.feed_dst[:k].copy_(buf.feed_dst_host[:k], non_blocking=True)
            buf.feed_src[:k].copy_(buf.feed_src_host[:k], non_blocking=True)
        # A failed row (-1) feeds token 0: that sequence is failed and its extra token discarded.
        buf.input_ids.index_copy_(0, buf.feed_dst[:k], prev_tokens.index_select(0, buf.feed_src[:k]).clamp(min=0))
        if self.device.type != "cpu":
            buf._copied.record()  # the staging above is in use until these copies ran
            buf._pending = True

    def _compiled_meta(self, num_tokens: int, num_seqs: int, max_q: int, max_len: int,
                       num_decodes: int = 0) -> AttentionMetadata:
        """Metadata for the compiled forward: full-width (static) block tables, max_seq_len >= 2."""
        buf = self.buffers
        tables = buf.block_tables[:num_seqs]
        mark_static_dims((tables,), (1,))
        return AttentionMetadata(
            slot_mapping=buf.slot_mapping[:num_tokens],
            query_start_loc=buf.query_start_loc[:num_seqs + 1],
            seq_lens=buf.seq_lens[:num_seqs],
            block_tables=tables,
            max_query_len=max_q,
            max_seq_len=max(max_len, MIN_COMPILED_ROWS),
            num_decodes=num_decodes,
            lora_slots=buf.lora_slots[:num_tokens] if self.model.lora_slots else None,
        )

    # ---- compile / capture (start-up) ----
    @torch.inference_mode()
    def compile_model(self) -> float:
        """torch.compile the forward and compile its three graphs now: one token (batch-1 decode,
        static shapes), decode-shaped (one token per sequence, batch size symbolic) and general.

        Returns seconds. The warm-up steps are all padding (slot -1, length 0): they write only
        the null block. They are traced without duck sizing, so no coincidence of sizes (tokens,
        sequences + 1, KV blocks) ties two dimensions to one symbol.

        The KV cache's block count is symbolic (its other dimensions static), so a persistent
        compile cache is hit again whatever the profiled pool size of the next start.
        """
        t0 = time.perf_counter()
        mark_static_dims([self.kv_cache.tensor], dims=(0, 1, 3, 4, 5))
        torch._dynamo.mark_dynamic(self.kv_cache.tensor, 2)
        self.forward_fn = compile_forward(self.model.forward)
        self.compiled = True
        # Float constants (norm eps, attention scale) specialised up front: left symbolic, Dynamo
        # traces each graph twice (it restarts once they are found to be constants).
        with torch.fx.experimental._config.patch(use_duck_shape=False), \
                torch._dynamo.config.patch(specialize_float=True):
            self._compile_warmup_steps()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter() - t0

    def _compile_warmup_steps(self) -> None:
        buf = self.buffers
        for num_tokens, num_seqs, max_q in ((1, 1, 1), (3, 3, 1), (5, 2, 4)):
            buf.np_query_start_loc[0] = 0
            buf.fill_padding(0, 0, num_seqs)
            buf.np_query_start_loc[num_seqs] = num_tokens  # the last sequence takes the extra tokens
            buf.np_input_ids[:num_tokens] = 0
            buf.np_positions[:num_tokens] = 0
            buf.np_slot_mapping[:num_tokens] = -1
            buf.upload(num_tokens, num_seqs, 1)
            meta = self._compiled_meta(num_tokens, num_seqs, max_q, max_q)
            self.forward_fn(buf.input_ids[:num_tokens], buf.positions[:num_tokens], self.kv_cache.tensor, meta)

    def capture_graphs(self, sizes: list[int], device_reads_lengths: bool, simulate: bool = False) -> float:
        """Capture one decode graph per batch bucket (CUDA only); returns seconds.

        simulate=True (tests on the CPU): no CUDA graphs, each "replay" runs the graph body
        eagerly over the same static buffers, so bucketing and padding are exercised anyway.
        """
        if not self.compiled:
            raise RuntimeError("capture_graphs needs the compiled forward: call compile_model first")
        if self.device.type != "cuda" and not simulate:
            raise RuntimeError("CUDA graphs need device='cuda'")
        sizes = sorted({s for s in sizes if s >= 1})
        if not sizes:
            return 0.0
        if sizes[-1] > self.buffers.max_seqs - 1:
            raise ValueError(f"cuda_graph_sizes: {sizes[-1]} is larger than max_num_seqs")
        self.graph_runner = DecodeGraphRunner(self, sizes, device_reads_lengths, simulate)
        return self.graph_runner.capture_startup()

    # ---- the step ----
    def execute(self, sched: SchedulerOutput) -> SamplerOutput:
        """Run one step and wait for its sampled tokens on the host."""
        return self.launch(sched).result()

    @torch.inference_mode()
    def launch(self, sched: SchedulerOutput) -> "PendingStep":
        """Queue one step on the device; its sampled tokens stay there (they feed the next step's
        placeholders) and come to the host when PendingStep.result() is called."""
        if sched.blocks_to_copy:
            src = torch.tensor([a for a, _ in sched.blocks_to_copy], device=self.device)
            dst = torch.tensor([b for _, b in sched.blocks_to_copy], device=self.device)
            torch.ops.kiln.copy_blocks(self.kv_cache.tensor, src, dst)
        if not sched.seqs:
            return PendingStep(PendingSample.empty(self.device))
        step = self.prepare(sched)
        if self.graph_runner is not None and self.graph_runner.can_replay(step):
            hidden, tokens = self.graph_runner.replay(step)
            n = len(step.rows)
            if all(_plain_greedy(r) for r in step.rows):
                # argmax computed in the graph; -1 marks a row with non-finite logits (the sampler's rule)
                sample = PendingSample(tokens[:n], HostCopy(tokens[:n]), {})
            else:  # the sampler needs the logits: one more LM-head matmul over the graph's hidden states
                sample = self.sampler.launch(self.model.compute_logits(hidden[:n]), step.rows)
            return self._remember(sched, PendingStep(sample))
        hidden = self.run_model(step)
        if not step.rows:
            pending = PendingStep(PendingSample.empty(self.device))
        else:
            idx = torch.tensor(step.sample_indices, device=self.device)
            pending = PendingStep(self.sampler.launch(self.model.compute_logits(hidden[idx]), step.rows))
        for score in step.prompt_scores:
            pending.prompt_logprobs[score.seq_id] = (score.first_index, self._score_prompt(hidden, score))
        for seq_id, first, rows, kind, start, final in step.pools:
            chunk = hidden[first:first + rows].float()
            if kind == "mean":
                pending.pooled[seq_id] = (chunk.sum(dim=0), rows, start, final)
            elif final:
                pending.pooled[seq_id] = (chunk[-1], 1, start, final)
        return self._remember(sched, pending)

    def _remember(self, sched: SchedulerOutput, pending: "PendingStep") -> "PendingStep":
        """Keep the step's device tokens and each one-token sampling sequence's row in them: the
        next step's placeholders read from there."""
        rows = {s.seq_id: r.start for s, r in sample_row_ranges(sched.seqs) if len(r) == 1}
        self._last_sampled = (pending.sample.tokens, rows)
        return pending

    def _score_prompt(self, hidden: torch.Tensor, score: PromptScore) -> list[dict[int, float]]:
        entries: list[dict[int, float]] = []
        for lo in range(0, len(score.targets), PROMPT_LOGPROB_ROWS):
            targets = score.targets[lo:lo + PROMPT_LOGPROB_ROWS]
            rows = hidden[score.row + lo:score.row + lo + len(targets)]
            entries += prompt_token_logprobs(self.model.compute_logits(rows), targets, score.top_n)
        return entries

    def run_model(self, step: StepInputs) -> torch.Tensor:
        buf = self.buffers
        return self.forward_fn(buf.input_ids[:step.num_tokens], buf.positions[:step.num_tokens],
                               self.kv_cache.tensor, step.meta)

    @staticmethod
    def split_sampled(sched: SchedulerOutput, out: SamplerOutput) -> list[list[int]]:
        """Regroup the flat sampled tokens per scheduled sequence (n at fork points)."""
        return [[out.token_ids[r] for r in rows] for _, rows in sample_row_ranges(sched.seqs)]


class PendingStep:
    """A launched step: its sample on the way to the host, plus what was read off its hidden
    states (prompt logprobs, pooled embeddings)."""

    def __init__(self, sample: PendingSample) -> None:
        self.sample = sample
        self.prompt_logprobs: dict[int, tuple[int, list[dict[int, float]]]] = {}
        self.pooled: dict[int, tuple[torch.Tensor, int, int, bool]] = {}

    def result(self) -> SamplerOutput:
        out = self.sample.result()
        out.prompt_logprobs = self.prompt_logprobs
        out.pooled = self.pooled
        return out


def _plain_greedy(r: SampleRow) -> bool:
    """The sampler would return argmax(logits) for this row (what a decode graph computes)."""
    p = r.params
    return (p.greedy and p.logprobs is None and not p.needs_penalties and not p.logits_processors
            and not p.restricts_tokens and r.num_output_tokens >= p.min_tokens and r.grammar is None)


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

    def __init__(self, runner: ModelRunner, sizes: list[int], device_reads_lengths: bool,
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

    def _body(self, rows: int, ctx: int) -> tuple[torch.Tensor, torch.Tensor]:
        r = self.runner
        buf = r.buffers
        meta = r._compiled_meta(rows, rows, 1, ctx)
        hidden = r.forward_fn(buf.input_ids[:rows], buf.positions[:rows], r.kv_cache.tensor, meta)
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
        buf = self.runner.buffers
        max_rows = self.rows_for(self.max_batch)
        buf.wait_staging()
        buf.np_query_start_loc[0] = 0
        buf.fill_padding(0, 0, max_rows)
        buf.upload(max_rows, max_rows, 1)
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
            buf = self.runner.buffers
            buf.wait_staging()
            buf.np_query_start_loc[0] = 0
            buf.fill_padding(0, 0, key[0])
            buf.upload(key[0], key[0], 1)
            self.graphs.capture(key)
        return key

    def can_replay(self, step: StepInputs) -> bool:
        return step.graph_key is not None

    def replay(self, step: StepInputs) -> tuple[torch.Tensor, torch.Tensor]:
        key = step.graph_key
        if key not in self.graphs:
            captured = self.graphs.capture(key)  # reference attention, a longer context bucket
            logger.info("captured decode CUDA graph rows=%d max_seq_len=%d in %.2fs", key[0], key[1],
                        captured.seconds)
        self.num_replays += 1
        self.replayed[key] = self.replayed.get(key, 0) + 1
        return self.graphs.replay(key)
