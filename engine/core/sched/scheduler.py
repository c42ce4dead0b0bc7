"""Continuous batching: decide, each step, which tokens of which sequences run.

Pure CPU over ints and lists (no torch). Each step:
  1. running sequences first (decodes, and prefills already under way), in priority order;
     when KV blocks run out, the lowest-priority / most recent running sequence is preempted
     (by swap to CPU or by recompute: engine/core/sched/preemption.py);
  2. then swapped-out and waiting sequences, most urgent first (priority, swapped before
     waiting at equal priority, then arrival order): swapped ones come back, waiting ones are
     admitted, their prompts chunked to fit the token budget; prefix-cache hits skip the
     blocks already computed (engine/core/sched/admit.py).
How much prefill the step takes, and which tokens it holds back (a latency target,
whole_prompts_first, CPU micro-steps and prompt waves), is the step's prefill plan
(engine/core/sched/prefill_plan.py); the queues' orders and seats are engine/core/sched/queues.py's.
Before 1., a waiting or swapped sequence more urgent than some running ones may preempt
them to make room (lower `priority` value = more urgent). A step that preempted admits only
sequences strictly more urgent than everything it preempted (no thrash).
The step's work is a SchedulerOutput (engine/core/sched/scheduler_output.py) that the runner turns into tensors.
Here is the policy; KV block accounting is engine/core/kv/allocator.py's, draft limits and
acceptance engine/spec_decode/sched/'s (handed in: engine/core/sched/drafts.py), applying a step's
results engine/core/sched/step_update.py's.
"""

from __future__ import annotations

import itertools
import time
from typing import TYPE_CHECKING

from engine.core.kv.allocator import KVAllocator
from engine.core.kv.block_pool import BlockPool
from engine.core.outputs import FinishReason, RequestUpdate, SamplerOutput
from engine.core.request import Request, SeqStatus, Sequence
from engine.core.sched.admit import Admitter
from engine.core.sched.deltas import SeqDeltas
from engine.core.sched.integrity import check_queues
from engine.core.sched.preemption import Preemptor
from engine.core.sched.prefill_plan import PrefillPlan
from engine.core.sched.queues import SeqQueues
from engine.core.sched.scheduler_config import SchedulerConfig
from engine.core.sched.scheduler_metrics import SchedulerMetrics
from engine.core.sched.scheduler_output import SchedulerOutput, scheduled_seq
from engine.core.sched.step_update import StepResults

if TYPE_CHECKING:
    from engine.core.kv.swap_space import SwapSpace
    from engine.core.sched.drafts import Drafts

__all__ = ["Scheduler", "SchedulerConfig", "SchedulerOutput"]


