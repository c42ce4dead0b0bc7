"""SpecDecoder: draft limits and draft acceptance for the scheduler, with their counters.

The scheduler asks it for a decoding sequence's drafts (within the token budget, max_model_len
and max_tokens; none for constrained requests) and hands it each verify step's sampled tokens;
it keeps the accepted prefix, advances the sequence, gives back the blocks only the rejected
drafts reached (`KVAllocator.trim`) and keeps the counters the metrics read (drafts, accepted
tokens, accepted tokens per draft position as vLLM's spec_decode_num_accepted_tokens_per_pos).

Drafts come from a proposer: n-gram lookup (engine/spec_decode/sched/ngram.py, values known when
scheduled) or a draft model / EAGLE head run on the device inside the step's launch
(engine/spec_decode/sched/draft_length.py decides how many; the step's records get their values
with its results). Either way the rule is the same (`accepted_prefix`): the sampler gave each
verified position a token that equals its draft exactly when the draft is accepted
(engine/spec_decode/rejection.py), so the drafts up to the first mismatch are kept, plus the
token sampled there (or after the last draft).
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING, Protocol

from engine.core.request import SeqStatus, Sequence
from engine.core.sched.scheduler_output import PLACEHOLDER, ScheduledSeq
from engine.spec_decode.sched.config import DRAFT, SpecDecodeConfig

if TYPE_CHECKING:
    from engine.core.kv.allocator import KVAllocator


class Proposer(Protocol):
    config: SpecDecodeConfig

    def propose(self, seq: Sequence, max_drafts: int) -> list[int]: ...

    def feedback(self, seq: Sequence, num_accepted: int, num_proposed: int) -> None: ...


def verify_overlaps(s: ScheduledSeq) -> bool:
    """A verify step of this record may overlap the next step's scheduling: its drafts are a
    device proposer's (n-gram lookup needs the tokens on the host) and its sampling reads
    neither the history nor the output position on the host (a seed, penalties, logits
    processors, min_tokens), which the next step would see only as the worst case."""
    if not s.verifies or s.draft_token_ids[0] != DRAFT:
        return False
    p = s.params
    return p.seed is None and not p.needs_penalties and not p.logits_processors and p.min_tokens == 0


def accepted_prefix(drafts: list[int], sampled: list[int]) -> int:
    """How many drafts are kept: those before the first position whose sampled token differs."""
    accepted = 0
    while accepted < len(drafts) and sampled[accepted] == drafts[accepted]:
        accepted += 1
    return accepted


class SpecDecoder:
    """Draft proposal limits and draft acceptance for the scheduler, with their counters (what the
    core asks for is engine/core/sched/drafts.py's Drafts; the runtime builder makes this one)."""

    def __init__(self, proposer: Proposer, max_model_len: int) -> None:
        self.proposer = proposer
        self.max_model_len = max_model_len
        k = proposer.config.num_speculative_tokens
        self.num_draft_tokens = 0
        self.num_drafts = 0  # (sequence, step) pairs that had drafts
        self.num_accepted_tokens = 0
        self.num_accepted_per_pos = [0] * k  # drafts kept at position i (0: the first draft)
        self.num_drafts_per_pos = [0] * k  # drafts proposed at position i
        # Verify steps launched and not yet processed, per sequence (two at most: one in flight
        # while the next is launched).
        self._verifying: weakref.WeakKeyDictionary[Sequence, int] = weakref.WeakKeyDictionary()

    @property
    def device_drafts(self) -> bool:
        return self.proposer.config.device_drafts

    def drafts(self, seq: Sequence, budget: int) -> list[int]:
        """Draft tokens for a decoding sequence ([] when not applicable). They stay within the
        token budget, max_model_len and the request's max_tokens (the step adds up to
        len(drafts) + 1 tokens); constrained requests get none."""
        request = seq.request
        if request.grammars or seq.num_computed_tokens < seq.num_prompt_tokens:
            return []
        if seq.num_pending and not self.device_drafts:
            return []  # (n-gram lookup reads the tokens: a launched step's are not known yet)
        room = min(budget - 1, self.max_model_len - seq.num_tokens - 1)
        if request.params.max_tokens is not None:
            room = min(room, request.params.max_tokens - seq.num_output_tokens - 1)
        return self.proposer.propose(seq, room) if room > 0 else []

    def launched(self, seq: Sequence, k: int) -> None:
        """A verify step of k drafts is on the device: the sequence advances as if every draft and
        the token after them will be kept (placeholders), so that its next step can be scheduled
        before this one's results are on the host; the device shifts that next step's positions
        by what was really kept (engine/spec_decode/verify.py)."""
        seq.token_ids.extend([PLACEHOLDER] * (k + 1))
        seq.num_pending += k + 1
        seq.num_computed_tokens += k + 1
        self._verifying[seq] = self._verifying.get(seq, 0) + 1

    def verifying(self, seq: Sequence) -> bool:
        """seq's verify step is in flight: its state is the worst case (every draft kept)."""
        return seq in self._verifying

    def accept_launched(self, seq: Sequence, drafts: list[int], sampled: list[int], kv: KVAllocator) -> None:
        """A launched verify step's results: keep the drafts up to the first the model did not
        sample, plus the model's token there (or after the last draft), in place of the step's
        placeholders (a later step's stay after them); the computed count drops by the rejected
        drafts. KV is valid for the last token and the kept drafts; the blocks only rejected drafts
        reached are freed, and the rest of what they wrote lies beyond num_computed_tokens, to be
        overwritten (the next step, if already launched, was moved back onto them)."""
        k = len(drafts)
        accepted = accepted_prefix(drafts, sampled)
        left = self._verifying.pop(seq, 1) - 1
        if left:
            self._verifying[seq] = left
        ids = seq.token_ids
        first = len(ids) - seq.num_pending  # (this step's placeholders come first among the pending)
        ids[first : first + k + 1] = sampled[: accepted + 1]
        seq.num_pending -= k + 1
        seq.num_new_tokens = accepted + 1
        if seq.status is not SeqStatus.WAITING:  # (one preempted for recompute meanwhile has none left)
            seq.num_computed_tokens -= k - accepted
        if seq.status is SeqStatus.RUNNING:
            kv.cache_full_blocks(seq)
            kv.trim(seq)
        self.num_draft_tokens += k
        self.num_drafts += 1
        self.num_accepted_tokens += accepted
        for i in range(k):
            self.num_drafts_per_pos[i] += 1
        for i in range(accepted):
            self.num_accepted_per_pos[i] += 1
        self.proposer.feedback(seq, accepted, k)
