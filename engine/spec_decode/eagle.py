"""EAGLE / EAGLE-3 heads inside the launch (engine/models/eagle.py has the heads themselves).

The head's row at position p reads the target's feature at p (its hidden state there) and the
token at p + 1, and predicts the token at p + 2. So it runs at two moments:

  after the target's step is sampled (`sampled`): the catch-up. One head forward over exactly
      the step's rows (same positions, slots and block tables: the head's KV covers what the
      target's covers), each row fed the token after it: the next input token inside a chunk,
      the sampled token where the row samples (a verify row's is its accepted draft or the
      token sampled instead). Its output at each sequence's last kept row (a verify sequence's
      row `accepted`, found on the device) is the sequence's seed for the next step;
  before the next step's forward (`propose`): draft 1 from the seed through the head's LM head,
      then forwards j = 1..k-1 feeding draft j and the head's previous output at position
      start + j - 1, each giving draft j + 1 (decode-shaped: the head's decode graphs on a GPU).

Chain drafting (one candidate per position), not a tree: a tree verifies several branches in
one forward, which pays on a GPU with batch room to spare, but it needs tree attention masks in
the target's kernels and a rejection rule over branches; a chain fits kiln's paged causal kernels
and exact per-row rejection sampling unchanged, and at batch 1 on the CPU every extra verified
token costs a row of compute. A sequence with no seed (it was not in the previous step: swapped
back in) drafts from a zero seed: its drafts are poor but verified like any others.
"""

from __future__ import annotations

import dataclasses
from typing import Protocol, cast

import torch

from engine.core.sched.scheduler_output import PLACEHOLDER, SchedulerOutput, sample_row_ranges
from engine.spec_decode.proposal import STAGING_SLOTS, Proposal, verify_seqs
from engine.spec_decode.rejection import sample_drafts
from engine.worker.host_upload import upload
from engine.worker.model_runner import ModelRunner, PendingStep
from engine.worker.sample.sampler_output import LastSampled
from engine.worker.step_builder import StepBuilder


class _HeadConfig(Protocol):
    @property
    def hidden_size(self) -> int: ...


class _Head(Protocol):
    """What the proposer reads of its head (engine/models/eagle.py EagleHead, Eagle3Head; the runner
    holds it as a plain nn.Module)."""

    @property
    def eagle(self) -> _HeadConfig: ...

    hidden_in: torch.Tensor  # h's static input rows (written in place)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor: ...

    def features(self, target_hidden: torch.Tensor, rows: int) -> torch.Tensor: ...


class _Seeds:
    """The previous step's seeds: the head's output at each sampling sequence's last kept row."""

    def __init__(self, hidden: torch.Tensor, rows: dict[int, int]) -> None:
        self.hidden = hidden
        self.rows = rows


