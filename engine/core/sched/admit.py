"""The step's second part: swapped and waiting sequences join the running ones, most urgent first
(engine/core/sched/queues.py's admission order), while seats, the token budget and KV blocks last.

A swapped sequence comes back (its blocks swapped in) with its next tokens; a waiting one is
admitted with its first chunk, within the step's prefill plan (engine/core/sched/prefill_plan.py),
its prompt's cached full blocks reused (prefix caching). Head of line: where the most urgent one
cannot start, nothing less urgent jumps it; nor does anything take the room of a sequence the step
preempted at least as urgent (no thrash). Not to be confused with engine/runtime/admission.py,
which checks a request before it is queued at all.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from engine.core.request import SeqStatus
from engine.core.request_kinds import task_of
from engine.core.sched.queues import SeqQueues

if TYPE_CHECKING:
    from collections.abc import Callable

    from engine.core.kv.allocator import KVAllocator
    from engine.core.kv.block_pool import BlockPool
    from engine.core.kv.swap_space import SwapSpace
    from engine.core.request import Sequence
    from engine.core.sched.preemption import Preemptor
    from engine.core.sched.prefill_plan import PrefillPlan
    from engine.core.sched.scheduler_config import SchedulerConfig
    from engine.core.sched.scheduler_output import SchedulerOutput


@dataclass(eq=False)
class Admitter:
    config: SchedulerConfig
    pool: BlockPool
    kv: KVAllocator
    swapper: SwapSpace | None
    preemption: Preemptor
    queues: SeqQueues
    plan: PrefillPlan
    emit: Callable[[Sequence, int, SchedulerOutput], None]  # the scheduler's: a sequence's share into the step

    def admit(self, out: SchedulerOutput, budget: int) -> int:
        """Admit what fits into the step `out`; the token budget left."""
        floor = self.preemption.floor
        for seq in self.queues.queue():
            if floor is not None and seq.request.priority >= floor:
                break  # this step preempted something at least as urgent: don't take its room
            if budget <= 0 or self.queues.seats_used() + SeqQueues.seats(seq) > self.config.max_num_seqs:
                break
            if seq.request.paused:
                continue  # (preempted while its reader is behind: back when it reads)
            if seq.status is SeqStatus.SWAPPED:
                if self.plan.hold:
                    break  # (it comes back to decode: with the decodes)
                left = self._try_swap_in(seq, out, budget)
            else:
                left = self._try_admit(seq, out, budget)
            if left is None:
                break  # head of line: nothing less urgent jumps the queue
            budget = left
        return budget

    def _try_admit(self, seq: Sequence, out: SchedulerOutput, budget: int) -> int | None:
        """Admit one waiting sequence (its first chunk); the budget left, or None if it can't."""
        hit_tokens = 0
        if seq.num_computed_tokens == 0 and not seq.block_ids:
            hit_tokens = self._take_prefix_hits(seq)
        plan = self.plan
        remaining = seq.num_tokens - seq.num_computed_tokens - (1 if plan.hold_last else 0)
        if not self.config.enable_chunked_prefill and remaining > budget:
            if out.seqs:
                self.kv.drop_prefix_hits(seq)
                return None  # wait for a step with room for the whole prompt
            if remaining > self.config.max_num_batched_tokens:
                raise AssertionError("unchunkable prompt beyond the token budget passed validation")
        num_new = min(remaining, budget, plan.left, plan.chunk_cap)
        if remaining == 0 and plan.hold_last and budget > 0:
            self.kv.drop_prefix_hits(seq)
            return budget  # (its last token waits for the release: the prompts behind it may start)
        if num_new <= 0 or not self.kv.can_admit(seq, num_new, bool(self.queues.running)):
            self.kv.drop_prefix_hits(seq)
            return None
        if seq.num_output_tokens == 0 and seq.num_preemptions == 0:
            self.pool.record_prefix_query(seq.num_prompt_tokens, hit_tokens)
        self.kv.grow(seq, num_new, out.blocks_to_copy)
        self.queues.waiting.remove(seq)
        self.queues.insert_running(seq)
        self.emit(seq, num_new, out)
        plan.left -= num_new
        return budget - num_new

    def _take_prefix_hits(self, seq: Sequence) -> int:
        """Reuse cached full blocks where the request allows it; returns the prompt tokens found."""
        request = seq.request
        if not self.pool.enable_prefix_caching or not task_of(request).prefix_cacheable:
            return 0  # (e.g. prompt logprobs need every prompt position computed)
        return self.kv.take_prefix_hits(seq)

    def _try_swap_in(self, seq: Sequence, out: SchedulerOutput, budget: int) -> int | None:
        """Bring one swapped sequence back (and schedule its next tokens); None if it can't
        (preemption: engine/core/sched/preemption.py)."""
        assert self.swapper is not None
        num_new = min(seq.num_tokens - seq.num_computed_tokens, budget)
        if self.preemption.blocks_to_start(seq, budget) > self.kv.available_for(seq.request.priority):
            return None
        out.blocks_to_swap_in.extend(self.swapper.swap_in(seq))
        self.queues.swapped.remove(seq)
        self.queues.insert_running(seq)
        if num_new > 0:
            self.kv.grow(seq, num_new, out.blocks_to_copy)
            self.emit(seq, num_new, out)
        return budget - num_new
