"""Speculative decoding with n-gram prompt lookup (vLLM's `"method": "ngram"`).

The proposer looks for the latest earlier occurrence of the sequence's last n tokens
(n from prompt_lookup_max down to prompt_lookup_min) and proposes the tokens that followed
it. The scheduler runs the sequence's last token plus the drafts as one chunk; the sampler
samples every position as an ordinary row (each with its own history: penalties, seeds and
logprobs stay exact), and the scheduler keeps the drafts up to the first one the model did
not sample, plus the model's token after them. With a one-token draft, "sample, then accept
if equal" is exactly speculative rejection sampling, so outputs keep the model's
distribution; greedy and seeded outputs equal those of plain decoding.

Search: the token ids as int32 bytes and `bytes.rfind` (C speed, no per-step numpy
conversion of the whole list: the bytes grow with the sequence).

Verification (`SpecDecoder`): the scheduler asks it for a decoding sequence's drafts (within
the token budget, max_model_len and max_tokens; none for constrained requests) and hands it
each verify step's sampled tokens; it keeps the accepted prefix, advances the sequence, gives
back the blocks only the rejected drafts reached (`KVAllocator.trim`) and keeps the counters
the metrics read.

Back-off: a verify step costs more than a plain decode step (more tokens, and on a GPU no
decode graph), so a sequence whose drafts were all rejected gets none for the next 2, 4, ...
up to MAX_SKIP steps; one accepted draft resets it.
"""

from __future__ import annotations

import array
import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING

from engine.core.request import Sequence

if TYPE_CHECKING:
    from engine.core.kv.allocator import KVAllocator

MAX_SKIP = 32


@dataclass(frozen=True)
class SpecDecodeConfig:
    num_speculative_tokens: int
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 2


class _SeqState:
    """A sequence's token ids as a growing int32 array (appended to, never rebuilt), and its back-off."""

    __slots__ = ("ids", "misses", "skip")

    def __init__(self) -> None:
        self.ids = array.array("i")
        self.misses = 0
        self.skip = 0

    def sync(self, tokens: list[int]) -> bytes:
        if len(self.ids) > len(tokens):  # (never expected: tokens are only appended)
            del self.ids[len(tokens):]
        self.ids.extend(tokens[len(self.ids):])
        return self.ids.tobytes()


class NgramProposer:
    def __init__(self, config: SpecDecodeConfig) -> None:
        self.config = config
        self._state: weakref.WeakKeyDictionary[Sequence, _SeqState] = weakref.WeakKeyDictionary()

    def propose(self, seq: Sequence, max_drafts: int) -> list[int]:
        """Up to min(num_speculative_tokens, max_drafts) draft tokens for seq ([] if no n-gram matches)."""
        k = min(self.config.num_speculative_tokens, max_drafts)
        tokens = seq.token_ids
        if k <= 0 or len(tokens) < self.config.prompt_lookup_min + 1:
            return []
        state = self._state.get(seq)
        if state is None:
            state = self._state[seq] = _SeqState()
        if state.skip > 0:
            state.skip -= 1
            return []
        data = state.sync(tokens)
        return find_draft(data, len(tokens), k, self.config.prompt_lookup_min, self.config.prompt_lookup_max)

    def feedback(self, seq: Sequence, num_accepted: int) -> None:
        """How many of seq's drafts the model kept this step (0: back off)."""
        state = self._state.get(seq)
        if state is None:
            return
        if num_accepted:
            state.misses = 0
        else:
            state.misses += 1
            state.skip = min(2 ** state.misses, MAX_SKIP)


def find_draft(data: bytes, length: int, k: int, n_min: int, n_max: int) -> list[int]:
    """data: `length` int32 token ids. The k (or fewer) tokens after the latest earlier match of
    the last n tokens, for the largest n in [n_min, n_max] that matches."""
    width = 4
    for n in range(min(n_max, length - 1), n_min - 1, -1):
        pattern = data[(length - n) * width:]
        limit = (length - 1) * width  # tokens i..i+n-1 of a match end before the last token
        while (at := data.rfind(pattern, 0, limit)) >= 0:
            if at % width == 0:
                start = at // width + n
                return list(array.array("i", data[start * width:(start + k) * width]))
            limit = at + len(pattern) - 1  # straddles token boundaries: look further back
    return []


class SpecDecoder:
    """Draft proposal limits and draft acceptance for the scheduler, with their counters."""

    def __init__(self, proposer: NgramProposer, max_model_len: int) -> None:
        self.proposer = proposer
        self.max_model_len = max_model_len
        self.num_draft_tokens = 0
        self.num_drafts = 0  # (sequence, step) pairs that had drafts
        self.num_accepted_tokens = 0

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
        accepted = 0
        while accepted < len(drafts) and sampled[accepted] == drafts[accepted]:
            accepted += 1
        seq.token_ids.extend(sampled[:accepted + 1])
        seq.num_new_tokens = accepted + 1
        seq.num_computed_tokens += 1 + accepted
        kv.cache_full_blocks(seq)
        kv.trim(seq)
        self.num_draft_tokens += len(drafts)
        self.num_drafts += bool(drafts)
        self.num_accepted_tokens += accepted
        self.proposer.feedback(seq, accepted)