class EagleProposer:
    def __init__(self, runner: ModelRunner, target: ModelRunner, generator: torch.Generator) -> None:
        self.runner = runner  # the head's runner: its own buffers, cache tensor, graphs
        runner.hidden_only = True  # (its graphs stop at the hidden states: logits are computed here, once)
        runner.buffers.use_staging_ring(STAGING_SLOTS)
        self.target = target  # the target's runner: its step's input ids and placeholders
        runner.builder.share_states(target.builder)  # (one copy of each sequence per worker)
        self.head = cast(_Head, runner.model)
        self.generator = generator
        self.seeds: _Seeds | None = None
        self.unseeded: set[int] = set()  # sequences of the last proposal that drafted from a zero seed
        self.num_forwards = 0

    # ---- before the target's forward ----
    def propose(self, sched: SchedulerOutput, target: StepBuilder) -> Proposal | None:
        verify = verify_seqs(sched)
        if not verify:
            return None
        proposal = Proposal(verify)
        hidden = self._seed_rows([v.record.seq_id for v in verify])
        self._sample(proposal, 0, hidden)
        for j in range(1, max(v.k for v in verify)):
            members = proposal.members(j)  # those that want draft j + 1: feed draft j
            previous = proposal.members(j - 1)
            keep = [m for m, v in enumerate(previous) if v.k > j]
            if len(keep) < len(previous):
                pick = upload(keep, torch.int64, hidden.device)
                hidden = hidden.index_select(0, pick)
                fed_tokens = proposal.tokens[j - 1].index_select(0, pick)
            else:
                fed_tokens = proposal.tokens[j - 1]
            fed = [
                dataclasses.replace(
                    v.record,
                    token_ids=[PLACEHOLDER],
                    start_pos=v.record.start_pos + j - 1,
                    draft_token_ids=[],
                    do_sample=True,
                    num_samples=1,
                )
                for v in members
            ]
            self.runner.builder.last_sampled = LastSampled(fed_tokens, fed, True)
            hidden = self._forward(SchedulerOutput(seqs=fed, num_decode_tokens=len(fed)), hidden)[: len(fed)]
            self._sample(proposal, j, hidden)
        return proposal

    def _seed_rows(self, seq_ids: list[int]) -> torch.Tensor:
        seeds = self.seeds
        width = self.head.eagle.hidden_size
        self.unseeded = {i for i in seq_ids if seeds is None or i not in seeds.rows}
        if seeds is None:
            return torch.zeros(len(seq_ids), width, dtype=self.head.hidden_in.dtype, device=self.head.hidden_in.device)
        rows = [seeds.rows.get(i, -1) for i in seq_ids]
        if all(r >= 0 for r in rows):
            return seeds.hidden.index_select(0, upload(rows, torch.int64, seeds.hidden.device))
        out = torch.zeros(len(seq_ids), width, dtype=seeds.hidden.dtype, device=seeds.hidden.device)
        for m, r in enumerate(rows):
            if r >= 0:
                out[m] = seeds.hidden[r]
        return out

    def _sample(self, proposal: Proposal, j: int, hidden: torch.Tensor) -> None:
        members = proposal.members(j)
        logits = self.head.compute_logits(hidden)
        tokens, q = sample_drafts(logits, [v.draft_rows[j] for v in members], self.generator)
        proposal.tokens.append(tokens)
        proposal.q.append(q if any(v.draft_rows[j].uses_q for v in members) else None)

    def _forward(self, sched: SchedulerOutput, hidden: torch.Tensor) -> torch.Tensor:
        """One head forward over a step's records, its h input rows set to `hidden`."""
        self.num_forwards += 1
        runner = self.runner
        step = runner.prepare(sched)
        self.head.hidden_in[: hidden.shape[0]].copy_(hidden)
        if runner.graph_runner is not None and runner.graph_runner.can_replay(step):
            out, _ = runner.graph_runner.replay(step)
            return out
        return runner.run_model(step)

    # ---- after the target's step is sampled ----
    def sampled(self, sched: SchedulerOutput, pending: PendingStep) -> None:
        """The catch-up over the step's rows (see the module docstring) and the next seeds."""
        target_hidden = pending.hidden
        if target_hidden is None or not sched.seqs:
            self.seeds = None
            return
        sampled = pending.sample.tokens if pending.sample is not None else None
        device = target_hidden.device
        rows_total = sum(s.num_tokens for s in sched.seqs)
        # Each row's next token: the input token after it; where the row samples, the sampled one;
        # at the end of a prompt chunk that samples nothing, the prompt's next token (host).
        shift_rows: list[int] = []
        shift_from: list[int] = []
        host_rows: list[int] = []
        host_tokens: list[int] = []
        sample_rows: list[int] = []
        sample_from: list[int] = []
        seed_of: dict[int, int] = {}  # seq id -> its row (non-verify sequences)
        verify = {v.index: v for v in (pending.proposal.seqs if pending.proposal is not None else [])}
        histories = self.target.builder.states.histories
        row = 0
        for i, (s, rows) in enumerate(sample_row_ranges(sched.seqs)):
            n = s.num_tokens
            v = verify.get(i)
            if v is not None:  # every row samples: its token is the next one
                sample_rows.extend(range(row, row + n))
                sample_from.extend(range(rows.start, rows.start + n))
            else:
                shift_rows.extend(range(row, row + n - 1))
                shift_from.extend(range(row + 1, row + n))
                if len(rows):
                    sample_rows.append(row + n - 1)
                    sample_from.append(rows.start)  # (a fork's first sample: the parent's token)
                    seed_of[s.seq_id] = row + n - 1
                else:
                    end = s.start_pos + n
                    host_rows.append(row + n - 1)
                    history = histories[s.seq_id]
                    host_tokens.append(history[end] if end < len(history) else 0)
            row += n
        ids = torch.zeros(rows_total, dtype=torch.int64, device=device)
        target_ids = self._target_ids(rows_total)
        if shift_rows:
            ids[_index(shift_rows, device)] = target_ids[_index(shift_from, device)]
        if host_rows:
            ids[_index(host_rows, device)] = upload(host_tokens, torch.int64, device)
        if sample_rows:
            assert sampled is not None  # (rows sample: the step was sampled before this catch-up)
            ids[_index(sample_rows, device)] = sampled[_index(sample_from, device)].clamp(min=0)
        out = self._catch_up(sched, ids, self.head.features(target_hidden, rows_total))
        self.seeds = self._next_seeds(out, seed_of, pending)

    def _target_ids(self, rows: int) -> torch.Tensor:
        """The step's input ids as the target read them (its drafts written in)."""
        return self.target.buffers.input_ids[:rows]

    def _catch_up(self, sched: SchedulerOutput, ids: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
        """The head over the step's own layout (the target's positions and slots), fed `ids`."""
        runner = self.runner
        # (ids are written after the build; its PLACEHOLDER feeds, if any, read what the target's did)
        runner.builder.last_sampled = self.target.builder.last_sampled
        step = runner.prepare(sched)
        runner.buffers.input_ids[: ids.shape[0]].copy_(ids)
        self.head.hidden_in[: features.shape[0]].copy_(features)
        self.num_forwards += 1
        if runner.graph_runner is not None and runner.graph_runner.can_replay(step):
            return runner.graph_runner.replay(step)[0]
        return runner.run_model(step)

    def _next_seeds(self, out: torch.Tensor, seed_of: dict[int, int], pending: PendingStep) -> _Seeds:
        """Each sampling sequence's last kept row of the catch-up: a verify sequence's is row
        `accepted` (drafts equal to their row's sampled token, counted on the device)."""
        device = out.device
        proposal = pending.proposal
        ids, rows = list(seed_of), list(seed_of.values())
        picked = [out.index_select(0, _index(rows, device))] if rows else []
        if proposal is not None and proposal.seqs:  # (pending.verify: the same sequences, in order)
            assert pending.verify is not None  # (verify_outcome of these sequences, set when the step was sampled)
            first = upload([v.first_row for v in proposal.seqs], torch.int64, device)
            picked.append(out.index_select(0, first + pending.verify.accepted))
            ids.extend(v.record.seq_id for v in proposal.seqs)
        hidden = torch.cat(picked) if picked else out[:0]
        return _Seeds(hidden, {seq_id: m for m, seq_id in enumerate(ids)})


def _index(rows: list[int], device: torch.device) -> torch.Tensor:
    return upload(rows, torch.int64, device)
