"""Continuous batching: decide, each step, which tokens of which sequences run.

Pure CPU over ints and lists (no torch). Each step:
  1. running sequences first (decodes, and prefills already under way), in priority order;
     when KV blocks run out, the lowest-priority / most recent running sequence is preempted
     (by swap to CPU or by recompute, see `_preemption_mode_for`);
  2. then swapped-out and waiting sequences, most urgent first (priority, swapped before
     waiting at equal priority, then arrival order): swapped ones come back, waiting ones are
     admitted, their prompts chunked to fit the token budget; prefix-cache hits skip the
     blocks already computed.
Before 1., a waiting or swapped sequence more urgent than some running ones may preempt
them to make room (lower `priority` value = more urgent). A step that preempted admits only
sequences strictly more urgent than everything it preempted (no thrash).
The step's work is a SchedulerOutput of plain values that the runner turns into tensors.
"""

from __future__ import annotations

import bisect
import dataclasses
import heapq
import itertools
import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Literal

from engine.kv.block_pool import BlockPool

if TYPE_CHECKING:
    from engine.spec_decode import NgramProposer
from engine.request import FinishReason, InvalidRequestError, Request, SamplingParams, Sequence, SeqStatus
from engine.tasks import GENERATE, Task, task_of

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    block_size: int
    enable_chunked_prefill: bool = True
    preemption_mode: Literal["auto", "swap", "recompute"] = "recompute"
    reserved_blocks_fraction: float = 0.0
    reserved_priority: int = 0
    watermark_fraction: float = 0.01


@dataclass
class ScheduledSeq:
    """One sequence's share of a step: `token_ids` at positions start_pos.. are computed."""

    seq_id: int
    token_ids: list[int]
    start_pos: int
    block_ids: list[int]  # the whole block table (shared list; read it, don't keep it)
    do_sample: bool  # the chunk reaches the end of the sequence: sample the next token
    num_samples: int  # n > 1 at a request's fork point, else 1
    params: SamplingParams
    all_token_ids: list[int]  # prompt + output so far (for penalties)
    num_prompt_tokens: int
    sample_index: int
    grammars: list | None = None  # the request's grammar matchers, by sample index (structured outputs)
    # Speculative decoding: token_ids is [last token, *drafts]; every position is sampled.
    draft_token_ids: list[int] = field(default_factory=list)
    task: Task = GENERATE  # what the step is for (engine/tasks.py)
    seq: Sequence | None = None  # the sequence itself (its state moves on after the step is launched)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def advances_at_launch(self) -> bool:
        """One sampled token at most and no fork, drafts or task results: the scheduler counts the
        tokens computed, and a placeholder for the sampled one, as soon as the step is launched."""
        return not self.draft_token_ids and self.num_samples == 1 and self.task.text_output


def sample_row_ranges(seqs: list[ScheduledSeq]):
    """(scheduled seq, range of its rows in the step's flat sampler output): one row per
    sampling sequence, n at a fork point, none for a prefill chunk that does not end the prompt."""
    k = 0
    for s in seqs:
        n = s.task.sample_rows(s)
        yield s, range(k, k + n)
        k += n


# Stand-in for a token a launched step samples, until the host learns it (overlap scheduling);
# the runner feeds the real id to the next step on the device.
PLACEHOLDER = -1


@dataclass
class SchedulerOutput:
    seqs: list[ScheduledSeq] = field(default_factory=list)
    blocks_to_copy: list[tuple[int, int]] = field(default_factory=list)  # copy-on-write
    blocks_to_swap_out: list[tuple[int, int]] = field(default_factory=list)  # gpu -> cpu
    blocks_to_swap_in: list[tuple[int, int]] = field(default_factory=list)  # cpu -> gpu
    preempted: list[int] = field(default_factory=list)  # seq ids
    num_prefill_tokens: int = 0
    num_decode_tokens: int = 0
    launched: bool = False  # Scheduler.launched() has advanced its sequences

    @property
    def num_tokens(self) -> int:
        return self.num_prefill_tokens + self.num_decode_tokens

    @property
    def is_empty(self) -> bool:
        return (not self.seqs and not self.blocks_to_copy and not self.blocks_to_swap_out
                and not self.blocks_to_swap_in)


