"""One step's prefill plan: how many prompt tokens the step takes, and which it holds back.

The scheduler sets the plan up at the start of each step (`begin`) and asks it as it hands out
prompt pieces; the limits themselves are engine/core/sched/step_budget.py's:
  * the allowance: the whole token budget, or under a latency target what fits beside the
    step's decodes (StepBudget);
  * one prompt's share of a step (chunk_cap);
  * whole_prompts_first: tokens held back from running prompts' next pieces for waiting prompts
    that fit whole (whole_prompts_reserve);
  * cpu_micro_batch_tokens (MicroSteps, `hold`): a step of prompt pieces only, the decodes and
    the prompts' last tokens held back;
  * cpu_prefill_wave_tokens (PrefillWave, `hold_last`): the prompts' last tokens held back, the
    decodes run.
A held step that emitted nothing is lifted (`lift`) and filled again; `ran` tells the holds what
the step took. MicroSteps and PrefillWave split prompts into pieces, so neither is on without
chunked prefill, nor with speculative decoding.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from engine.core.sched.step_budget import (
    MicroSteps,
    PrefillWave,
    StepBudget,
    chunk_cap,
    num_decodes,
    whole_prompts_reserve,
)

if TYPE_CHECKING:
    from collections.abc import Callable

    from engine.core.request import Sequence
    from engine.core.sched.scheduler_config import SchedulerConfig


class PrefillPlan:
    def __init__(self, config: "SchedulerConfig", speculative: bool) -> None:
        self.max_tokens = config.max_num_batched_tokens
        self.whole_prompts_first = config.whole_prompts_first and config.enable_chunked_prefill
        self.step_budget = StepBudget.of(config)  # None: no latency target
        # One prompt's share of a step (chunked prefill): short prompts queued behind a long one start beside it.
        self.chunk_cap = chunk_cap(config)
        pieces = config.enable_chunked_prefill and not speculative
        mb = config.micro_batch_tokens if pieces else 0
        self.micro = MicroSteps(mb, self.max_tokens) if mb else None  # (CPU: cpu_micro_batch_tokens)
        wave = config.prefill_wave_tokens if pieces else 0
        # (CPU: cpu_prefill_wave_tokens; a wave no larger than a step holds nothing)
        self.wave = PrefillWave(self.max_tokens, wave) if wave > self.max_tokens else None
        self.left = 0  # prefill tokens this step may still take
        self.held = 0  # of those, held back from running prompts for waiting ones (whole_prompts_first)
        self.hold = False  # this step holds the decodes (MicroSteps)
        self.hold_last = False  # this step holds its prompts' last tokens, not its decodes (PrefillWave)

    def begin(
        self,
        running: "list[Sequence]",
        waiting: "list[Sequence]",
        seats_left: int,
        seats: "Callable[[Sequence], int]",
    ) -> None:
        """The plan of a step over these queues (`seats`: the running slots a sequence stands for)."""
        self.left = self.max_tokens if self.step_budget is None else self.step_budget.allowance(running)
        self.held, self.hold = 0, False
        if self.whole_prompts_first and waiting and running:
            self.held = whole_prompts_reserve(running, waiting, seats_left, self.left, seats)
        if self.micro is not None:
            self.hold, allowance = self.micro.plan(running, waiting, seats_left)
            self.left = min(self.left, allowance)
        self.hold_last = self.hold or (self.wave is not None and self.wave.plan(running, waiting, seats_left))

    def piece(self, num_new: int, budget: int, to_run: int, running: "list[Sequence]", after: int) -> int:
        """Tokens of a running prompt's next piece (`num_new` > 1 of its `to_run`, `running[after:]`
        the sequences behind it); 0: none this step."""
        room = min(self.left, budget)
        if self.held:  # (whole_prompts_first: leave room for waiting prompts and later decodes)
            room -= self.held + num_decodes(running[after:])
        if room <= 0:
            return 0
        num_new = min(num_new, room, self.chunk_cap, to_run - 1 if self.hold_last else num_new)
        self.left -= num_new
        return num_new

    def lift(self, running: "list[Sequence]") -> bool:
        """The step emitted nothing: lift its hold; whether to fill it again."""
        if self.hold:  # (nothing could run held: run the decodes now)
            assert self.micro is not None
            self.hold = self.hold_last = False
            self.left = min(self.left, max(self.micro.tokens - num_decodes(running), 0))
            return True
        if self.hold_last:  # (only last tokens were left to run: run them)
            self.hold_last = False
            return True
        return False

    def ran(self, prefill_tokens: int) -> None:
        """The step is planned: the holds count what it took."""
        if self.micro is not None:
            self.micro.ran(self.hold, prefill_tokens)
        if self.wave is not None:
            self.wave.ran(self.hold_last, prefill_tokens)  # (a MicroSteps hold counts too)
