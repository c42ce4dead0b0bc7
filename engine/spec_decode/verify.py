"""A verify step's outcome on the device: how many drafts each sequence kept, found by comparing
its sampled tokens with its drafts, with no host round trip.

The scheduler advances a verifying sequence as if every draft will be kept (engine/core/sched/
spec/decoder.py `launched`), so a step scheduled while this one is in flight places the
sequence's next token at the worst-case position. That step reads from here which sampled row
continues the sequence (`feed_rows`: row `accepted` of its verify rows) and how far its
positions move back (`shift` = accepted - k <= 0); the step builder applies both on the device
(engine/worker/step_builder.py), for the target and for a draft model's or head's forwards alike.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.core.sched.scheduler_output import SchedulerOutput, sample_row_ranges
from engine.worker.host_upload import upload


@dataclass
class VerifyOutcome:
    index: dict[int, int]  # seq id -> its place in the tensors below
    accepted: torch.Tensor  # int64 [n]: drafts kept
    feed_rows: torch.Tensor  # int64 [n]: the step's sampled row each sequence continues with
    shift: torch.Tensor  # int64 [n]: accepted - k, how far a worst-case position moves back


def verify_outcome(sched: SchedulerOutput, sampled: torch.Tensor, proposal=None) -> VerifyOutcome | None:
    """The outcome of the step's verify records (None without any). proposal: the launch's device
    drafts (engine/spec_decode/proposal.py), whose sequences are exactly the verify records;
    otherwise the drafts are the records' own (n-gram, known on the host)."""
    records = [(s, rows.start) for s, rows in sample_row_ranges(sched.seqs) if s.verifies]
    if not records:
        return None
    device = sampled.device
    kmax = max(len(s.draft_token_ids) for s, _ in records)
    if proposal is not None and proposal.seqs:
        drafts = proposal.padded(kmax, fill=-3)
    else:
        drafts = upload(
            [s.draft_token_ids + [-3] * (kmax - len(s.draft_token_ids)) for s, _ in records], torch.int64, device
        )
    ks = upload([len(s.draft_token_ids) for s, _ in records], torch.int64, device)
    first = upload([row for _, row in records], torch.int64, device)
    cols = torch.arange(kmax, device=device)
    rows = first[:, None] + torch.minimum(cols[None, :], ks[:, None] - 1)  # (padding repeats the last draft's row)
    agree = (sampled[rows] == drafts).to(torch.int64)
    accepted = agree.cumprod(dim=1).sum(dim=1)
    return VerifyOutcome({s.seq_id: i for i, (s, _) in enumerate(records)}, accepted, first + accepted, accepted - ks)
