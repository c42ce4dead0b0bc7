"""N-gram prompt lookup (vLLM's `"method": "ngram"`): drafts from the sequence's own text.

The proposer looks for the latest earlier occurrence of the sequence's last n tokens
(n from prompt_lookup_max down to prompt_lookup_min) and proposes the tokens that followed
it. The drafts are known on the host when the step is scheduled; the verify step samples every
position as an ordinary row and the scheduler keeps the drafts up to the first one the model did
not sample (engine/spec_decode/sched/decoder.py). The drafts are deterministic, so "sample, then
keep the draft if equal" is exactly speculative sampling with a one-hot q.

Search: the token ids as int32 bytes and `bytes.rfind` (C speed, no per-step numpy
conversion of the whole list: the bytes grow with the sequence).

Back-off: a verify step costs more than a plain decode step (more tokens, and on a GPU no
decode graph), so a sequence whose drafts were all rejected gets none for the next 2, 4, ...
up to MAX_SKIP steps; one accepted draft resets it.
"""

from __future__ import annotations

import array
import weakref

from engine.core.request import Sequence
from engine.spec_decode.sched.config import SpecDecodeConfig

MAX_SKIP = 32


class _SeqState:
    """A sequence's token ids as a growing int32 array (appended to, never rebuilt), and its back-off."""

    __slots__ = ("ids", "misses", "skip")

    def __init__(self) -> None:
        self.ids = array.array("i")
        self.misses = 0
        self.skip = 0

    def sync(self, tokens: list[int]) -> bytes:
        if len(self.ids) > len(tokens):  # (never expected: tokens are only appended)
            del self.ids[len(tokens) :]
        self.ids.extend(tokens[len(self.ids) :])
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

    def feedback(self, seq: Sequence, num_accepted: int, num_proposed: int) -> None:
        """How many of seq's num_proposed drafts the model kept this step (0: back off)."""
        state = self._state.get(seq)
        if state is None:
            return
        if num_accepted:
            state.misses = 0
        else:
            state.misses += 1
            state.skip = min(2**state.misses, MAX_SKIP)


def find_draft(data: bytes, length: int, k: int, n_min: int, n_max: int) -> list[int]:
    """data: `length` int32 token ids. The k (or fewer) tokens after the latest earlier match of
    the last n tokens, for the largest n in [n_min, n_max] that matches."""
    width = 4
    for n in range(min(n_max, length - 1), n_min - 1, -1):
        pattern = data[(length - n) * width :]
        limit = (length - 1) * width  # tokens i..i+n-1 of a match end before the last token
        while (at := data.rfind(pattern, 0, limit)) >= 0:
            if at % width == 0:
                start = at // width + n
                return list(array.array("i", data[start * width : (start + k) * width]))
            limit = at + len(pattern) - 1  # straddles token boundaries: look further back
    return []
