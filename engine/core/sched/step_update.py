"""A step's results applied to its sequences, in one pass: the core is the one owner of a
sequence's tokens.

Two moments (`Scheduler.launched` and `Scheduler.update_from_output` call these):
  * launched: the step is on the device. A sequence that samples one token at most (no fork,
    drafts or pooling) counts its computed tokens and gets a PLACEHOLDER for the sampled one
    at once, so the next step can be scheduled before this one's tokens reach the host
    (overlap scheduling); the runner feeds the real id to that next step on the device.
  * update: the sampled tokens are known. For each scheduled sequence, once: placeholders are
    replaced (at a fork point the first token continues the parent and the others start
    children sharing its blocks; a verify step's drafts are accepted or rejected by the
    SpecDecoder), full blocks are registered in the prefix cache, each new token advances the
    grammar and meets the token-level stops (EOS, stop_token_ids, max_tokens, max_model_len,
    min_tokens, ignore_eos, a complete grammar), and a sequence that ends gives its blocks
    back at once. Tokens after the one that ends a sequence are dropped. What is new goes out
    as a RequestUpdate per request (engine/core/outputs.py); text, stop strings and logprob
    formatting are the output side's (engine/runtime/output_processor.py).
A plain decode's record is kept for the sequence's next decode to reuse (the scheduler's fast
path): the step that held it is processed by then.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Callable

from engine.core.outputs import FinishReason, RequestUpdate, SamplerOutput, SeqUpdate
from engine.core.params import SamplingParams
from engine.core.request import Request, SeqStatus, Sequence
from engine.core.sched.scheduler_output import PLACEHOLDER, sample_row_ranges

if TYPE_CHECKING:
    from engine.core.kv.allocator import KVAllocator
    from engine.core.sched.drafts import Drafts
    from engine.core.sched.scheduler_output import ScheduledSeq, SchedulerOutput

logger = logging.getLogger(__name__)

_STOP, _LENGTH = FinishReason.STOP, FinishReason.LENGTH
_FINISHED = SeqStatus.FINISHED


def token_stop(
    params: SamplingParams,
    token: int,
    num_output: int,
    num_tokens: int,
    eos_token_ids: tuple[int, ...],
    max_model_len: int,
) -> tuple[FinishReason, int | None, bool] | None:
    """Does `token`, the sequence's output token number `num_output` (its token number
    `num_tokens` in all), end it? (reason, stop_reason, ended by a stop token) or None."""
    if num_output >= params.min_tokens:
        if token in eos_token_ids and not params.ignore_eos:
            return _STOP, None, True
        if token in (params.stop_token_ids or ()):
            return _STOP, token, True
    max_tokens = params.max_tokens
    if (max_tokens is not None and num_output >= max_tokens) or num_tokens >= max_model_len:
        return _LENGTH, None, False
    return None


class StepResults:
    def __init__(
        self,
        kv: KVAllocator,
        spec: Drafts | None,
        new_child: Callable[[Sequence, int], Sequence],
        finish_seq: Callable[[Sequence, FinishReason, int | str | None], None],
        pop_request: Callable[[str], Request | None],
        eos_token_ids: tuple[int, ...],
        max_model_len: int,
        seqs_by_id: dict[int, Sequence],
    ) -> None:
        self.kv = kv
        self.spec = spec
        self.new_child = new_child  # (parent, sample index) -> a running child sharing nothing yet
        self.finish_seq = finish_seq  # the scheduler's: releases everything the sequence holds
        self.pop_request = pop_request
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len
        # The scheduler's: the message names sequences by id, the core looks them up here.
        self.seqs_by_id = seqs_by_id
        self.spare: dict[int, ScheduledSeq] = {}  # seq id -> a processed decode record to reuse
        self.num_generated = 0  # output tokens the last update kept

    def launched(self, out: SchedulerOutput) -> None:
        out.launched = True
        finished = SeqStatus.FINISHED
        seq_of = self.seqs_by_id.get
        for sched in out.seqs:
            seq = seq_of(sched.seq_id)
            if seq is None or seq.status is finished:
                continue  # (deferred sampling: the previous step ended it; its token here is discarded)
            if not sched.advances_at_launch:
                if sched.verifies:
                    assert self.spec is not None  # (only speculative decoding schedules verify steps)
                    self.spec.launched(seq, len(sched.draft_token_ids))
                continue
            seq.num_computed_tokens += len(sched.token_ids)
            if sched.do_sample:
                seq.token_ids.append(PLACEHOLDER)
                seq.num_pending += 1

    # ---- the one pass ----
    def update(self, out: SchedulerOutput, sampled: SamplerOutput) -> list[RequestUpdate]:
        """Apply a step's sampled tokens (see the module docstring); returns the updates to hand
        to the output side."""
        if not out.launched:
            self.launched(out)
        now = time.monotonic()
        news: dict[str, Request] = {}  # requests with something to hand out
        failed = self._failed_rows(out, sampled.errors) if sampled.errors else {}
        if sampled.task_results:
            self._record_tasks(out, sampled.task_results, news, now)
        if out.num_prefill_tokens == 0 and out.num_decode_tokens == len(out.seqs):
            tokens = [[t] for t in sampled.token_ids]  # (a decode step: one row per sequence, in order)
        else:
            tokens = [[sampled.token_ids[r] for r in rows] for _, rows in sample_row_ranges(out.seqs)]
        spare = self.spare
        cache_full_blocks = self.kv.cache_full_blocks
        took = self._took
        running, finished = SeqStatus.RUNNING, SeqStatus.FINISHED
        seq_of = self.seqs_by_id.get
        generated = 0
        for sched, toks in zip(out.seqs, tokens):
            seq = seq_of(sched.seq_id)
            if seq is None or seq.status is finished:
                continue  # finished or aborted meanwhile
            if failed and sched.seq_id in failed:
                toks = []  # no token for a failed row: its request is failed below
            if sched.advances_at_launch:
                if sched.do_sample and toks:
                    ids = seq.token_ids
                    at = len(ids) - seq.num_pending
                    ids[at] = toks[0]
                    seq.num_pending -= 1
                    seq.num_new_tokens = 1
                    if len(sched.token_ids) == 1:
                        spare[sched.seq_id] = sched
                    if seq.status is running:
                        cache_full_blocks(seq)
                    generated += took(seq, at, news, failed, now)
                elif seq.status is running:
                    cache_full_blocks(seq)
            elif sched.verifies:
                if toks:  # (a failed row keeps its placeholders: its request is failed below)
                    assert self.spec is not None
                    at = len(seq.token_ids) - seq.num_pending  # (this step's placeholders come first)
                    drafts = sampled.drafts.get(sched.seq_id) if sampled.drafts else None
                    self.spec.accept_launched(seq, drafts or sched.draft_token_ids, toks, self.kv)
                    generated += took(seq, at, news, failed, now)
            elif seq.status is not running:
                continue
            else:
                seq.num_computed_tokens += sched.num_tokens
                cache_full_blocks(seq)
                if sched.do_sample and toks:
                    if sched.num_samples > 1:
                        for s in self.fork(seq, toks):
                            generated += took(s, len(s.token_ids) - 1, news, failed, now)
                    else:
                        seq.token_ids.append(toks[0])
                        seq.num_new_tokens = 1
                        generated += took(seq, len(seq.token_ids) - 1, news, failed, now)
        if failed:
            self._fail_rows(out, failed, news)
        self.num_generated = generated
        return self._updates(news, sampled.logprobs, out, now)

    def _took(self, seq: Sequence, first: int, news: dict[str, Request], failed: dict[int, str], now: float) -> int:
        """seq got tokens (token_ids[first:], placeholders aside): check them; its request has news
        if its output side wants every step or seq ended. Returns how many tokens seq keeps."""
        request = seq.request
        if request.first_token_time is None:
            request.first_token_time = now
        try:
            kept = self._check_tokens(seq, first)
        except Exception as exc:  # noqa: BLE001 - e.g. a grammar refused the token: fail only this request
            logger.exception("request %s: processing its tokens failed", request.request_id)
            failed[seq.seq_id] = f"processing the output failed: {type(exc).__name__}: {exc}"
            return 0
        if request.every_step or seq.status is _FINISHED:
            news[request.request_id] = request
        return kept

    def _check_tokens(self, seq: Sequence, first: int) -> int:
        """Grammar advance and token-level stops for seq's tokens new this step (token_ids[first:],
        placeholders of later steps aside); a sequence that ends is finished at once and keeps no
        token after the one that ended it. Returns how many new tokens it keeps."""
        request = seq.request
        ids = seq.token_ids
        end = len(ids) - seq.num_pending
        if end - first == 1 and not request.grammars:  # (the common case: one token, no grammar)
            stop = token_stop(
                request.params, ids[first], end - seq.num_prompt_tokens, end, self.eos_token_ids, self.max_model_len
            )
            if stop is not None:
                self._end(seq, stop)
            return 1
        matcher = request.grammars[seq.sample_index] if request.grammars else None
        for i in range(first, end):
            token = ids[i]
            stop = token_stop(
                request.params, token, i + 1 - seq.num_prompt_tokens, i + 1, self.eos_token_ids, self.max_model_len
            )
            if matcher is not None:
                # The sampler only allows tokens the matcher accepts, so a refusal is a bug.
                if not matcher.accept(token):
                    raise RuntimeError(f"structured output: token {token} is outside the constraint's language")
                if stop is None and matcher.is_terminated:  # (a stop token kept by ignore_eos)
                    stop = (_STOP, None, False)
            if stop is not None:
                if i + 1 < end:  # (drafts after the end: their KV goes with the sequence's blocks)
                    del ids[i + 1 : end]
                    seq.num_new_tokens -= end - i - 1
                self._end(seq, stop)
                return i + 1 - first
        return end - first

    def _end(self, seq: Sequence, stop: tuple[FinishReason, int | None, bool]) -> None:
        """A token-level stop ended seq: finish it now (its blocks go back at once)."""
        seq.ended_by_stop_token = stop[2]
        self.finish_seq(seq, stop[0], stop[1])

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

    # ---- rows without tokens: task results, failures ----
    def _record_tasks(self, out: SchedulerOutput, results: dict, news: dict[str, Request], now: float) -> None:
        """Hand each task what it read off the step's hidden states; a request whose task is done
        with that (an embedding) is finished without a token."""
        by_id = {s.seq_id: s for s in out.seqs}
        for seq_id, result in results.items():
            s = by_id.get(seq_id)
            seq = self.seqs_by_id.get(seq_id)
            if s is None or seq is None or seq.is_finished:
                continue
            if s.task.record(seq, result):
                self.finish_seq(seq, _STOP, None)
                seq.request.first_token_time = now
                news[seq.request.request_id] = seq.request

    @staticmethod
    def _failed_rows(out: SchedulerOutput, errors: dict[int, str]) -> dict[int, str]:
        """seq id -> error, for the scheduled sequences whose sampler rows failed."""
        return {s.seq_id: errors[r] for s, rows in sample_row_ranges(out.seqs) for r in rows if r in errors}

    def _fail_rows(self, out: SchedulerOutput, failed: dict[int, str], news: dict[str, Request]) -> None:
        seqs = [seq for s in out.seqs if (seq := self.seqs_by_id.get(s.seq_id)) is not None]
        seqs += [c for s in seqs for c in s.request.seqs if c.seq_id in failed]  # (a fork's children)
        for seq in seqs:
            if seq.seq_id in failed and not seq.request.is_finished:
                self.fail_request(seq.request, failed[seq.seq_id])
                news[seq.request.request_id] = seq.request

    def fail_request(self, request: Request, message: str) -> None:
        """Finish every sequence of one request with FinishReason.ERROR; the others go on."""
        logger.warning("request %s failed: %s", request.request_id, message)
        request.error = message
        for seq in request.seqs:
            if not seq.is_finished:
                self.finish_seq(seq, FinishReason.ERROR, None)

    # ---- what goes out ----
    def _updates(
        self, news: dict[str, Request], flat_logprobs: list, out: SchedulerOutput, now: float
    ) -> list[RequestUpdate]:
        """The updates of the requests with news; a finished request leaves the scheduler here.
        A request whose output side wants only the end (Request.every_step) gets none before."""
        if not news:
            return []
        entries = self._split_logprobs(out, flat_logprobs) if any(flat_logprobs) else {}
        updates = []
        update_of = self.update_of
        for request in news.values():
            finished = request.is_finished
            if finished:
                request.finished_time = now
                self.pop_request(request.request_id)
            elif not request.every_step:
                continue
            updates.append(update_of(request, entries, finished))
        return updates

    @staticmethod
    def update_of(
        request: Request, entries: dict[int, list] | None = None, finished: bool | None = None
    ) -> RequestUpdate:
        """What the output side has not been told about `request` yet (`entries`: this step's
        logprob rows by seq id; a request that asks for logprobs gets an update every step, so
        its new tokens are this step's; `finished`: request.is_finished, if known)."""
        want_logprobs = entries is not None and request.params.logprobs is not None
        seqs = []
        for seq in request.seqs:
            ids = seq.token_ids
            end = len(ids) - seq.num_pending
            start = seq.num_prompt_tokens + seq.num_emitted
            ended = seq.status is _FINISHED
            if end == start and (not ended or seq.finish_emitted):
                continue
            new = ids[start:end]
            seqs.append(
                SeqUpdate(
                    seq.sample_index,
                    new,
                    _logprobs_of(seq, request, entries, len(new)) if want_logprobs and entries is not None else None,
                    seq.finish_reason,
                    seq.stop_reason,
                    seq.ended_by_stop_token,
                    seq.num_preemptions,
                )
            )
            seq.num_emitted = end - seq.num_prompt_tokens
            seq.finish_emitted = ended
        return RequestUpdate(
            request.request_id,
            seqs,
            request.is_finished if finished is None else finished,
            request.error,
            request.seqs[0].num_cached_tokens if request.seqs else 0,
            request.first_scheduled_time,
            request.first_token_time,
            request.finished_time,
            request.prompt_logprobs,
            request.embedding,
        )

    @staticmethod
    def _split_logprobs(out: SchedulerOutput, flat: list) -> dict[int, list]:
        """seq id -> the logprob rows it sampled this step (n at a fork, one per position with drafts)."""
        return {s.seq_id: flat[rows.start : rows.stop] for s, rows in sample_row_ranges(out.seqs) if rows}


def _logprobs_of(seq: Sequence, request: Request, entries: dict[int, list], count: int) -> list:
    """The logprob rows of seq's `count` new tokens (a forked child's is entry `sample_index` of
    its parent's rows)."""
    rows = entries.get(seq.seq_id)
    if rows is None:
        parent = entries.get(request.seqs[0].seq_id) or []
        rows = [parent[seq.sample_index]] if len(parent) > seq.sample_index else []
    rows = rows[:count]
    return rows + [None] * (count - len(rows))
