"""A draft model (vLLM's `"method": "draft_model"`): a small model with the target's tokenizer,
its own paged KV in the target's block tables, run inside each step's launch.

Its KV blocks are the target's block ids in a second cache tensor of the draft's own shape
(engine/runtime/builder.py): whatever the scheduler does with a sequence's blocks (allocate,
share, copy on write, swap, cache a full prefix block, free) it does for both. To keep the
draft's KV valid exactly where the target's is, the draft sees every token the target
computes, at the same positions and slots:

  forward 0   the step's tokens without its drafts (prefill chunks, decodes, each verify
              sequence's last token), as one step of the draft model; each verify sequence's
              last row gives draft 1;
  forward j   (j = 1..k) one row per verify sequence with at least j drafts: draft j at
              position start + j, which gives draft j + 1. Forward k only writes draft k's KV
              (the target keeps it when every draft is accepted), so its rows need no logits.

Forwards 1..k are decode-shaped: on a GPU they replay the draft's decode CUDA graphs (as does
forward 0 of a step of decodes). Drafts are sampled from the draft's processed distribution q
(engine/spec_decode/rejection.py), in the target's vocabulary.
"""

from __future__ import annotations

import dataclasses
from typing import Protocol, cast

import torch

from engine.core.sched.scheduler_output import PLACEHOLDER, ScheduledSeq, SchedulerOutput
from engine.spec_decode.proposal import STAGING_SLOTS, Proposal, VerifySeq, verify_seqs
from engine.spec_decode.rejection import sample_drafts
from engine.worker.host_upload import upload
from engine.worker.model_runner import ModelRunner, PendingStep
from engine.worker.sample.sampler_output import LastSampled
from engine.worker.step_builder import StepBuilder


class _DraftLM(Protocol):
    """What the proposer calls of its draft model (engine/models/llama.py LlamaForCausalLM; the
    runner holds it as a plain nn.Module)."""

    def compute_logits(self, hidden: torch.Tensor, head: torch.Tensor | None = None) -> torch.Tensor: ...

    def head_rows(self, ids: torch.Tensor) -> torch.Tensor: ...


def to_vocab(logits: torch.Tensor, vocab: int) -> torch.Tensor:
    """A draft's logits over the target's vocabulary: ids the draft lacks get -inf, ids the
    target lacks are dropped."""
    have = logits.shape[1]
    if have == vocab:
        return logits
    if have > vocab:
        return logits[:, :vocab]
    return torch.nn.functional.pad(logits, (0, vocab - have), value=-float("inf"))


def from_draft_vocab(logits: torch.Tensor, ids: torch.Tensor, vocab: int) -> torch.Tensor:
    """Logits over a draft vocabulary (columns = token ids `ids`) as logits over the target's
    vocabulary: -inf (probability 0) everywhere else."""
    out = logits.new_full((logits.shape[0], vocab), -float("inf"))
    out[:, ids] = logits
    return out


