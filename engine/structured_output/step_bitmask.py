"""A step's grammar bitmask, filled by the core for the worker's sampler.

The message marks a constrained request's records (`ScheduledSeq.constrained`); the matchers
stay with the core's request, which advances them by each step's tokens. Before a step is
sampled the core answers the marks: one int32 row of allowed tokens per sampler row of a
constrained sequence (all ones elsewhere), and the rows whose matcher failed, so the sampler
masks logits without ever holding a matcher.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

from engine.core.sched.scheduler_output import SchedulerOutput, sample_row_ranges
from engine.structured_output.grammars import GrammarMatcher, bitmask_words


@dataclass
class StepBitmask:
    mask: torch.Tensor  # int32 [sampler rows, words] on the host (bit t % 32 of word t // 32: token t allowed)
    errors: dict[int, str] = field(default_factory=dict)  # sampler row -> why its matcher failed


def step_bitmask(
    sched: SchedulerOutput,
    matchers_of: Callable[[int], list[GrammarMatcher] | None],
    vocab_size: int,
    skip: set[int] | frozenset[int] = frozenset(),
) -> StepBitmask | None:
    """The bitmask of the step's constrained sampler rows (None when it has none). matchers_of:
    seq id -> its request's matchers, by sample index; skip: seq ids not to ask (finished since
    the step was launched: their rows are discarded)."""
    if not any([s.constrained for s in sched.seqs]):
        return None
    ranges = list(sample_row_ranges(sched.seqs))
    total = ranges[-1][1].stop if ranges else 0
    mask = torch.full((total, bitmask_words(vocab_size)), -1, dtype=torch.int32)
    errors: dict[int, str] = {}
    for s, rows in ranges:
        if not s.constrained or not len(rows) or s.seq_id in skip:
            continue
        matchers = matchers_of(s.seq_id)
        if not matchers:
            continue
        for k, row in enumerate(rows):  # (a fork's rows: samples sample_index + k)
            try:
                matchers[s.sample_index + k].fill_bitmask(mask, row)
            except Exception as exc:  # noqa: BLE001 - isolate a matcher failure to its request
                errors[row] = f"structured output failed: {type(exc).__name__}: {exc}"
    return StepBitmask(mask, errors)
