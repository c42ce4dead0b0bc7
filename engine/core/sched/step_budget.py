"""The step's prefill allowance under an inter-token latency target (the target_itl_ms setting).

Every decoding sequence waits for the whole step, so a prefill chunk that rides along with
decodes stretches their inter-token gap by its own cost. With a target, the scheduler asks here
how many prefill tokens fit beside the step's decodes:

    allowance = (target - decode_ms(decodes)) / ms_per_prefill_token

from an online cost model (`StepCostModel`) that learns from each step's measured model time
(EngineCore feeds it): decode_ms(d) is a running average per decode batch size d, the prefill
rate a running average over steps that carried at least MIN_PREFILL_SAMPLE prefill tokens, after
taking out their decodes' share. The allowance is rounded down to whole KV blocks (few step
shapes) and never below one block (a prompt always progresses); a step with no decodes has no
gap to protect and keeps the full token budget (the first token of an idle server is not slowed).
Until the model has seen a prefill, the full budget stands: the first prefill teaches it.
Pure Python, no clock of its own: the caller passes measured milliseconds.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from engine.core.request import Sequence
    from engine.core.sched.scheduler import SchedulerConfig

# A step needs this many prefill tokens before its time prices a prefill token (fewer: noise).
MIN_PREFILL_SAMPLE = 16
# Weight of the newest measurement in the running averages (about the last 10 steps count).
EWMA_WEIGHT = 0.1


def _blend(old: float | None, new: float) -> float:
    return new if old is None else old + EWMA_WEIGHT * (new - old)


@dataclass
class StepCostModel:
    """ms of a step's model time ~ decode_ms(decode_seqs) + prefill_tokens * ms_per_prefill_token."""

    decode_ms_by_seqs: dict[int, float] = field(default_factory=dict)
    ms_per_prefill_token: float | None = None

    def decode_ms(self, seqs: int) -> float:
        """Predicted time of a step of `seqs` decodes: measured, else scaled from the nearest
        smaller measured batch (linear: an overestimate, which errs on the latency side), else
        from the nearest larger one, else 0."""
        if seqs <= 0:
            return 0.0
        known = self.decode_ms_by_seqs.get(seqs)
        if known is not None:
            return known
        smaller = [d for d in self.decode_ms_by_seqs if d < seqs]
        if smaller:
            d = max(smaller)
            return self.decode_ms_by_seqs[d] * seqs / d
        larger = [d for d in self.decode_ms_by_seqs if d > seqs]
        if larger:
            d = min(larger)
            return self.decode_ms_by_seqs[d]
        return 0.0

    def observe(self, prefill_tokens: int, decode_seqs: int, model_ms: float) -> None:
        """Take in one step's measured model time."""
        if model_ms <= 0:
            return
        if prefill_tokens == 0:
            if decode_seqs > 0:
                self.decode_ms_by_seqs[decode_seqs] = _blend(self.decode_ms_by_seqs.get(decode_seqs), model_ms)
            return
        if prefill_tokens < MIN_PREFILL_SAMPLE:
            return
        rest = max(model_ms - self.decode_ms(decode_seqs), 0.0)
        self.ms_per_prefill_token = _blend(self.ms_per_prefill_token, rest / prefill_tokens)


class StepBudget:
    """Prefill tokens a step may carry beside its decodes so that it stays within target_ms."""

    def __init__(self, target_ms: float, max_tokens: int, block_size: int) -> None:
        if target_ms <= 0:
            raise ValueError(f"target_itl_ms must be positive, got {target_ms}")
        self.target_ms = target_ms
        self.max_tokens = max_tokens  # max_num_batched_tokens: the hard cap stays
        self.block_size = block_size
        self.cost = StepCostModel()

    @classmethod
    def of(cls, config: "SchedulerConfig") -> "StepBudget | None":
        """The scheduler's budget: None without a target, or without chunked prefill (nothing to cut)."""
        if not config.target_itl_ms or not config.enable_chunked_prefill:
            return None
        return cls(config.target_itl_ms, config.max_num_batched_tokens, config.block_size)

    def observe(self, prefill_tokens: int, decode_seqs: int, model_ms: float) -> None:
        self.cost.observe(prefill_tokens, decode_seqs, model_ms)

    def allowance(self, running: "list[Sequence]") -> int:
        """The prefill allowance of a step over these running sequences: those with one token to run
        (not paused) are its decodes."""
        decodes = sum(1 for s in running if len(s.token_ids) - s.num_computed_tokens == 1 and not s.request.paused)
        return self.prefill_tokens(decodes)

    def prefill_tokens(self, decode_seqs: int) -> int:
        """The step's prefill allowance next to `decode_seqs` decodes (see the module docstring)."""
        full = self.max_tokens - decode_seqs
        rate = self.cost.ms_per_prefill_token
        if decode_seqs == 0 or rate is None or rate <= 0:
            return full
        spare_ms = self.target_ms - self.cost.decode_ms(decode_seqs)
        tokens = int(spare_ms / rate) // self.block_size * self.block_size
        allowance = min(max(tokens, self.block_size), full)
        return max(allowance, 1)


def chunk_cap(config: "SchedulerConfig") -> int:
    """One prompt's tokens in a step at most (long_prefill_token_threshold, with chunked prefill):
    short prompts queued behind a long one start in the same step instead of after it."""
    if config.enable_chunked_prefill and config.long_prefill_token_threshold > 0:
        return config.long_prefill_token_threshold
    return config.max_num_batched_tokens