class Scheduler(SchedulerMetrics):
    def __init__(
        self, config: SchedulerConfig, pool: BlockPool, swapper: "SwapSpace | None" = None, spec: "Drafts | None" = None
    ) -> None:
        self.config = config
        self.pool = pool
        self.swapper = swapper
        self.kv = KVAllocator(
            pool,
            reserved_blocks_fraction=config.reserved_blocks_fraction,
            reserved_priority=config.reserved_priority,
            watermark_fraction=config.watermark_fraction,
        )
        self.spec = spec  # speculative decoding: drafts for decoding sequences, and their acceptance
        self.seqs_by_id: dict[int, Sequence] = {}  # every sequence of an unfinished request
        self.deltas = SeqDeltas()  # what the worker holds of each sequence (block table, tokens)
        # The queues in their orders, and the running seats (engine/core/sched/queues.py).
        self.queues = queues = SeqQueues()
        self.waiting, self.running, self.swapped = queues.waiting, queues.running, queues.swapped
        self._unforked = queues.unforked  # n > 1 requests not forked yet: they hold n seats
        self._seats_used = queues.seats_used  # running seats taken (n per unforked request)
        self.preemption = Preemptor(
            config.preemption_mode, self.kv, swapper, self.running, self.swapped, queues.insert_waiting
        )
        self.results = StepResults(
            self.kv,
            self.spec,
            self._new_child,
            self.finish_seq,
            self.pop_finished_request,
            config.eos_token_ids,
            config.max_model_len,
            self.seqs_by_id,
        )
        self.requests: dict[str, Request] = {}
        self._seq_ids = itertools.count()
        self._spare = self.results.spare  # decode records of processed steps, for the next decode
        self._prefills = False  # this step emitted a record of more than one token
        # The step's prefill allowance, prompt shares and holds (engine/core/sched/prefill_plan.py).
        self.plan = PrefillPlan(config, speculative=spec is not None)
        self.step_budget = self.plan.step_budget  # the latency target's (None: no target)
        self.micro, self.wave = self.plan.micro, self.plan.wave
        # Swapped and waiting sequences in, most urgent first (engine/core/sched/admit.py).
        self.admitter = Admitter(config, pool, self.kv, swapper, self.preemption, queues, self.plan, self._emit)

    # ---- requests in and out ----
    def add_request(self, request: Request, held: bool = False) -> None:
        """Queue an admitted request (engine/runtime/admission.py checked it: lengths, n, token ids,
        the KV pool at its priority, its id unused). `held`: known (its id taken, abortable) but not
        queued until `release_held` (its prefix is loading from the KV tiers)."""
        if request.request_id in self.requests:
            # Only two submits racing with one id get here (admission refused the id if it was in use):
            # not a refusal but this request's failure, as the caller's add (AsyncEngine) reports it.
            raise RuntimeError(f"request id {request.request_id!r} is already in use")
        params = request.params
        seq = self._new_seq(request, 0, list(request.prompt_token_ids))
        request.seqs = [seq]
        self.requests[request.request_id] = request
        if params.n > 1:
            self._unforked[seq.seq_id] = seq
        if not held:
            self.queues.insert_waiting(seq)

    def release_held(self, request: Request) -> None:
        """Queue a request added with held=True (unless it finished meanwhile: aborted)."""
        seq = request.seqs[0] if request.seqs else None
        if seq is None or self.requests.get(request.request_id) is not request:
            return  # (its add failed, or it finished and was handed out)
        if not seq.is_finished and seq not in self.waiting:
            self.queues.insert_waiting(seq)

    def _new_seq(self, request: Request, index: int, tokens: list[int]) -> Sequence:
        seq = Sequence(
            seq_id=next(self._seq_ids),
            request=request,
            sample_index=index,
            token_ids=tokens,
            num_prompt_tokens=len(request.prompt_token_ids),
        )
        self.queues.arrived(seq)
        self.seqs_by_id[seq.seq_id] = seq
        return seq

    def abort_request(self, request_id: str) -> RequestUpdate | None:
        """Finish every sequence of a request now (its blocks are free at once); its last update."""
        request = self.requests.get(request_id)
        if request is None:
            return None
        for seq in request.seqs:
            if not seq.is_finished:
                self.finish_seq(seq, FinishReason.ABORT)
        return self._final_update(request)

    def fail_all(self, message: str) -> list[RequestUpdate]:
        """Fail every unfinished request (after the loop crashed); their last updates (the pool ends
        fully free)."""
        updates = []
        for request in list(self.requests.values()):
            if not request.is_finished:
                self.results.fail_request(request, message)
            updates.append(self._final_update(request))
        return updates

    def finish_by_text(self, request_id: str, index: int, stop_reason: int | str | None) -> None:
        """Sample `index` of a request hit a stop string (the output side found it and handed out
        its end): finish it, freeing its blocks; tokens of steps still in flight are dropped."""
        request = self.requests.get(request_id)
        if request is None:
            return
        for seq in request.seqs:
            if seq.sample_index == index:
                self.finish_seq(seq, FinishReason.STOP, stop_reason)
        if request.is_finished:
            request.finished_time = time.monotonic()
            self.pop_finished_request(request_id)

    def set_paused(self, request_id: str, paused: bool) -> None:
        """Pause or resume a request's sequences (its reader has fallen behind / caught up): a
        paused one is skipped by every step, keeping its KV blocks (preemption may still take them)."""
        request = self.requests.get(request_id)
        if request is not None:
            request.paused = paused

    def _final_update(self, request: Request) -> RequestUpdate:
        request.finished_time = request.finished_time or time.monotonic()
        self.pop_finished_request(request.request_id)
        return self.results.update_of(request)

    def finish_seq(self, seq: Sequence, reason: FinishReason, stop_reason: int | str | None = None) -> None:
        """Mark a sequence done and release everything it holds, at once."""
        if seq.is_finished:
            return
        self.queues.remove(seq)
        if seq.num_pending:  # tokens of launched steps that will never be shown
            del seq.token_ids[len(seq.token_ids) - seq.num_pending :]
            seq.num_pending = 0
        self.preemption.release(seq)
        self._unforked.pop(seq.seq_id, None)
        self._spare.pop(seq.seq_id, None)
        self.deltas.drop(seq.seq_id)
        seq.status = SeqStatus.FINISHED
        seq.finish_reason = reason
        seq.stop_reason = stop_reason

    def pop_finished_request(self, request_id: str) -> Request | None:
        request = self.requests.get(request_id)
        if request is not None and request.is_finished:
            del self.requests[request_id]
            for seq in request.seqs:
                self.queues.order.pop(seq.seq_id, None)
                self.seqs_by_id.pop(seq.seq_id, None)
            return request
        return None

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.swapped)

    # ---- the step ----
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        self.preemption.begin_step()
        self._prefills = False
        if self.swapper is not None:
            self.swapper.begin_step()
        queued = bool(self.waiting or self.swapped)
        seats_left = self.config.max_num_seqs - self._seats_used()
        self.plan.begin(self.running, self.waiting, seats_left, SeqQueues.seats)
        out = self._fill(out, budget, queued)
        if not out.seqs and self.plan.lift(self.running):  # (a held step that ran nothing runs what it held)
            out = self._fill(out, budget, bool(self.waiting or self.swapped))
        self.plan.ran(out.num_prefill_tokens)
        if self._prefills:
            # One-token sequences first: backends attend decodes and prefill chunks separately.
            out.seqs.sort(key=lambda s: s.num_tokens != 1)
        for seq_id in out.preempted:
            self.deltas.drop(seq_id)
        if self.deltas.dropped and out.seqs:  # (the worker builds only a message with sequences)
            out.dropped_seqs = self.deltas.take_dropped()
        return out

    def _fill(self, out: SchedulerOutput, budget: int, queued: bool) -> SchedulerOutput:
        if queued and self.running:
            # 0. A more urgent waiting or swapped sequence may preempt less urgent running ones.
            head = next(iter(self.queues.queue()))
            self.preemption.make_room_for_head(
                head, budget, out, self._seats_used, SeqQueues.seats, self.config.max_num_seqs
            )
        # 1. Running sequences, highest priority first; preempt from the back when short of blocks.
        budget = self._schedule_running(out, budget)
        if queued:
            # 2. Swapped and waiting sequences, most urgent first, while seats, budget and blocks last.
            budget = self.admitter.admit(out, budget)
            if not out.seqs and not self.running and self.swapped:
                # Nothing can run: the GPU blocks that swapped sequences kept may be what is missing.
                if self.preemption.demote_swapped(self.queues.admit_key):
                    budget = self.admitter.admit(out, budget)
        return out

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        running = self.running
        bs = self.config.block_size
        max_len = self.config.max_model_len
        ref = self.pool.ref_counts
        spare = self._spare
        emitted = out.seqs
        plain = self.spec is None  # no drafts to propose: a decode can take the fast path
        no_reserve = self.kv.reserved_blocks == 0
        delta = self.deltas.delta
        plan = self.plan
        hold = plan.hold  # (MicroSteps: decodes and prompts' last tokens wait; pieces stop one short)
        hold_last = plan.hold_last  # (PrefillWave, and MicroSteps: prompts' last tokens wait)
        decodes = 0
        i = 0
        while i < len(running) and budget > 0:
            seq = running[i]
            tokens = seq.token_ids
            start = seq.num_computed_tokens
            num_new = len(tokens) - start
            if (
                num_new <= 0
                or seq.request.paused
                or (num_new == 1 and (hold or (hold_last and start < seq.num_prompt_tokens)))
            ):
                i += 1
                continue
            if seq.num_pending:  # one whose launched step ends it by length gets no extra token
                max_tokens = seq.request.params.max_tokens
                if len(tokens) >= max_len or (
                    max_tokens is not None and len(tokens) - seq.num_prompt_tokens >= max_tokens
                ):
                    i += 1
                    continue
            # The steady state: a decode whose token fits its private last block (nothing to
            # allocate or copy), written into a record of an earlier, processed step.
            if (
                num_new == 1
                and plain
                and start % bs
                and start >= seq.num_prompt_tokens
                and ref[seq.block_ids[start // bs]] == 1
                and seq.seq_id in spare
                and (no_reserve or self.kv.can_grow(seq, 1))
            ):
                record = spare.pop(seq.seq_id)
                record.token_ids = tokens[start : start + 1]
                record.start_pos = start
                record.blocks_from, record.new_block_ids, record.history_from, record.new_history = delta(seq)
                emitted.append(record)
                decodes += 1
                budget -= 1
                i += 1
                continue
            if num_new > budget:
                num_new = budget
            if num_new > 1:  # a prefill piece: within the step's prefill plan
                num_new = plan.piece(num_new, budget, len(tokens) - start, running, i + 1)
                if not num_new:
                    i += 1
                    continue
            drafts = self.spec.drafts(seq, budget) if num_new == 1 and self.spec is not None else []
            if drafts and self.kv.can_grow(seq, 1 + len(drafts)):
                num_new = 1 + len(drafts)  # drafts only where blocks are free: they never preempt
            else:
                drafts = []
            while not self.kv.can_grow(seq, num_new):
                victim = self.preemption.victim()
                self.preemption.preempt(victim, out, reason="out of KV blocks")
                if victim is seq:
                    break
            if seq.status is not SeqStatus.RUNNING:
                break  # it preempted itself: everything after it is gone too
            self.kv.grow(seq, num_new, out.blocks_to_copy)
            self._emit(seq, num_new, out, drafts)
            budget -= num_new
            i += 1
        out.num_decode_tokens += decodes
        return budget

    def _emit(self, seq: Sequence, num_new: int, out: SchedulerOutput, drafts: list[int] | None = None) -> None:
        request = seq.request
        start = seq.num_computed_tokens
        drafts = drafts or []
        out.seqs.append(
            scheduled_seq(
                seq, start, num_new, drafts, self.deltas.delta(seq), self.spec is not None and self.spec.verifying(seq)
            )
        )
        if num_new != 1:
            self._prefills = True
        if drafts:
            out.num_decode_tokens += num_new
        elif num_new == 1 and start + 1 == seq.num_tokens and start >= seq.num_prompt_tokens:
            out.num_decode_tokens += 1
        else:
            out.num_prefill_tokens += num_new
        if request.first_scheduled_time is None:
            request.first_scheduled_time = time.monotonic()

    # ---- after the step (engine/core/sched/step_update.py) ----
    def launched(self, out: SchedulerOutput) -> None:
        """The step is on the device: advance its sequences now (placeholders for sampled tokens)."""
        self.results.launched(out)

    def update_from_output(self, out: SchedulerOutput, sampled: SamplerOutput) -> list[RequestUpdate]:
        """Take in a step's sampled tokens: one pass appends them, runs the token-level stops and
        grammars, and frees what ended (engine/core/sched/step_update.py); returns the updates for
        the output side."""
        return self.results.update(out, sampled)

    def _new_child(self, parent: Sequence, index: int) -> Sequence:
        """A fork's child: the parent's tokens and progress, running beside it."""
        request = parent.request
        self._unforked.pop(parent.seq_id, None)  # the request's n seats are now its n sequences'
        child = self._new_seq(request, index, list(parent.token_ids))
        child.num_computed_tokens = parent.num_computed_tokens
        child.num_cached_tokens = parent.num_cached_tokens
        request.seqs.append(child)
        self.queues.insert_running(child)
        return child

    # ---- bookkeeping ----
    def check_integrity(self) -> None:
        """The pool's own invariants plus the queues' (engine/core/sched/integrity.py)."""
        check_queues(self.kv, self.swapper, self.running, self.waiting, self.swapped, self._spare)
        assert self._seats_used() <= self.config.max_num_seqs, "more running seats than max_num_seqs"

    def fragmentation(self) -> float:
        """Allocated slots not holding a computed token / allocated slots."""
        return self.kv.fragmentation(self.running)