class DraftModelProposer:
    def __init__(
        self, runner: ModelRunner, target_vocab: int, generator: torch.Generator, vocab_ids: torch.Tensor | None = None
    ) -> None:
        self.runner = runner  # the draft model's runner: its own buffers, cache tensor, graphs
        runner.hidden_only = True  # (its graphs stop at the hidden states: logits are computed here, once)
        runner.buffers.use_staging_ring(STAGING_SLOTS)
        self.vocab = target_vocab
        self.generator = generator  # the target sampler's: one random stream for the engine
        self.num_forwards = 0
        # a draft vocabulary (engine/models/draft.py): the LM head's rows of those ids only
        self.vocab_ids = None if vocab_ids is None else vocab_ids.to(runner.device)
        model = cast(_DraftLM, runner.model)
        self.head = None if self.vocab_ids is None else model.head_rows(self.vocab_ids)

    def propose(self, sched: SchedulerOutput, target: StepBuilder) -> Proposal | None:
        """Run the draft over the step (forward 0) and draft each verify sequence's tokens."""
        verify = verify_seqs(sched)
        shadow, last_rows = self._shadow(sched, verify)
        if self.runner.builder.states is not target.states:  # (one copy of each sequence per worker)
            self.runner.builder.share_states(target)
        # The step's PLACEHOLDER tokens (overlap scheduling) are fed from the target's last step.
        self.runner.builder.last_sampled = target.last_sampled
        hidden = self._forward(
            SchedulerOutput(
                seqs=shadow,
                dropped_seqs=sched.dropped_seqs,
                num_prefill_tokens=sched.num_prefill_tokens,
                num_decode_tokens=sum(s.num_tokens for s in shadow) - sched.num_prefill_tokens,
            )
        )
        if not verify:
            return None
        proposal = Proposal(verify)
        rows = upload(last_rows, torch.int64, hidden.device)
        self._sample(proposal, 0, hidden.index_select(0, rows))
        for j in range(1, max(v.k for v in verify) + 1):
            members = proposal.members(j - 1)  # those that drafted token j: it is fed now
            fed = [
                dataclasses.replace(shadow[v.index], token_ids=[PLACEHOLDER], start_pos=v.record.start_pos + j)
                for v in members
            ]
            # (row m of draft j's tokens is fed[m]'s: the builder feeds PLACEHOLDER rows from it)
            self.runner.builder.last_sampled = LastSampled(proposal.tokens[j - 1], fed, True)
            hidden = self._forward(SchedulerOutput(seqs=fed, num_decode_tokens=len(fed)))
            want = [m for m, v in enumerate(members) if v.k > j]
            if want:
                pick = upload(want, torch.int64, hidden.device)
                self._sample(proposal, j, hidden[: len(fed)].index_select(0, pick))
        return proposal

    def sampled(self, sched: SchedulerOutput, pending: PendingStep) -> None:
        """(The draft model needs nothing of the target's step once it is sampled.)"""

    def _sample(self, proposal: Proposal, j: int, hidden: torch.Tensor) -> None:
        """Draft j + 1 of every member at position j (rows of `hidden`, in order)."""
        members = proposal.members(j)
        model = cast(_DraftLM, self.runner.model)
        if self.head is None:
            logits = to_vocab(model.compute_logits(hidden), self.vocab)
        else:
            assert self.vocab_ids is not None  # (the head rows are those of the draft vocabulary)
            logits = from_draft_vocab(model.compute_logits(hidden, self.head), self.vocab_ids, self.vocab)
        tokens, q = sample_drafts(logits, [v.draft_rows[j] for v in members], self.generator)
        proposal.tokens.append(tokens)
        proposal.q.append(q if any(v.draft_rows[j].uses_q for v in members) else None)

    def _shadow(self, sched: SchedulerOutput, verify: list[VerifySeq]) -> tuple[list[ScheduledSeq], list[int]]:
        """The step without its drafts, for the draft model (each verify sequence samples its last
        row), and those last rows' places in the flat input."""
        drafted = {v.index: v for v in verify}
        shadow, last_rows, row = [], [], 0
        for i, s in enumerate(sched.seqs):
            v = drafted.get(i)
            if v is None:
                shadow.append(dataclasses.replace(s, do_sample=False, num_samples=1))
                row += s.num_tokens
                continue
            keep = s.num_tokens - v.k
            shadow.append(
                dataclasses.replace(s, token_ids=s.token_ids[:keep], draft_token_ids=[], do_sample=True, num_samples=1)
            )
            row += keep
            last_rows.append(row - 1)
        return shadow, last_rows

    def _forward(self, sched: SchedulerOutput) -> torch.Tensor:
        """One forward of the draft model over a step's records: its final hidden states."""
        self.num_forwards += 1
        runner = self.runner
        step = runner.prepare(sched)
        if runner.graph_runner is not None and runner.graph_runner.can_replay(step):
            hidden, _ = runner.graph_runner.replay(step)
            return hidden
        return runner.run_model(step)
