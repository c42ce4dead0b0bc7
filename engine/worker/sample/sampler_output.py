"""A step's sampled tokens after the sampler: still on the device for the next step's inputs
(`LastSampled`), on their way to the host (`HostCopy`, `PendingSample`), and as the host sees them
(`SamplerOutput`, engine/core/outputs.py). Logprobs travel packed (engine/worker/sample/logprobs.py).
"""

from __future__ import annotations

from typing import Any

import torch

from engine.core.outputs import SamplerOutput
from engine.core.sched.scheduler_output import ScheduledSeq, sample_row_ranges
from engine.worker.sample.logprobs import unpack_chosen_and_top


class LastSampled:
    """A launched step's sampled tokens, still on the device, and which row of them each
    one-token sequence's is: the next step's PLACEHOLDERs (its input ids, penalty counts) read
    them from there, with no host round trip. The seq id -> row map is built only when asked
    (a steady decode batch needs only its order), so remembering a step costs nothing per row."""

    __slots__ = ("tokens", "_seqs", "_decode", "_rows", "verify")

    def __init__(
        self, tokens: torch.Tensor, seqs: list[ScheduledSeq] | None = None, decode: bool = False, verify: Any = None
    ) -> None:
        self.tokens = tokens
        self._seqs = seqs or []  # (read only while the step is in flight: its records are not reused yet)
        self._decode = decode  # seqs[i] sampled row i (one token per sequence, each sampled once)
        self._rows: dict[int, int] | None = None
        # A verify step's outcome on the device (engine/spec_decode/verify.py VerifyOutcome): which
        # row continues each verifying sequence, and how far its next positions move back.
        self.verify = verify

    def leads_with(self, seq_ids: list[int]) -> bool:
        """seq_ids sampled rows 0..len(seq_ids)-1, in this order (a steady decode batch)."""
        seqs = self._seqs
        k = len(seq_ids)
        return self._decode and k <= len(seqs) and [s.seq_id for s in seqs[:k]] == seq_ids

    def rows_of(self, seq_ids: list[int]) -> list[int]:
        """The row of each of these sequences' sampled token (KeyError: it sampled none here)."""
        rows = self._rows
        if rows is None:
            if self._decode:
                rows = {s.seq_id: i for i, s in enumerate(self._seqs)}
            else:
                rows = {s.seq_id: r.start for s, r in sample_row_ranges(self._seqs) if len(r) == 1}
            self._rows = rows
        return [rows[i] for i in seq_ids]


class HostCopy:
    """A device tensor's copy to the host, started without blocking (pinned memory + an event).
    owned: t is a fresh tensor nobody else writes (not a graph's static buffer), so on the CPU it
    is kept as it is instead of cloned."""

    def __init__(self, t: torch.Tensor, owned: bool = False) -> None:
        if t.device.type == "cuda":
            self.host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            self.host.copy_(t, non_blocking=True)
            self.event = torch.cuda.Event()
            self.event.record()
        else:  # (a copy unless owned: t may be a graph's static buffer that the next step overwrites)
            self.host, self.event = (t if owned else t.clone()), None

    def tolist(self) -> list:
        if self.event is not None:
            self.event.synchronize()
        return self.host.tolist()


class PendingSample:
    """Tokens sampled on the device (`tokens`, -1 in failed rows) on their way to the host."""

    def __init__(
        self,
        tokens: torch.Tensor,
        copy: HostCopy | None,
        errors: dict[int, str],
        want_logprobs: list[int | None] | None = None,
        top_n: int = 0,
    ) -> None:
        self.tokens = tokens
        self._copy = copy
        self._errors = errors
        self._want = want_logprobs
        self._top_n = top_n

    @classmethod
    def empty(cls, device: torch.device) -> "PendingSample":
        return cls(torch.zeros(0, dtype=torch.int64, device=device), None, {})

    def result(self) -> SamplerOutput:
        if self._copy is None:
            return SamplerOutput([], [])
        if self._want is None:
            out = SamplerOutput(self._copy.tolist(), [None] * len(self.tokens))
        else:
            ids, chosen, vals, top_ids = unpack_chosen_and_top(self._copy.tolist(), self._top_n)
            out = SamplerOutput(
                ids,
                [
                    None if n is None else (chosen[i], {top_ids[i][j]: vals[i][j] for j in range(n)})
                    for i, n in enumerate(self._want)
                ],
            )
        errors = dict(self._errors)
        if out.token_ids and min(out.token_ids) < 0:
            for i, token in enumerate(out.token_ids):
                if token < 0 and i not in errors:
                    errors[i] = "the model produced non-finite logits (NaN or inf) for this request"
        for i in errors:
            out.token_ids[i] = -1
        out.errors = errors
        return out
