"""How many drafts each sequence gets from a draft model or an EAGLE head, step by step.

A draft position costs a draft forward (and one more verified token); it pays only if it is
likely to be kept. Each sequence keeps an estimate of alpha, the chance that a draft is
accepted given the ones before it were: the number of drafts kept before the first rejection
is geometric, so with decayed counts of kept drafts (A) and of rejections (F) the estimate is
A / (A + F) (a step whose drafts were all kept is censored: it adds no rejection). Before each
step the sequence gets the k in 0..num_speculative_tokens that maximises the expected tokens
per unit of cost,

    (1 + alpha + alpha^2 + ... + alpha^k) / (1 + draft_cost * k),

so a sequence the draft follows well drafts deep, one it follows badly drafts one token or
none. With none, it sits out 2, 4, ... up to MAX_SKIP steps and then probes with one draft,
which feeds the estimate again. State is kept per sequence and goes with it.
"""

from __future__ import annotations

import weakref

from engine.core.request import Sequence
from engine.spec_decode.sched.config import DRAFT, SpecDecodeConfig

DECAY = 0.7  # weight of the past in the counts: about the last 3 steps count
PRIOR_KEPT, PRIOR_REJECTED = 2.0, 1.0  # a new sequence starts at alpha = 2/3
MAX_SKIP = 32


class _Length:
    __slots__ = ("kept", "rejected", "misses", "skip")

    def __init__(self) -> None:
        self.kept = PRIOR_KEPT
        self.rejected = PRIOR_REJECTED
        self.misses = 0
        self.skip = 0

    @property
    def alpha(self) -> float:
        return self.kept / (self.kept + self.rejected)


def best_length(alpha: float, k_max: int, draft_cost: float) -> int:
    """The k in 0..k_max with the most expected tokens per unit of cost (see the module doc)."""
    best, best_value = 0, 1.0
    tokens, power = 1.0, 1.0
    for k in range(1, k_max + 1):
        power *= alpha
        tokens += power
        value = tokens / (1.0 + draft_cost * k)
        if value > best_value + 1e-9:
            best, best_value = k, value
    return best


class DraftLengthPlanner:
    """Drafts of a device proposer (draft model, EAGLE): DRAFT markers, as many as pay."""

    def __init__(self, config: SpecDecodeConfig) -> None:
        self.config = config
        self._state: weakref.WeakKeyDictionary[Sequence, _Length] = weakref.WeakKeyDictionary()

    def length(self, seq: Sequence) -> int:
        state = self._state.get(seq)
        if state is None:
            state = self._state[seq] = _Length()
        if state.skip > 0:
            state.skip -= 1
            return 1 if state.skip == 0 else 0  # (the last skipped step probes with one draft)
        return best_length(state.alpha, self.config.num_speculative_tokens, self.config.draft_cost)

    def propose(self, seq: Sequence, max_drafts: int) -> list[int]:
        k = min(self.length(seq), max_drafts)
        return [DRAFT] * k if k > 0 else []

    def feedback(self, seq: Sequence, num_accepted: int, num_proposed: int) -> None:
        state = self._state.get(seq)
        if state is None or num_proposed == 0:
            return
        state.kept = DECAY * state.kept + num_accepted
        state.rejected = DECAY * state.rejected + (num_accepted < num_proposed)
        if best_length(state.alpha, self.config.num_speculative_tokens, self.config.draft_cost) == 0:
            state.misses += 1
            state.skip = min(2**state.misses, MAX_SKIP)
        else:
            state.misses = 0
