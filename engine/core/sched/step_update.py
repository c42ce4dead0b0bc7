"""A step's results applied to its sequences: computed tokens counted, sampled tokens appended.

Two moments (`Scheduler.launched` and `Scheduler.update` call these):
  * launched: the step is on the device. A sequence that samples one token at most (no fork,
    drafts or pooling) counts its computed tokens and gets a PLACEHOLDER for the sampled one
    at once, so the next step can be scheduled before this one's tokens reach the host
    (overlap scheduling); the runner feeds the real id to that next step on the device.
  * update: the sampled tokens are known. Placeholders are replaced; at a fork point the
    first token continues the parent and the others start children sharing its blocks; a
    verify step's drafts are accepted or rejected (SpecDecoder); full blocks are registered
    in the prefix cache. A plain decode's record is kept for the sequence's next decode to
    reuse (the scheduler's fast path): the step that held it is processed by then.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

from engine.core.request import SeqStatus, Sequence
from engine.core.sched.scheduler_output import PLACEHOLDER

if TYPE_CHECKING:
    from engine.core.kv.allocator import KVAllocator
    from engine.core.sched.scheduler_output import ScheduledSeq, SchedulerOutput
    from engine.core.sched.spec.decoder import SpecDecoder


class StepResults:
    def __init__(self, kv: KVAllocator, spec: SpecDecoder | None,
                 new_child: Callable[[Sequence, int], Sequence]) -> None:
        self.kv = kv
        self.spec = spec
        self.new_child = new_child  # (parent, sample index) -> a running child sharing nothing yet
        self.spare: dict[int, ScheduledSeq] = {}  # seq id -> a processed decode record to reuse

    def launched(self, out: SchedulerOutput) -> None:
        out.launched = True
        finished = SeqStatus.FINISHED
        for sched in out.seqs:
            if not sched.advances_at_launch:
                if sched.verifies and sched.seq.status is not finished:
                    self.spec.launched(sched.seq, len(sched.draft_token_ids))
                continue
            seq = sched.seq
            if seq.status is finished:
                continue  # (deferred sampling: the previous step ended it; its token here is discarded)
            seq.num_computed_tokens += len(sched.token_ids)
            if sched.do_sample:
                seq.token_ids.append(PLACEHOLDER)
                seq.num_pending += 1

    def update(self, out: SchedulerOutput, sampled: list[list[int]]) -> list[Sequence]:
        if not out.launched:
            self.launched(out)
        touched: list[Sequence] = []
        spare = self.spare
        cache_full_blocks = self.kv.cache_full_blocks
        running, finished = SeqStatus.RUNNING, SeqStatus.FINISHED
        for sched, tokens in zip(out.seqs, sampled):
            seq = sched.seq
            if seq is None or seq.status is finished:
                continue  # finished or aborted meanwhile
            if sched.advances_at_launch:
                if sched.do_sample and tokens:
                    ids = seq.token_ids
                    pending = seq.num_pending
                    ids[len(ids) - pending] = tokens[0]
                    seq.num_pending = pending - 1
                    seq.num_new_tokens = 1
                    touched.append(seq)
                    if len(sched.token_ids) == 1:
                        spare[sched.seq_id] = sched
                if seq.status is running:
                    cache_full_blocks(seq)
                continue  # (a failed row keeps its placeholder: the engine fails the request)
            if sched.verifies:
                if tokens:  # (a failed row keeps its placeholders: the engine fails the request)
                    self.spec.accept_launched(seq, sched.draft_token_ids, tokens, self.kv)
                    touched.append(seq)
                continue
            if seq.status is not SeqStatus.RUNNING:
                continue
            seq.num_computed_tokens += sched.num_tokens
            cache_full_blocks(seq)
            if not sched.do_sample or not tokens:
                continue  # (no token: the sampler failed this row, the engine fails its request)
            if sched.num_samples > 1:
                touched.extend(self.fork(seq, tokens))
            else:
                seq.token_ids.append(tokens[0])
                seq.num_new_tokens = 1
                touched.append(seq)
        return touched

    def fork(self, parent: Sequence, tokens: list[int]) -> list[Sequence]:
        """The prompt is done: tokens[0] continues the parent, each other token starts a child
        that shares the parent's blocks (copy-on-write at its first write)."""
        parent.request.forked = True
        children = []
        for index, token in enumerate(tokens[1:], start=1):
            child = self.new_child(parent, index)
            self.kv.share(parent, child)
            child.token_ids.append(token)
            child.num_new_tokens = 1
            children.append(child)
        parent.token_ids.append(tokens[0])
        parent.num_new_tokens = 1
        return [parent, *children]
