"""What a device proposer (draft model, EAGLE head) hands the verify step, and how its drafts
get into the target's inputs, the sampler and the step's records.

A step's sequences with DRAFT markers (engine/spec_decode/sched/config.py) were scheduled as
[last token, DRAFT x k] at positions start..start+k: the proposer fills the k drafts on the
device before the target's forward (`write_inputs`), the sampler verifies rows whose request
samples without a seed against the draft's q (`draft_probs`), and the drafts reach the host with
the step's results (`drafts_by_seq`, in the runner's output), where the core keeps the accepted
prefix.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property

import torch

from engine.core.sched.scheduler_output import ScheduledSeq, SchedulerOutput, sample_row_ranges
from engine.spec_decode.rejection import DraftProbs, DraftRow
from engine.spec_decode.sched.config import DRAFT
from engine.worker.host_upload import upload
from engine.worker.input_buffers import InputBuffers
from engine.worker.sample.sampler import SampleRow
from engine.worker.sample.sampler_output import HostCopy

# Host staging slots of a proposer's runner: it queues k + 1 forwards a step, and with one set of
# staging the host would wait for each before building the next (engine/worker/input_buffers.py).
STAGING_SLOTS = 8


@dataclass
class VerifySeq:
    """One sequence's verify share of the step: k device drafts after its last token."""

    index: int  # in sched.seqs
    record: ScheduledSeq
    k: int
    first_row: int  # its first token's row in the step's flat input
    first_sample: int  # its first sampler row
    num_output_tokens: int  # output tokens before the one row 0 samples

    @cached_property
    def draft_rows(self) -> list[DraftRow]:
        """Draft j is the candidate for the token verify row j samples (same output position)."""
        p = self.record.params
        return [DraftRow(p, self.record.sample_index, self.num_output_tokens + j) for j in range(self.k)]


def verify_seqs(sched: SchedulerOutput) -> list[VerifySeq]:
    """The step's sequences whose drafts a device proposer fills, with their rows."""
    out: list[VerifySeq] = []
    row = 0
    for i, (s, rows) in enumerate(sample_row_ranges(sched.seqs)):
        drafts = s.draft_token_ids
        if drafts and drafts[0] == DRAFT:
            last = s.start_pos + s.num_tokens - len(drafts)  # tokens before the drafts
            out.append(VerifySeq(i, s, len(drafts), row, rows.start, last - s.num_prompt_tokens))
        row += s.num_tokens
    return out


@dataclass
class Proposal:
    """A launch's device drafts: tokens[j] [n_j] are draft j of the verify sequences that have at
    least j + 1 drafts (in step order); q[j] their draft distributions (None where unused)."""

    seqs: list[VerifySeq]
    tokens: list[torch.Tensor] = field(default_factory=list)
    q: list[torch.Tensor | None] = field(default_factory=list)
    _host: HostCopy | None = None

    def members(self, j: int) -> list[VerifySeq]:
        return [v for v in self.seqs if v.k > j]

    def flat(self) -> torch.Tensor:
        """Every draft, sequence by sequence ([v0's k0 drafts, v1's k1, ...])."""
        order: list[tuple[int, int]] = []  # (flat position of draft j of each member), column by column
        for j in range(len(self.tokens)):
            order.extend((at, j) for at, v in enumerate(self.seqs) if v.k > j)
        by_seq = sorted(range(len(order)), key=lambda i: order[i])
        flat = torch.cat(self.tokens) if self.tokens else torch.zeros(0, dtype=torch.int64)
        return flat[upload(by_seq, torch.int64, flat.device)]

    def padded(self, width: int, fill: int) -> torch.Tensor:
        """[sequences, width]: each verify sequence's drafts, then `fill`."""
        flat = self.flat()
        places: list[list[int]] = []
        at = 0
        for v in self.seqs:
            places.append([at + j if j < v.k else -1 for j in range(width)])
            at += v.k
        index = upload(places, torch.int64, flat.device)
        padded = torch.cat([flat, flat.new_full((1,), fill)])
        return padded[index]

    def write_inputs(self, buffers: InputBuffers) -> None:
        """The drafts into the target's input ids (rows after each sequence's last token)."""
        rows = [v.first_row + 1 + j for v in self.seqs for j in range(v.k)]
        if not rows:
            return
        flat = self.flat()
        index = upload(rows, torch.int64, buffers.device)
        buffers.input_ids.index_copy_(0, index, flat.to(buffers.input_ids.dtype))
        self._host = HostCopy(flat, owned=True)

    def host_drafts(self) -> list[list[int]]:
        """Each verify sequence's drafts on the host (waits for the copy)."""
        flat = self._host.tolist() if self._host is not None else []
        out, at = [], 0
        for v in self.seqs:
            out.append(flat[at : at + v.k])
            at += v.k
        return out

    def draft_probs(self, device: torch.device) -> DraftProbs | None:
        """The sampler rows verified against q: drafts of random requests without a seed."""
        rows: list[int] = []
        tokens: list[torch.Tensor] = []
        qs: list[torch.Tensor] = []
        for j, q in enumerate(self.q):
            if q is None:
                continue
            members = self.members(j)
            pick = [m for m, v in enumerate(members) if v.draft_rows[0].uses_q]
            if not pick:
                continue
            rows.extend(members[m].first_sample + j for m in pick)
            index = upload(pick, torch.int64, device)
            tokens.append(self.tokens[j].index_select(0, index))
            qs.append(q.index_select(0, index))
        if not rows:
            return None
        return DraftProbs(upload(rows, torch.int64, device), torch.cat(tokens), torch.cat(qs))

    def patch_rows(self, rows: list[SampleRow]) -> None:
        """Rows whose sampling reads their history on the host (penalties, logits processors) get
        the drafts before them as values (a host copy of the drafts: a wait on a GPU)."""
        needy = [v for v in self.seqs if v.record.params.needs_penalties or v.record.params.logits_processors]
        if not needy:
            return
        drafts = dict(zip((v.index for v in self.seqs), self.host_drafts()))
        for v in needy:
            for j in range(1, v.k + 1):
                rows[v.first_sample + j].extra = drafts[v.index][:j]

    def drafts_by_seq(self) -> dict[int, list[int]]:
        """seq id -> its drafts, for the runner's output (the core compares them with the sampled
        tokens; the step's message keeps its markers)."""
        return {v.record.seq_id: drafts for v, drafts in zip(self.seqs, self.host_drafts())}
