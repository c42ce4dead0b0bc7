"""Preemption: which running sequence gives way, and how (swap its KV to the CPU or recompute it).

The scheduler decides *when* room is needed (a running sequence cannot grow, a more urgent
one is queued); this module picks the victim, chooses the mode and does the KV side:
  * victim: the least urgent running sequence, the most recent at equal priority (the
    scheduler keeps `running` in that order, so it is the last one);
  * mode: `recompute` frees the blocks and the sequence starts over from its tokens (prefix
    hits bring back what is still cached); `swap` copies its private blocks to the CPU
    whenever the swap space has room; `auto` swaps only if copying out and back in is
    estimated to cost less than recomputing (SwapSpace.can_swap_out);
  * demotion: when nothing at all can run, swapped sequences that kept shared GPU blocks give
    them up and fall back to recompute;
  * the counters the metrics read (by mode, swap fallbacks) and the log line saying why.
It moves sequences between the scheduler's queues (lists it is handed at construction; the
scheduler keeps `running` most urgent first and puts sequences in `waiting` by `to_waiting`).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Callable, Literal

from engine.core.request import SeqStatus, Sequence

if TYPE_CHECKING:
    from engine.core.kv.allocator import KVAllocator
    from engine.core.kv.swap_space import SwapSpace
    from engine.core.sched.scheduler_output import SchedulerOutput

logger = logging.getLogger("engine.core.sched.scheduler")  # (the log lines users know come from the scheduler)

PreemptionMode = Literal["auto", "swap", "recompute"]


class Preemptor:
    def __init__(
        self,
        mode: PreemptionMode,
        kv: KVAllocator,
        swapper: SwapSpace | None,
        running: list[Sequence],
        swapped: list[Sequence],
        to_waiting: Callable[[Sequence], None],
    ) -> None:
        self.mode = mode
        self.kv = kv
        self.swapper = swapper
        self.running = running
        self.swapped = swapped
        self.to_waiting = to_waiting
        self.num_preemptions = 0
        self.by_mode: dict[str, int] = {"recompute": 0, "swap": 0}
        self.num_swap_fallbacks = 0  # swapped sequences turned into recompute to unblock the queue
        self.on_preempt: Callable[[Sequence, str, str], None] | None = None
        self.floor: int | None = None  # most urgent priority preempted this step

    def begin_step(self) -> None:
        self.floor = None

    # ---- victims ----
    def victim(self) -> Sequence:
        """Who gives way when blocks run out: `running` is kept most urgent first."""
        return self.running[-1]

    def make_room(
        self,
        head: Sequence,
        budget: int,
        out: SchedulerOutput,
        fits: Callable[[], bool],
        seats_suffice: Callable[[list[Sequence]], bool],
    ) -> None:
        """Preempt running sequences less urgent than `head`, least urgent first, until it fits;
        only if preempting all of them could make room at all (their seats, their unshared
        blocks): never preempt for nothing."""
        prio = head.request.priority
        victims = [s for s in self.running if s.request.priority > prio]
        if not victims or fits():
            return
        blocks = self.kv.available_for(prio) + self.kv.blocks_freed_by(victims)
        if not seats_suffice(victims) or self.blocks_to_start(head, budget) > blocks:
            return
        reason = f"request {head.request.request_id} of priority {prio} needs room"
        while self.running and self.running[-1].request.priority > prio and not fits():
            self.preempt(self.running[-1], out, reason=reason)

    # ---- preempting ----
    def blocks_to_start(self, seq: Sequence, budget: int) -> int:
        """GPU blocks a queued sequence needs to run its next chunk (a swapped one: to come back)."""
        num_new = min(seq.num_tokens - seq.num_computed_tokens, budget)
        if seq.status is SeqStatus.SWAPPED and self.swapper is not None:
            return self.swapper.blocks_to_resume(seq, num_new)
        return self.kv.blocks_needed(seq, num_new)

    def release(self, seq: Sequence) -> None:
        """A finished sequence gives back what it holds: its swap entry, or its blocks."""
        if seq.status is SeqStatus.SWAPPED and self.swapper is not None:
            self.swapper.discard(seq)
            self.kv.forget(seq)
        else:
            self.kv.release(seq)

    def mode_for(self, seq: Sequence) -> str:
        """swap: to the CPU whenever it has room; auto: also only if copying the KV out and back
        is estimated to cost less than recomputing it (SwapSpace.can_swap_out); otherwise, and
        in recompute mode, recompute."""
        if self.swapper is None or self.mode == "recompute":
            return "recompute"
        return "swap" if self.swapper.can_swap_out(seq, self.mode) else "recompute"

    def preempt(self, seq: Sequence, out: SchedulerOutput, reason: str) -> None:
        """Take a running sequence off the device: swap its KV out (to `swapped`) or release it
        for recompute (to `waiting`, no computed tokens left)."""
        computed = seq.num_computed_tokens
        self.running.remove(seq)
        mode = self.mode_for(seq)
        if self.mode == "auto" and self.swapper is not None:
            estimate = self.swapper.auto_estimate(seq)
            if estimate is not None:
                reason += f"; estimated swap {estimate[0] * 1e3:.2f} ms vs recompute {estimate[1] * 1e3:.2f} ms"
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.by_mode[mode] += 1
        out.preempted.append(seq.seq_id)
        prio = seq.request.priority
        if self.floor is None or prio < self.floor:
            self.floor = prio
        if mode == "swap":
            assert self.swapper is not None
            out.blocks_to_swap_out.extend(self.swapper.swap_out(seq))
            seq.status = SeqStatus.SWAPPED
            self.swapped.append(seq)
        else:
            self.kv.release(seq)
            seq.num_computed_tokens = 0
            self.to_waiting(seq)
            if self.mode != "recompute" and self.swapper is not None:
                reason += f"; not swapped ({self.swapper.num_free} CPU blocks free, {self.mode} mode)"
        logger.info(
            "preempted request %s (seq %d, priority %d, %d tokens of KV) by %s: %s",
            seq.request.request_id,
            seq.seq_id,
            prio,
            computed,
            mode,
            reason,
        )
        if self.on_preempt is not None:
            self.on_preempt(seq, mode, reason)

    # ---- swapped sequences falling back to recompute ----
    def demote_swapped(self, key: Callable[[Sequence], tuple]) -> bool:
        """Swapped sequences that kept shared GPU blocks give them up and will be recomputed
        (least urgent first by `key`). Only when nothing at all could be scheduled: those kept
        blocks may be exactly what the queue head is missing. Returns whether any was demoted."""
        assert self.swapper is not None
        demoted = False
        for seq in sorted(self.swapped, key=key, reverse=True):
            if not self.swapper.holds_gpu_blocks(seq):
                continue
            self.swapper.discard(seq)
            self.kv.forget(seq)
            self.swapped.remove(seq)
            seq.num_computed_tokens = 0
            self.to_waiting(seq)
            self.num_swap_fallbacks += 1
            demoted = True
            logger.info(
                "swapped request %s (seq %d) falls back to recompute: its shared GPU blocks "
                "are needed to make progress",
                seq.request.request_id,
                seq.seq_id,
            )
        return demoted

    def make_room_for_head(
        self,
        head: Sequence,
        budget: int,
        out: "SchedulerOutput",
        seats_used: Callable[[], int],
        seats: Callable[[Sequence], int],
        max_num_seqs: int,
    ) -> None:
        """Preempt less urgent running sequences so that `head`, the most urgent queued one, can
        start (seats: running slots a sequence stands for; seats_used: those taken now)."""
        seats_left = max_num_seqs - seats_used() - seats(head)

        def fits() -> bool:
            """Could `head` start now (seats and blocks; prefix hits ignored)?"""
            if seats_used() + seats(head) > max_num_seqs:
                return False
            available = self.kv.available_for(head.request.priority)
            if head.status is not SeqStatus.SWAPPED:
                available -= self.kv.watermark(bool(self.running))
            return self.blocks_to_start(head, budget) <= available

        self.make_room(head, budget, out, fits, lambda victims: sum(seats(v) for v in victims) >= -seats_left)