class Scheduler:
    def __init__(self, config: SchedulerConfig, pool: BlockPool,
                 swapper: "SwapSpace | None" = None, proposer: "NgramProposer | None" = None) -> None:
        self.config = config
        self.pool = pool
        self.swapper = swapper
        self.proposer = proposer  # speculative decoding: drafts for decoding sequences
        self.num_draft_tokens = 0
        self.num_drafts = 0  # (sequence, step) pairs that had drafts
        self.num_accepted_tokens = 0
        self.waiting: list[Sequence] = []
        self.running: list[Sequence] = []
        self.swapped: list[Sequence] = []
        self.requests: dict[str, Request] = {}
        self._seq_ids = itertools.count()
        self._arrival = itertools.count()
        self._order: dict[int, int] = {}  # seq id -> admission order (FCFS tie-break)
        self._digests: dict[int, list[bytes]] = {}  # seq id -> digests of its cached full blocks
        self.num_preemptions = 0
        self.preemptions_by_mode: dict[str, int] = {"recompute": 0, "swap": 0}
        self.num_swap_fallbacks = 0  # swapped sequences turned into recompute to unblock the queue
        self.on_preempt: Callable[[Sequence, str, str], None] | None = None
        self._preempted_floor: int | None = None  # most urgent priority preempted this step

    # ---- requests in and out ----
    def add_request(self, request: Request) -> None:
        """Validate against the model length and the pool, then queue the request."""
        prompt_len = len(request.prompt_token_ids)
        limit = self.config.max_model_len
        if prompt_len == 0:
            raise InvalidRequestError("the prompt is empty", "prompt")
        if request.request_id in self.requests:
            raise InvalidRequestError(f"request id {request.request_id!r} is already in use", "request_id")
        params = request.params
        if params.n > self.config.max_num_seqs:
            raise InvalidRequestError(
                f"n={params.n} samples exceed max_num_seqs={self.config.max_num_seqs}", "n")
        if prompt_len >= limit:
            raise InvalidRequestError(
                f"the prompt has {prompt_len} tokens, which leaves no room to generate within "
                f"max_model_len={limit}", "prompt")
        max_tokens = params.max_tokens if params.max_tokens is not None else limit - prompt_len
        if prompt_len + max_tokens > limit:
            raise InvalidRequestError(
                f"prompt ({prompt_len} tokens) + max_tokens ({max_tokens}) = "
                f"{prompt_len + max_tokens} exceeds max_model_len={limit}", "max_tokens")
        needed = -(-(prompt_len + max_tokens) // self.config.block_size)
        # Pinned (warm-up) blocks are never freed; the reserve is out of reach of less urgent requests.
        usable = self.pool.num_usable - self.pool.num_pinned
        if request.priority > self.config.reserved_priority:
            usable -= self._reserved_blocks()
        if needed > usable:
            raise InvalidRequestError(
                f"the request needs up to {needed} KV blocks but the cache holds only "
                f"{usable} for priority {request.priority}", "max_tokens")
        if params.max_tokens is None:
            # The request keeps its own copy: the caller's SamplingParams may serve other prompts.
            request.params = dataclasses.replace(params, max_tokens=max_tokens, stop=list(params.stop),
                                                 stop_token_ids=list(params.stop_token_ids))
        seq = self._new_seq(request, 0, list(request.prompt_token_ids))
        request.seqs = [seq]
        self.requests[request.request_id] = request
        self._insert_waiting(seq)

    def _new_seq(self, request: Request, index: int, tokens: list[int]) -> Sequence:
        seq = Sequence(seq_id=next(self._seq_ids), request=request, sample_index=index,
                       token_ids=tokens, num_prompt_tokens=len(request.prompt_token_ids))
        self._order[seq.seq_id] = next(self._arrival)
        return seq

    def abort_request(self, request_id: str) -> Request | None:
        request = self.requests.get(request_id)
        if request is None:
            return None
        for seq in request.seqs:
            if not seq.is_finished:
                self.finish_seq(seq, FinishReason.ABORT)
        return request

    def finish_seq(self, seq: Sequence, reason: FinishReason, stop_reason: int | str | None = None) -> None:
        """Mark a sequence done and release everything it holds, at once."""
        if seq.is_finished:
            return
        self._remove_from_queues(seq)
        if seq.num_pending:  # tokens of launched steps that will never be shown
            del seq.token_ids[len(seq.token_ids) - seq.num_pending:]
            seq.num_pending = 0
        if seq.status is SeqStatus.SWAPPED and self.swapper is not None:
            self.swapper.discard(seq)
            self._digests.pop(seq.seq_id, None)
        else:
            self._release_blocks(seq)
        seq.status = SeqStatus.FINISHED
        seq.finish_reason = reason
        seq.stop_reason = stop_reason

    def pop_finished_request(self, request_id: str) -> Request | None:
        request = self.requests.get(request_id)
        if request is not None and request.is_finished:
            del self.requests[request_id]
            for seq in request.seqs:
                self._order.pop(seq.seq_id, None)
            return request
        return None

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.swapped)

    @property
    def num_requests_swapped(self) -> int:
        """Requests with at least one sequence swapped out (metric num_requests_swapped)."""
        return len({s.request.request_id for s in self.swapped})

    # ---- the step ----
    def _priority_key(self, seq: Sequence) -> tuple[int, int]:
        return (seq.request.priority, self._order[seq.seq_id])

    def _insert_waiting(self, seq: Sequence) -> None:
        seq.status = SeqStatus.WAITING
        bisect.insort(self.waiting, seq, key=self._priority_key)

    def _admit_key(self, seq: Sequence) -> tuple[int, int, int]:
        """Queue order for room: priority, swapped before waiting at equal priority, arrival."""
        return (seq.request.priority, 0 if seq.status is SeqStatus.SWAPPED else 1, self._order[seq.seq_id])

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        self._preempted_floor = None
        if self.swapper is not None:
            self.swapper.begin_step()

        # 0. A more urgent waiting or swapped sequence may preempt less urgent running ones.
        self.running.sort(key=self._priority_key)
        self._preempt_for_priority(out, budget)

        # 1. Running sequences, highest priority first; preempt from the back when short of blocks.
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            num_new = min(seq.num_tokens - seq.num_computed_tokens, budget)
            if num_new <= 0 or (seq.num_pending and self._reached_length(seq)):
                i += 1  # (one whose launched step ends it by length gets no extra token)
                continue
            drafts = self._drafts(seq, budget) if num_new == 1 else []
            if drafts and self._can_grow(seq, 1 + len(drafts)):
                num_new = 1 + len(drafts)  # drafts only where blocks are free: they never preempt
            else:
                drafts = []
            while not self._can_grow(seq, num_new):
                victim = self.running[-1]
                self._preempt(victim, out, reason="out of KV blocks")
                if victim is seq:
                    break
            if seq.status is not SeqStatus.RUNNING:
                break  # it preempted itself: everything after it is gone too
            self._grow(seq, num_new, out)
            self._emit(seq, num_new, out, drafts)
            budget -= num_new
            i += 1

        # 2. Swapped and waiting sequences, most urgent first, while seats, budget and blocks last.
        budget = self._admit(out, budget)
        if not out.seqs and not self.running and self.swapped:
            # Nothing can run: the GPU blocks that swapped sequences kept may be what is missing.
            if self._demote_swapped():
                budget = self._admit(out, budget)
        # One-token sequences first: backends attend decodes and prefill chunks separately.
        out.seqs.sort(key=lambda s: s.num_tokens != 1)
        return out

    def _queue(self):
        """Swapped and waiting sequences in admission order (waiting is kept sorted already)."""
        return heapq.merge(sorted(self.swapped, key=self._admit_key), list(self.waiting), key=self._admit_key)

    def _admit(self, out: SchedulerOutput, budget: int) -> int:
        for seq in self._queue():
            if self._preempted_floor is not None and seq.request.priority >= self._preempted_floor:
                break  # this step preempted something at least as urgent: don't take its room
            if budget <= 0 or self._seats_used() + self._seats(seq) > self.config.max_num_seqs:
                break
            if seq.status is SeqStatus.SWAPPED:
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
        remaining = seq.num_tokens - seq.num_computed_tokens
        if not self.config.enable_chunked_prefill and remaining > budget:
            if out.seqs:
                self._drop_prefix_hits(seq)
                return None  # wait for a step with room for the whole prompt
            if remaining > self.config.max_num_batched_tokens:
                raise AssertionError("unchunkable prompt beyond the token budget passed validation")
        num_new = min(remaining, budget)
        if not self._can_admit(seq, num_new):
            self._drop_prefix_hits(seq)
            return None
        if seq.num_output_tokens == 0 and seq.num_preemptions == 0:
            self.pool.record_prefix_query(seq.num_prompt_tokens, hit_tokens)
        self._grow(seq, num_new, out)
        self.waiting.remove(seq)
        seq.status = SeqStatus.RUNNING
        self.running.append(seq)
        self._emit(seq, num_new, out)
        return budget - num_new

    @staticmethod
    def _seats(seq: Sequence) -> int:
        """Running slots a sequence stands for: a request that will fork holds all n."""
        return seq.request.params.n if not seq.request.forked else 1

    def _seats_used(self) -> int:
        return sum(self._seats(s) for s in self.running)

    def _take_prefix_hits(self, seq: Sequence) -> int:
        """Reuse cached full blocks; always leave one token to compute for logits.

        Returns how many prompt tokens were found in the cache.
        """
        request = seq.request
        if not self.pool.enable_prefix_caching or not task_of(request).prefix_cacheable:
            return 0  # (e.g. prompt logprobs need every prompt position computed)
        max_blocks = (seq.num_tokens - 1) // self.config.block_size
        blocks, digests = self.pool.match_prefix(seq.token_ids, max_blocks, seq.request.prefix_root)
        for block in blocks:
            self.pool.incref(block)
        seq.block_ids = list(blocks)
        seq.num_computed_tokens = len(blocks) * self.config.block_size
        seq.num_cached_tokens = min(seq.num_computed_tokens, seq.num_prompt_tokens)
        self._digests[seq.seq_id] = list(digests)
        return seq.num_cached_tokens

    def _drop_prefix_hits(self, seq: Sequence) -> None:
        self._release_blocks(seq)
        seq.num_computed_tokens = 0
        seq.num_cached_tokens = 0

    def _blocks_needed(self, seq: Sequence, num_new: int) -> int:
        total = -(-(seq.num_computed_tokens + num_new) // self.config.block_size)
        need = max(0, total - len(seq.block_ids))
        # Copy-on-write: the first write into a shared partial block needs a private copy.
        if seq.num_computed_tokens % self.config.block_size and seq.block_ids:
            last = seq.block_ids[(seq.num_computed_tokens - 1) // self.config.block_size]
            if self.pool.ref_count(last) > 1:
                need += 1
        return need

    def _can_grow(self, seq: Sequence, num_new: int) -> bool:
        return self._blocks_needed(seq, num_new) <= self._available_for(seq)

    def _can_admit(self, seq: Sequence, num_new: int) -> bool:
        return self._blocks_needed(seq, num_new) <= self._available_for(seq) - self._watermark()

    def _watermark(self) -> int:
        # Room kept for running sequences to grow; with none running it would only lock out a
        # sequence that needs the whole cache.
        return int(self.config.watermark_fraction * self.pool.num_usable) if self.running else 0

    def _reserved_blocks(self) -> int:
        return int(self.config.reserved_blocks_fraction * self.pool.num_usable)

    def _available_for(self, seq: Sequence) -> int:
        """Blocks this sequence may take: the reserve is only for high-priority requests."""
        available = self.pool.num_available
        if seq.request.priority > self.config.reserved_priority:
            available -= self._reserved_blocks()
        return available

    def _grow(self, seq: Sequence, num_new: int, out: SchedulerOutput) -> None:
        bs = self.config.block_size
        if seq.num_computed_tokens % bs and seq.block_ids:
            idx = (seq.num_computed_tokens - 1) // bs
            last = seq.block_ids[idx]
            if self.pool.ref_count(last) > 1:
                fresh = self.pool.allocate()
                out.blocks_to_copy.append((last, fresh))
                self.pool.free(last)
                seq.block_ids[idx] = fresh
                seq.table_version += 1  # (the runner's block-table row must be rewritten)
        total = -(-(seq.num_computed_tokens + num_new) // bs)
        if total > len(seq.block_ids):
            seq.block_ids.extend(self.pool.allocate_many(total - len(seq.block_ids)))

    def _reached_length(self, seq: Sequence) -> bool:
        """seq's newest token (known or not) ends it by max_tokens or max_model_len."""
        max_tokens = seq.request.params.max_tokens
        return ((max_tokens is not None and seq.num_output_tokens >= max_tokens)
                or seq.num_tokens >= self.config.max_model_len)

    def _drafts(self, seq: Sequence, budget: int) -> list[int]:
        """Speculative draft tokens for a decoding sequence ([] when off or not applicable).
        Drafts stay within the token budget, max_model_len and the request's max_tokens (the
        step adds up to len(drafts) + 1 tokens); constrained requests get none."""
        request = seq.request
        if self.proposer is None or request.grammars or seq.num_computed_tokens < seq.num_prompt_tokens:
            return []
        room = min(budget - 1, self.config.max_model_len - seq.num_tokens - 1)
        if request.params.max_tokens is not None:
            room = min(room, request.params.max_tokens - seq.num_output_tokens - 1)
        return self.proposer.propose(seq, room) if room > 0 else []

    def _emit(self, seq: Sequence, num_new: int, out: SchedulerOutput, drafts: list[int] | None = None) -> None:
        request = seq.request
        start = seq.num_computed_tokens
        drafts = drafts or []
        do_sample = start + num_new - len(drafts) == seq.num_tokens
        fork = do_sample and request.params.n > 1 and not request.forked
        out.seqs.append(ScheduledSeq(
            seq_id=seq.seq_id, token_ids=seq.token_ids[start:start + num_new - len(drafts)] + drafts,
            start_pos=start, block_ids=seq.block_ids, do_sample=do_sample,
            num_samples=request.params.n if fork else 1, params=request.params,
            all_token_ids=seq.token_ids, num_prompt_tokens=seq.num_prompt_tokens,
            sample_index=seq.sample_index, grammars=request.grammars, draft_token_ids=drafts,
            task=task_of(request),
            seq=seq,
        ))
        if drafts:
            out.num_decode_tokens += num_new
        elif num_new == 1 and start + 1 == seq.num_tokens and start >= seq.num_prompt_tokens:
            out.num_decode_tokens += 1
        else:
            out.num_prefill_tokens += num_new
        if request.first_scheduled_time is None:
            request.first_scheduled_time = time.monotonic()

    # ---- preemption ----
    def _preempt(self, seq: Sequence, out: SchedulerOutput, reason: str) -> None:
        mode = self._preemption_mode_for(seq)
        if self.config.preemption_mode == "auto" and self.swapper is not None:
            estimate = self.swapper.auto_estimate(seq)
            if estimate is not None:
                reason += f"; estimated swap {estimate[0] * 1e3:.2f} ms vs recompute {estimate[1] * 1e3:.2f} ms"
        self.running.remove(seq)
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.preemptions_by_mode[mode] += 1
        out.preempted.append(seq.seq_id)
        prio = seq.request.priority
        if self._preempted_floor is None or prio < self._preempted_floor:
            self._preempted_floor = prio
        computed = seq.num_computed_tokens
        if mode == "swap":
            assert self.swapper is not None
            out.blocks_to_swap_out.extend(self.swapper.swap_out(seq))
            seq.status = SeqStatus.SWAPPED
            self.swapped.append(seq)
        else:
            self._release_blocks(seq)
            seq.num_computed_tokens = 0
            self._insert_waiting(seq)
            if self.config.preemption_mode != "recompute" and self.swapper is not None:
                reason += (f"; not swapped ({self.swapper.num_free} CPU blocks free, "
                           f"{self.config.preemption_mode} mode)")
        logger.info("preempted request %s (seq %d, priority %d, %d tokens of KV) by %s: %s",
                    seq.request.request_id, seq.seq_id, prio, computed, mode, reason)
        if self.on_preempt is not None:
            self.on_preempt(seq, mode, reason)

    def _preemption_mode_for(self, seq: Sequence) -> str:
        """swap: to the CPU whenever it has room; auto: also only if copying the KV out and back
        is estimated to cost less than recomputing it (SwapSpace.can_swap_out); otherwise, and
        in recompute mode, recompute."""
        mode = self.config.preemption_mode
        if self.swapper is None or mode == "recompute":
            return "recompute"
        return "swap" if self.swapper.can_swap_out(seq, mode) else "recompute"

    def _fits(self, seq: Sequence, budget: int) -> bool:
        """Could this waiting or swapped sequence start now (seats and blocks; prefix hits ignored)?"""
        if self._seats_used() + self._seats(seq) > self.config.max_num_seqs:
            return False
        num_new = min(seq.num_tokens - seq.num_computed_tokens, budget)
        if seq.status is SeqStatus.SWAPPED:
            assert self.swapper is not None
            return self.swapper.blocks_to_resume(seq, num_new) <= self._available_for(seq)
        return self._blocks_needed(seq, num_new) <= self._available_for(seq) - self._watermark()

    def _blocks_freed_by(self, victims: list[Sequence]) -> int:
        """GPU blocks preempting all of `victims` would free: those no one else references."""
        held: dict[int, int] = {}
        for v in victims:
            for b in v.block_ids:
                held[b] = held.get(b, 0) + 1
        return sum(1 for b, n in held.items() if self.pool.ref_count(b) == n)

    def _preempt_for_priority(self, out: SchedulerOutput, budget: int) -> None:
        """Preempt less urgent running sequences so that the most urgent queued one can start."""
        if not self.running or not (self.waiting or self.swapped):
            return
        head = next(self._queue())
        prio = head.request.priority
        victims = [s for s in self.running if s.request.priority > prio]
        if not victims or self._fits(head, budget):
            return
        # Only if the victims' seats and blocks can make room at all: never preempt for nothing.
        seats = self._seats_used() - sum(self._seats(v) for v in victims) + self._seats(head)
        blocks = self._available_for(head) + self._blocks_freed_by(victims)
        num_new = min(head.num_tokens - head.num_computed_tokens, budget)
        need = (self.swapper.blocks_to_resume(head, num_new) if head.status is SeqStatus.SWAPPED
                and self.swapper is not None else self._blocks_needed(head, num_new))
        if seats > self.config.max_num_seqs or need > blocks:
            return
        reason = f"request {head.request.request_id} of priority {prio} needs room"
        while self.running and self.running[-1].request.priority > prio and not self._fits(head, budget):
            self._preempt(self.running[-1], out, reason=reason)

    def _try_swap_in(self, seq: Sequence, out: SchedulerOutput, budget: int) -> int | None:
        """Bring one swapped sequence back (and schedule its next tokens); None if it can't."""
        assert self.swapper is not None
        num_new = min(seq.num_tokens - seq.num_computed_tokens, budget)
        if self.swapper.blocks_to_resume(seq, num_new) > self._available_for(seq):
            return None
        out.blocks_to_swap_in.extend(self.swapper.swap_in(seq))
        self.swapped.remove(seq)
        seq.status = SeqStatus.RUNNING
        self.running.append(seq)
        if num_new > 0:
            self._grow(seq, num_new, out)
            self._emit(seq, num_new, out)
        return budget - num_new

    def _demote_swapped(self) -> bool:
        """Swapped sequences that kept shared GPU blocks give them up and will be recomputed.

        Only when nothing at all could be scheduled: those kept blocks may be exactly what the
        queue head is missing. Returns whether any sequence was demoted.
        """
        assert self.swapper is not None
        demoted = False
        for seq in sorted(self.swapped, key=self._admit_key, reverse=True):
            if not self.swapper.holds_gpu_blocks(seq):
                continue
            self.swapper.discard(seq)
            self._digests.pop(seq.seq_id, None)
            self.swapped.remove(seq)
            seq.num_computed_tokens = 0
            self._insert_waiting(seq)
            self.num_swap_fallbacks += 1
            demoted = True
            logger.info("swapped request %s (seq %d) falls back to recompute: its shared GPU blocks "
                        "are needed to make progress", seq.request.request_id, seq.seq_id)
        return demoted

    # ---- after the step ----
    def launched(self, out: SchedulerOutput) -> None:
        """The step is on the device: count its computed tokens and, for each sequence it samples
        one token for, append a PLACEHOLDER now, so the next step can be scheduled before this
        one's tokens reach the host (forks, drafts and pooling wait for update())."""
        out.launched = True
        for sched in out.seqs:
            if not sched.advances_at_launch:
                continue
            seq = sched.seq
            seq.num_computed_tokens += sched.num_tokens
            if sched.do_sample:
                seq.token_ids.append(PLACEHOLDER)
                seq.num_pending += 1

    def update(self, out: SchedulerOutput, sampled: list[list[int]]) -> list[Sequence]:
        """Take in a step's sampled tokens; returns the sequences that got tokens.

        sampled[i] holds the tokens for out.seqs[i]: [] when it did not sample (or its row
        failed), one token, or n tokens at a fork point (the first continues the parent, the
        rest start children). A sequence finished or preempted since the launch still gets
        its placeholder replaced (it is checked like any other); a finished one is skipped.
        """
        if not out.launched:
            self.launched(out)
        touched: list[Sequence] = []
        for sched, tokens in zip(out.seqs, sampled):
            seq = sched.seq
            if seq is None or seq.is_finished:
                continue  # finished or aborted meanwhile
            if sched.advances_at_launch:
                if sched.do_sample and tokens:
                    seq.token_ids[len(seq.token_ids) - seq.num_pending] = tokens[0]
                    seq.num_pending -= 1
                    seq.num_new_tokens = 1
                    touched.append(seq)
                if seq.status is SeqStatus.RUNNING:
                    self._cache_full_blocks(seq)
                continue  # (a failed row keeps its placeholder: the engine fails the request)
            if seq.status is not SeqStatus.RUNNING:
                continue
            if sched.draft_token_ids and tokens:
                self._accept_drafts(seq, sched.draft_token_ids, tokens)
                touched.append(seq)
                continue
            seq.num_computed_tokens += sched.num_tokens
            self._cache_full_blocks(seq)
            if not sched.do_sample or not tokens:
                continue  # (no token: the sampler failed this row, the engine fails its request)
            if sched.num_samples > 1:
                touched.extend(self._fork(seq, tokens))
            else:
                seq.token_ids.append(tokens[0])
                seq.num_new_tokens = 1
                touched.append(seq)
        return touched

    def _accept_drafts(self, seq: Sequence, drafts: list[int], sampled: list[int]) -> None:
        """Keep the drafts up to the first the model did not sample, plus the model's token there
        (or after the last draft). KV is valid for the last token and the kept drafts; what the
        rejected drafts wrote is beyond num_computed_tokens and is overwritten later."""
        accepted = 0
        while accepted < len(drafts) and sampled[accepted] == drafts[accepted]:
            accepted += 1
        seq.token_ids.extend(sampled[:accepted + 1])
        seq.num_new_tokens = accepted + 1
        seq.num_computed_tokens += 1 + accepted
        self._cache_full_blocks(seq)
        self.num_draft_tokens += len(drafts)
        self.num_drafts += bool(drafts)
        self.num_accepted_tokens += accepted
        if self.proposer is not None:
            self.proposer.feedback(seq, accepted)

    def _fork(self, parent: Sequence, tokens: list[int]) -> list[Sequence]:
        request = parent.request
        request.forked = True
        children = []
        for index, token in enumerate(tokens[1:], start=1):
            child = self._new_seq(request, index, list(parent.token_ids))
            child.num_computed_tokens = parent.num_computed_tokens
            child.num_cached_tokens = parent.num_cached_tokens
            for block in parent.block_ids:
                self.pool.incref(block)
            child.block_ids = list(parent.block_ids)
            self._digests[child.seq_id] = list(self._digests.get(parent.seq_id, []))
            child.status = SeqStatus.RUNNING
            child.token_ids.append(token)
            child.num_new_tokens = 1
            request.seqs.append(child)
            self.running.append(child)
            children.append(child)
        parent.token_ids.append(tokens[0])
        parent.num_new_tokens = 1
        return [parent, *children]

    def _cache_full_blocks(self, seq: Sequence) -> None:
        if not self.pool.enable_prefix_caching:
            return
        bs = self.config.block_size
        digests = self._digests.setdefault(seq.seq_id, [])
        # Only blocks whose tokens are all known (a placeholder is not hashed).
        full = min(seq.num_computed_tokens, len(seq.token_ids) - seq.num_pending) // bs
        while len(digests) < full:
            i = len(digests)
            parent = digests[-1] if digests else seq.request.prefix_root
            digests.append(self.pool.cache_block(seq.block_ids[i], parent, seq.token_ids[i * bs:(i + 1) * bs]))

    # ---- bookkeeping ----
    def _remove_from_queues(self, seq: Sequence) -> None:
        for queue in (self.waiting, self.running, self.swapped):
            if seq in queue:
                queue.remove(seq)

    def _release_blocks(self, seq: Sequence) -> None:
        self.pool.free_all(seq.block_ids)
        seq.block_ids = []
        self._digests.pop(seq.seq_id, None)

    def block_references(self) -> dict[int, int]:
        refs: dict[int, int] = {}
        for seq in itertools.chain(self.running, self.waiting):
            for block in seq.block_ids:
                refs[block] = refs.get(block, 0) + 1
        if self.swapper is not None:  # shared blocks that swapped sequences kept on the GPU
            for block, count in self.swapper.gpu_references().items():
                refs[block] = refs.get(block, 0) + count
        return refs

    def check_integrity(self) -> None:
        """The pool's own invariants plus: every reference is held by a live sequence."""
        self.pool.check_integrity(self.block_references())
        if self.swapper is not None:
            self.swapper.check_integrity(self.swapped)
        ids = [s.seq_id for s in itertools.chain(self.waiting, self.running, self.swapped)]
        assert len(ids) == len(set(ids)), "a sequence is queued twice"
        for seq in self.running:
            assert seq.status is SeqStatus.RUNNING
            assert len(seq.block_ids) * self.config.block_size >= seq.num_computed_tokens
        for seq in self.waiting:
            assert seq.status is SeqStatus.WAITING
        for seq in self.swapped:
            assert seq.status is SeqStatus.SWAPPED
        assert len(self.running) <= self.config.max_num_seqs, "more running sequences than max_num_seqs"

    def fragmentation(self) -> float:
        """Allocated slots not holding a computed token / allocated slots."""
        slots = 0
        used = 0
        for seq in self.running:
            slots += len(seq.block_ids) * self.config.block_size
            used += seq.num_computed_tokens
        return (slots - used) / slots if slots else 0.0


class SwapSpace:  # pragma: no cover - the protocol; engine/kv/swap.py implements it
    def begin_step(self) -> None: ...
    def can_swap_out(self, seq: Sequence, mode: str) -> bool: ...
    def swap_out(self, seq: Sequence) -> list[tuple[int, int]]: ...
    def swap_in(self, seq: Sequence) -> list[tuple[int, int]]: ...
    def blocks_needed(self, seq: Sequence) -> int: ...
    def blocks_to_resume(self, seq: Sequence, num_new: int) -> int: ...
    def holds_gpu_blocks(self, seq: Sequence) -> bool: ...
    def gpu_references(self) -> dict[int, int]: ...
    def discard(self, seq: Sequence) -> None: ...
    def check_integrity(self, swapped: list[Sequence]) -> None: ...
    num_free: int
