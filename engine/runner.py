"""ModelRunner: turns a SchedulerOutput into one forward pass and sampled tokens.

All per-step inputs are written into persistent buffers (`InputBuffers`): host staging
arrays and device tensors allocated once at their largest size. A step fills the host
side, copies the used prefix to the device, and runs the model on views of those
tensors, so captured CUDA graphs (compiler/capture.py) can replay over the same storage.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from engine.attention.base import AttentionMetadata
from engine.kv.cache import KVCache
from engine.sampler import Sampler, SampleRow, SamplerOutput
from engine.scheduler import SchedulerOutput


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
        # numpy views of the host side for fast filling
        self.np_input_ids = self.input_ids_host.numpy()
        self.np_positions = self.positions_host.numpy()
        self.np_slot_mapping = self.slot_mapping_host.numpy()
        self.np_query_start_loc = self.query_start_loc_host.numpy()
        self.np_seq_lens = self.seq_lens_host.numpy()
        self.np_block_tables = self.block_tables_host.numpy()

    def upload(self, num_tokens: int, num_seqs: int, num_block_cols: int) -> None:
        """Copy the filled host prefix to the device (no-op on the CPU)."""
        if self.device.type == "cpu":
            return
        for host, dev, n in ((self.input_ids_host, self.input_ids, num_tokens),
                             (self.positions_host, self.positions, num_tokens),
                             (self.slot_mapping_host, self.slot_mapping, num_tokens),
                             (self.query_start_loc_host, self.query_start_loc, num_seqs + 1),
                             (self.seq_lens_host, self.seq_lens, num_seqs)):
            dev[:n].copy_(host[:n], non_blocking=True)
        self.block_tables[:num_seqs, :num_block_cols].copy_(
            self.block_tables_host[:num_seqs, :num_block_cols], non_blocking=True)


@dataclass
class StepInputs:
    num_tokens: int
    num_seqs: int
    meta: AttentionMetadata
    sample_indices: list[int]  # rows of the hidden states to sample from (repeated for forks)
    rows: list[SampleRow]


class ModelRunner:
    def __init__(self, model: torch.nn.Module, kv_cache: KVCache, sampler: Sampler, device: torch.device,
                 block_size: int, max_num_seqs: int, max_num_batched_tokens: int, max_model_len: int) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.kv_layers = kv_cache.layers
        self.sampler = sampler
        self.device = device
        self.block_size = block_size
        self.max_blocks_per_seq = -(-max_model_len // block_size)
        self.buffers = InputBuffers(max(max_num_batched_tokens, max_num_seqs), max_num_seqs,
                                    self.max_blocks_per_seq, device)
        self.forward_fn = model.forward  # replaced by the compiled forward (compiler/capture.py)
        self.graph_runner = None  # set when decode CUDA graphs are captured

    # ---- inputs ----
    def prepare(self, sched: SchedulerOutput) -> StepInputs:
        buf = self.buffers
        bs = self.block_size
        t = 0
        max_q = 0
        max_len = 0
        max_cols = 1
        sample_indices: list[int] = []
        rows: list[SampleRow] = []
        buf.np_query_start_loc[0] = 0
        for i, s in enumerate(sched.seqs):
            n = s.num_tokens
            start = s.start_pos
            end = start + n
            buf.np_input_ids[t:t + n] = s.token_ids
            pos = np.arange(start, end, dtype=np.int64)
            buf.np_positions[t:t + n] = pos
            table = np.asarray(s.block_ids, dtype=np.int64)
            buf.np_slot_mapping[t:t + n] = table[pos // bs] * bs + pos % bs
            cols = len(s.block_ids)
            buf.np_block_tables[i, :cols] = s.block_ids
            max_cols = max(max_cols, cols)
            buf.np_seq_lens[i] = end
            t += n
            buf.np_query_start_loc[i + 1] = t
            max_q = max(max_q, n)
            max_len = max(max_len, end)
            if s.do_sample:
                for k in range(s.num_samples):
                    sample_indices.append(t - 1)
                    rows.append(SampleRow(s.params, s.all_token_ids, s.num_prompt_tokens, s.sample_index + k))
        num_seqs = len(sched.seqs)
        buf.upload(t, num_seqs, max_cols)
        meta = AttentionMetadata(
            slot_mapping=buf.slot_mapping[:t],
            query_start_loc=buf.query_start_loc[:num_seqs + 1],
            seq_lens=buf.seq_lens[:num_seqs],
            block_tables=buf.block_tables[:num_seqs, :max_cols],
            max_query_len=max_q,
            max_seq_len=max_len,
        )
        return StepInputs(t, num_seqs, meta, sample_indices, rows)

    # ---- the step ----
    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput) -> SamplerOutput:
        if sched.blocks_to_copy:
            src = torch.tensor([a for a, _ in sched.blocks_to_copy], device=self.device)
            dst = torch.tensor([b for _, b in sched.blocks_to_copy], device=self.device)
            torch.ops.kiln.copy_blocks(self.kv_cache.tensor, src, dst)
        if not sched.seqs:
            return SamplerOutput([], [])
        step = self.prepare(sched)
        hidden = self.run_model(step)
        if not step.rows:
            return SamplerOutput([], [])
        idx = torch.tensor(step.sample_indices, device=self.device)
        logits = self.model.compute_logits(hidden[idx])
        return self.sampler(logits, step.rows)

    def run_model(self, step: StepInputs) -> torch.Tensor:
        buf = self.buffers
        if self.graph_runner is not None and self.graph_runner.can_replay(step):
            return self.graph_runner.replay(step)
        return self.forward_fn(buf.input_ids[:step.num_tokens], buf.positions[:step.num_tokens],
                               self.kv_layers, step.meta)

    def split_sampled(self, sched: SchedulerOutput, out: SamplerOutput) -> list[list[int]]:
        """Regroup the flat sampled tokens per scheduled sequence (n at fork points)."""
        result: list[list[int]] = []
        k = 0
        for s in sched.seqs:
            if s.do_sample:
                result.append(out.token_ids[k:k + s.num_samples])
                k += s.num_samples
            else:
                result.append([])
        return result
