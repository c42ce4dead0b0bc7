"""SpecDecoder: draft limits and draft acceptance for the scheduler, with their counters.

The scheduler asks it for a decoding sequence's drafts (within the token budget, max_model_len
and max_tokens; none for constrained requests) and hands it each verify step's sampled tokens;
it keeps the accepted prefix, advances the sequence, gives back the blocks only the rejected
drafts reached (`KVAllocator.trim`) and keeps the counters the metrics read (drafts, accepted
tokens, accepted tokens per draft position as vLLM's spec_decode_num_accepted_tokens_per_pos).

Drafts come from a proposer: n-gram lookup (engine/core/sched/spec/ngram.py, values known when
scheduled) or a draft model / EAGLE head run on the device inside the step's launch
(engine/core/sched/spec/draft_length.py decides how many; the step's records get their values
with its results). Either way the rule is the same (`accepted_prefix`): the sampler gave each
verified position a token that equals its draft exactly when the draft is accepted
(engine/worker/sample/rejection.py), so the drafts up to the first mismatch are kept, plus the
token sampled there (or after the last draft).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

from engine.core.request import Sequence
from engine.core.sched.spec.config import SpecDecodeConfig

if TYPE_CHECKING:
    from engine.core.kv.allocator import KVAllocator


class Proposer(Protocol):
    config: SpecDecodeConfig

    def propose(self, seq: Sequence, max_drafts: int) -> list[int]: ...

    def feedback(self, seq: Sequence, num_accepted: int, num_proposed: int) -> None: ...


def accepted_prefix(drafts: list[int], sampled: list[int]) -> int:
    """How many drafts are kept: those before the first position whose sampled token differs."""
    accepted = 0
    while accepted < len(drafts) and sampled[accepted] == drafts[accepted]:
        accepted += 1
    return accepted


class SpecDecoder:
    """Draft proposal limits and draft acceptance for the scheduler, with their counters."""

    def __init__(self, proposer: Proposer, max_model_len: int) -> None:
        self.proposer = proposer
        self.max_model_len = max_model_len
        k = proposer.config.num_speculative_tokens
        self.num_draft_tokens = 0
        self.num_drafts = 0  # (sequence, step) pairs that had drafts
        self.num_accepted_tokens = 0
        self.num_accepted_per_pos = [0] * k  # drafts kept at position i (0: the first draft)
        self.num_drafts_per_pos = [0] * k  # drafts proposed at position i

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
        room = min(budget - 1, self.max_model_len - seq.num_tokens - 1)
        if request.params.max_tokens is not None:
            room = min(room, request.params.max_tokens - seq.num_output_tokens - 1)
        return self.proposer.propose(seq, room) if room > 0 else []

    def accept(self, seq: Sequence, drafts: list[int], sampled: list[int], kv: KVAllocator) -> None:
        """Keep the drafts up to the first the model did not sample, plus the model's token there
        (or after the last draft). KV is valid for the last token and the kept drafts; the blocks
        only rejected drafts reached are freed, and the rest of what they wrote lies beyond
        num_computed_tokens, to be overwritten."""
        accepted = accepted_prefix(drafts, sampled)
        seq.token_ids.extend(sampled[:accepted + 1])
        seq.num_new_tokens = accepted + 1
        seq.num_computed_tokens += 1 + accepted
        kv.cache_full_blocks(seq)
        kv.trim(seq)
        self.num_draft_tokens += len(drafts)
        self.num_drafts += bool(drafts)
        self.num_accepted_tokens += accepted
        for i in range(len(drafts)):
            self.num_drafts_per_pos[i] += 1
        for i in range(accepted):
            self.num_accepted_per_pos[i] += 1
        self.proposer.feedback(seq, accepted, len(drafts))
