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
Queue membership (running / waiting / swapped) stays with the scheduler.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Callable, Literal

from engine.request import Sequence, SeqStatus

if TYPE_CHECKING:
    from engine.kv.allocator import KVAllocator
    from engine.scheduler import SchedulerOutput, SwapSpace

logger = logging.getLogger("engine.scheduler")  # (the log lines users know come from the scheduler)

PreemptionMode = Literal["auto", "swap", "recompute"]


class Preemptor:
    def __init__(self, mode: PreemptionMode, kv: KVAllocator, swapper: SwapSpace | None = None) -> None:
        self.mode = mode
        self.kv = kv
        self.swapper = swapper
        self.num_preemptions = 0
        self.by_mode: dict[str, int] = {"recompute": 0, "swap": 0}
        self.num_swap_fallbacks = 0  # swapped sequences turned into recompute to unblock the queue
        self.on_preempt: Callable[[Sequence, str, str], None] | None = None
        self.floor: int | None = None  # most urgent priority preempted this step

    def begin_step(self) -> None:
        self.floor = None

    # ---- victims ----
    @staticmethod
    def victim(running: list[Sequence]) -> Sequence:
        """Who gives way when blocks run out: `running` is kept most urgent first."""
        return running[-1]

    @staticmethod
    def less_urgent(running: list[Sequence], priority: int) -> list[Sequence]:
        """Running sequences a queued one of `priority` may preempt."""
        return [s for s in running if s.request.priority > priority]

    def could_free(self, victims: list[Sequence]) -> int:
        """GPU blocks preempting all of `victims` would free (shared blocks stay)."""
        return self.kv.blocks_freed_by(victims)

    # ---- preempting ----
    def mode_for(self, seq: Sequence) -> str:
        """swap: to the CPU whenever it has room; auto: also only if copying the KV out and back
        is estimated to cost less than recomputing it (SwapSpace.can_swap_out); otherwise, and
        in recompute mode, recompute."""
        if self.swapper is None or self.mode == "recompute":
            return "recompute"
        return "swap" if self.swapper.can_swap_out(seq, self.mode) else "recompute"

    def preempt(self, seq: Sequence, out: SchedulerOutput, reason: str) -> tuple[str, str]:
        """Take a sequence (already out of the running queue) off the device: swap its KV out
        (status SWAPPED) or release it for recompute (no computed tokens left). Returns the
        mode and the reason to report (see `report`)."""
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
        else:
            self.kv.release(seq)
            seq.num_computed_tokens = 0
            if self.mode != "recompute" and self.swapper is not None:
                reason += f"; not swapped ({self.swapper.num_free} CPU blocks free, {self.mode} mode)"
        return mode, reason

    def report(self, seq: Sequence, mode: str, reason: str, computed: int) -> None:
        logger.info("preempted request %s (seq %d, priority %d, %d tokens of KV) by %s: %s",
                    seq.request.request_id, seq.seq_id, seq.request.priority, computed, mode, reason)
        if self.on_preempt is not None:
            self.on_preempt(seq, mode, reason)

    # ---- swapped sequences falling back to recompute ----
    def demotable(self, swapped: list[Sequence], key: Callable[[Sequence], tuple]) -> list[Sequence]:
        """Swapped sequences that kept shared GPU blocks, least urgent first."""
        assert self.swapper is not None
        return [s for s in sorted(swapped, key=key, reverse=True) if self.swapper.holds_gpu_blocks(s)]

    def demote(self, seq: Sequence) -> None:
        """A swapped sequence gives up its swap entry and kept GPU blocks: it will be recomputed."""
        assert self.swapper is not None
        self.swapper.discard(seq)
        self.kv.forget(seq)
        seq.num_computed_tokens = 0
        self.num_swap_fallbacks += 1
        logger.info("swapped request %s (seq %d) falls back to recompute: its shared GPU blocks "
                    "are needed to make progress", seq.request.request_id, seq.seq_id)
