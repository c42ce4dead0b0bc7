"""OutputProcessor: what happens to a step's sampled tokens on the host.

Token bookkeeping (the scheduler appends them), logprobs, grammar advance, stop checks and
detokenisation, what tasks read off the hidden states (engine/core/request_kinds.py), failed rows, and the RequestOutput
each request hands out (cumulative, delta or final only).

With `defer_text` (the server's AsyncEngine) the engine thread keeps only the token-level
part: stop tokens, EOS, lengths, grammars, errors. It hands out a `RequestDelta` per request
(new token ids and logprob entries, finish reasons) and a `TextProcessor` on another thread
detokenises, looks for stop strings and builds the RequestOutputs, with the very functions
the inline path uses, over its own mirror of each request. A stop string it finds is sent
back to the engine thread, which finishes that sequence in the scheduler (its blocks are
freed at the next step; tokens computed meanwhile are discarded, never shown).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

from engine.core.request import CompletionOutput, FinishReason, Request, RequestOutput, SeqStatus, Sequence
from engine.core.request_kinds import task_of
from engine.core.sched.scheduler import Scheduler
from engine.core.sched.scheduler_output import SchedulerOutput, sample_row_ranges
from engine.runtime.detokenizer import Detokenizer, init_offsets, visible_len
from engine.worker.sample.sampler_output import SamplerOutput

logger = logging.getLogger(__name__)


@dataclass
class SeqDelta:
    """What the engine learnt about one sequence since its last delta (defer_text)."""

    index: int
    token_ids: list[int]
    logprobs: list[dict[int, float]] | None
    finish_reason: str | None
    stop_reason: int | str | None
    num_preemptions: int


@dataclass
class RequestDelta:
    request_id: str
    finished: bool
    error: str | None
    num_cached_tokens: int
    metrics: dict[str, float | None]
    seqs: list[SeqDelta] = field(default_factory=list)


class OutputProcessor:
    def __init__(self, scheduler: Scheduler, tokenizer, eos_token_ids: tuple[int, ...], max_model_len: int) -> None:
        self.scheduler = scheduler
        self.detokenizer = Detokenizer(tokenizer, eos_token_ids, max_model_len)
        self.defer_text = False  # see the module docstring

    def set_defer_text(self, on: bool) -> None:
        self.defer_text = on
        d = self.detokenizer
        self.detokenizer = Detokenizer(d.tokenizer, d.eos_token_ids, d.max_model_len, text=not on)

    # ---- one step's results ----
    def process(self, sched: SchedulerOutput, sampled: SamplerOutput) -> tuple[list[RequestOutput], int]:
        """Apply a step's sampler output; returns the outputs to hand out and how many tokens
        the step generated (kept)."""
        tasks_done = self._record_task_results(sched, sampled.task_results) if sampled.task_results else []
        if sched.num_prefill_tokens == 0 and sched.num_decode_tokens == len(sched.seqs):
            tokens = [[t] for t in sampled.token_ids]  # (a decode step: one row per sequence, in order)
        else:
            tokens = [[sampled.token_ids[r] for r in rows] for _, rows in sample_row_ranges(sched.seqs)]
        failed = self._failed_rows(sched, sampled.errors)
        if failed:
            for i, s in enumerate(sched.seqs):
                if s.seq_id in failed:
                    tokens[i] = []  # no token for a failed row: its request is failed below
        logprobs = self._split_logprobs(sched, sampled.logprobs)
        touched = self.scheduler.update(sched, tokens)
        now = time.monotonic()
        outputs: dict[str, Request] = {}
        for seq in tasks_done:  # requests whose task is done without a token (an embedding)
            self.scheduler.finish_seq(seq, FinishReason.STOP)
            seq.request.first_token_time = now
            outputs[seq.request.request_id] = seq.request
        generated = 0
        # Offline runs want each request's final output only (output_kind "final_only"): a request
        # none of whose sequences ended this step has nothing to hand out, so none is built.
        every_step = self.defer_text
        for seq in touched:
            try:
                generated += self._process_new_tokens(seq, logprobs)
            except Exception as exc:  # noqa: BLE001 - e.g. the tokenizer fails on this output: fail only it
                logger.exception("request %s: processing its output failed", seq.request.request_id)
                failed[seq.seq_id] = f"processing the output failed: {type(exc).__name__}: {exc}"
                continue
            request = seq.request
            if request.first_token_time is None:
                request.first_token_time = now
            if seq.finish_reason is not None:
                self.scheduler.finish_seq(seq, seq.finish_reason, seq.stop_reason)
            elif not every_step and request.params.output_kind == "final_only":
                continue
            outputs[request.request_id] = request
        if failed:
            for s in sched.seqs:
                seq = s.seq
                if s.seq_id in failed and seq is not None and not seq.request.is_finished:
                    self.fail_request(seq.request, failed[s.seq_id])
                    outputs[seq.request.request_id] = seq.request
            for seq in touched:  # (a failure while processing)
                if seq.seq_id in failed and not seq.request.is_finished:
                    self.fail_request(seq.request, failed[seq.seq_id])
                    outputs[seq.request.request_id] = seq.request
        return self._hand_out(outputs.values(), now), generated

    def _hand_out(self, requests, now: float) -> list[RequestOutput]:
        results = []
        for request in requests:
            if request.is_finished:
                request.finished_time = now
                self.scheduler.pop_finished_request(request.request_id)
            out = self.hand_out(request)
            if out is not None:
                results.append(out)
        return results

    def hand_out(self, request: Request) -> RequestOutput | RequestDelta | None:
        """The request's output (inline) or its delta for the TextProcessor (defer_text)."""
        if not self.defer_text or not task_of(request).text_output:
            return self.output(request)
        return self.delta(request)

    @staticmethod
    def delta(request: Request) -> RequestDelta | None:
        seqs = []
        for seq in request.seqs:
            known = seq.num_output_tokens - seq.num_pending
            finished = seq.finish_reason is not None
            if known == seq.emitted_tokens and (not finished or seq.emitted_finish):
                continue
            first = seq.num_prompt_tokens + seq.emitted_tokens
            logprobs = seq.logprobs[seq.emitted_tokens:known] if request.params.logprobs is not None else None
            seqs.append(SeqDelta(seq.sample_index, seq.token_ids[first:seq.num_prompt_tokens + known], logprobs,
                                 seq.finish_reason.value if finished else None, seq.stop_reason,
                                 seq.num_preemptions))
            seq.emitted_tokens, seq.emitted_finish = known, finished
        if not seqs and not request.is_finished:
            return None
        return RequestDelta(request.request_id, request.is_finished, request.error,
                            request.seqs[0].num_cached_tokens if request.seqs else 0,
                            {"first_scheduled_time": request.first_scheduled_time,
                             "first_token_time": request.first_token_time,
                             "finished_time": request.finished_time}, seqs)

    def _process_new_tokens(self, seq: Sequence, logprobs: dict[int, list]) -> int:
        """Logprobs, grammar and stop checks for the tokens the step appended to seq, one token at
        a time (a speculative step appends several); tokens after the one that finishes seq are
        dropped. Returns how many tokens seq keeps.

        Placeholders of a later step already launched (overlap scheduling) are set aside while
        this step's tokens are checked: if seq finishes here, that later token is discarded."""
        ids = seq.token_ids
        later = seq.num_pending
        if seq.num_new_tokens == 1 and later <= 1:  # (the common case: one token, one launched step after it)
            tail = ids.pop() if later else None
            self._check_token(seq, logprobs, 0)
            if seq.finish_reason is not None:
                seq.num_pending = 0
            elif later:
                ids.append(tail)
            return 1
        tail = ids[len(ids) - later:] if later else []
        if later:
            del ids[len(ids) - later:]
        count = seq.num_new_tokens
        kept = count
        pending = ids[len(ids) - count:]
        del ids[len(ids) - count:]
        for j, token in enumerate(pending):
            ids.append(token)
            self._check_token(seq, logprobs, j)
            if seq.finish_reason is not None:
                kept = j + 1
                break
        if seq.finish_reason is None:
            if tail:
                ids.extend(tail)
        else:
            seq.num_pending = 0
        return kept

    def _check_token(self, seq: Sequence, logprobs: dict[int, list], j: int) -> None:
        """Logprob, grammar and stop checks for seq's newest token, its number j of this step."""
        if logprobs:
            self._record_logprob(seq, logprobs, j)
        grammar_done = self._advance_grammar(seq) if seq.request.grammars else False
        self.detokenizer.check_stop(seq)
        if grammar_done and seq.finish_reason is None:  # (a stop token kept by ignore_eos)
            seq.finish_reason = FinishReason.STOP

    @staticmethod
    def _advance_grammar(seq: Sequence) -> bool:
        """Feed seq's new token to its grammar matcher (structured outputs); True once the output
        is complete. The sampler only allows tokens the matcher accepts, so a refusal is a bug."""
        grammars = seq.request.grammars
        if not grammars:
            return False
        matcher = grammars[seq.sample_index]
        token = seq.token_ids[-1]
        if not matcher.accept(token):
            raise RuntimeError(f"structured output: token {token} is outside the constraint's language")
        return matcher.is_terminated

    @staticmethod
    def _failed_rows(sched: SchedulerOutput, errors: dict[int, str]) -> dict[int, str]:
        """seq id -> error, for the scheduled sequences whose sampler rows failed."""
        if not errors:
            return {}
        return {s.seq_id: errors[r] for s, rows in sample_row_ranges(sched.seqs) for r in rows if r in errors}

    def fail_request(self, request: Request, message: str) -> None:
        """Finish every sequence of one request with FinishReason.ERROR; the others go on."""
        logger.warning("request %s failed: %s", request.request_id, message)
        request.error = message
        for seq in request.seqs:
            if not seq.is_finished:
                self.scheduler.finish_seq(seq, FinishReason.ERROR)

    def fail_all(self, message: str) -> list[RequestOutput]:
        """Fail every unfinished request; returns their final outputs (the pools end fully free)."""
        results = []
        now = time.monotonic()
        for request in list(self.scheduler.requests.values()):
            if not request.is_finished:
                self.fail_request(request, message)
            request.finished_time = request.finished_time or now
            self.scheduler.pop_finished_request(request.request_id)
            results.append(self.hand_out(request))
        return [r for r in results if r is not None]

    @staticmethod
    def _split_logprobs(sched: SchedulerOutput, flat: list) -> dict[int, list]:
        """seq id -> logprob entries it sampled this step (n entries at a fork)."""
        if not any(flat):
            return {}
        return {s.seq_id: flat[rows.start:rows.stop] for s, rows in sample_row_ranges(sched.seqs) if rows}

    @staticmethod
    def _record_logprob(seq: Sequence, logprobs: dict[int, list], index: int = 0) -> None:
        """Record the logprob entry of seq's token number `index` of this step."""
        # A forked child has no entry of its own: it took entry `sample_index` of its parent's list.
        entries = logprobs.get(seq.seq_id)
        if entries is None:
            parent = seq.request.seqs[0]
            entries = logprobs.get(parent.seq_id)
            entry = entries[seq.sample_index] if entries and len(entries) > seq.sample_index else None
        else:
            entry = entries[index] if len(entries) > index else None
        if entry is None:
            return
        chosen, top = entry
        seq.cumulative_logprob += chosen
        top = dict(top)
        top[seq.token_ids[-1]] = chosen
        seq.logprobs.append(top)

    @staticmethod
    def _record_task_results(sched: SchedulerOutput, results: dict[int, Any]) -> list[Sequence]:
        """Hand each task what it read off the step's hidden states; returns the sequences whose
        task is done with that (their request needs no token)."""
        by_id = {s.seq_id: s for s in sched.seqs}
        done = []
        for seq_id, result in results.items():
            s = by_id.get(seq_id)
            if s is None or s.seq is None or s.seq.is_finished:
                continue
            if s.task.record(s.seq, result):
                done.append(s.seq)
        return done

    # ---- RequestOutput building ----
    @classmethod
    def output(cls, request: Request) -> RequestOutput | None:
        """The request's output for this step, as its params.output_kind asks (None: nothing to
        hand out: final_only before the end, or a delta with nothing new)."""
        params = request.params
        if params.output_kind == "final_only" and not request.is_finished:
            return None
        task = task_of(request)
        if not task.text_output:  # (an embedding: one output, when it is done)
            return task.output(request)
        seqs = sorted(request.seqs, key=lambda s: s.sample_index)
        if params.output_kind == "delta":
            outs = [c for c in map(cls._delta_choice, seqs) if c is not None]
            if not outs and not request.is_finished:
                return None  # new tokens whose text is held back: they come with their text
        else:
            outs = [cls._choice(seq, 0, 0, visible_len(seq)) for seq in seqs]
        metrics = {
            "arrival_time": request.arrival_time,
            "first_scheduled_time": request.first_scheduled_time,
            "first_token_time": request.first_token_time,
            "finished_time": request.finished_time,
            "n": params.n, "max_tokens": params.max_tokens,  # (request_params_* metrics)
        }
        # prompt_logprobs: the request's own list (complete once the first token exists; not copied per step)
        return RequestOutput(request.request_id, request.prompt, request.prompt_token_ids, outs,
                             request.is_finished, request.seqs[0].num_cached_tokens if request.seqs else 0,
                             request.error, metrics, request.prompt_logprobs)

    @staticmethod
    def _choice(seq: Sequence, tokens_from: int, chars_from: int, chars_to: int) -> CompletionOutput:
        """seq's output tokens from `tokens_from` on (known ones), and its text [chars_from, chars_to)."""
        logprobs = seq.request.params.logprobs is not None
        end = len(seq.token_ids) - seq.num_pending
        return CompletionOutput(
            index=seq.sample_index,
            text=seq.text[chars_from:chars_to],
            token_ids=seq.token_ids[seq.num_prompt_tokens + tokens_from:end],
            cumulative_logprob=seq.cumulative_logprob if logprobs else None,
            logprobs=seq.logprobs[tokens_from:] if logprobs else None,
            finish_reason=seq.finish_reason.value if seq.finish_reason else None,
            stop_reason=seq.stop_reason,
            num_preemptions=seq.num_preemptions,
        )

    @classmethod
    def _delta_choice(cls, seq: Sequence) -> CompletionOutput | None:
        """What is new in seq since its last delta, or None. New tokens whose text is still held
        back (a split UTF-8 character, a possible stop string) wait for their text, unless the
        request is not detokenised; the delta that ends a sequence comes once."""
        if seq.emitted_finish:
            return None
        chars = visible_len(seq)
        finished = seq.finish_reason is not None
        num_out = seq.num_output_tokens - seq.num_pending
        new_tokens = num_out > seq.emitted_tokens
        if not (chars > seq.emitted_chars or finished or (new_tokens and not seq.request.params.detokenize)):
            return None
        out = cls._choice(seq, seq.emitted_tokens, seq.emitted_chars, chars)
        seq.emitted_tokens, seq.emitted_chars, seq.emitted_finish = num_out, chars, finished
        return out


class TextProcessor:
    """The defer_text side: detokenisation, stop strings and RequestOutputs from RequestDeltas,
    over a mirror of each request (runs on its own thread; touches no engine state)."""

    def __init__(self, tokenizer, eos_token_ids: tuple[int, ...], max_model_len: int) -> None:
        self.detokenizer = Detokenizer(tokenizer, eos_token_ids, max_model_len)
        self.mirrors: dict[str, Request] = {}

    @classmethod
    def mirror_of(cls, request: Request) -> Request:
        """A mirror of a request the engine accepted: a copy of what the text side reads (made on
        the engine thread, then owned by the text side)."""
        mirror = Request(request.request_id, request.prompt, list(request.prompt_token_ids), request.params,
                         arrival_time=request.arrival_time, priority=request.priority,
                         prompt_logprobs=request.prompt_logprobs)
        mirror.task = request.task
        mirror.seqs = [cls._new_seq(mirror, 0)]
        init_offsets(mirror.seqs[0])
        return mirror

    @staticmethod
    def _new_seq(mirror: Request, index: int) -> Sequence:
        seq = Sequence(index, mirror, index, list(mirror.prompt_token_ids), len(mirror.prompt_token_ids),
                       status=SeqStatus.RUNNING)
        return seq

    def apply(self, delta: RequestDelta) -> tuple[RequestOutput | None, list[tuple[str, int, int | str | None]]]:
        """The RequestOutput for one delta (None: nothing to show yet), and the sequences this side
        finished that the engine still runs: (request id, sample index, stop reason)."""
        mirror = self.mirrors.get(delta.request_id)
        if mirror is None:
            return None, []  # finished here already (a stop string): the engine's late tokens are dropped
        finish: list[tuple[str, int, int | str | None]] = []
        by_index = {s.sample_index: s for s in mirror.seqs}
        for d in delta.seqs:
            seq = by_index.get(d.index)
            if seq is None:
                seq = by_index[d.index] = self._new_seq(mirror, d.index)
                mirror.seqs.append(seq)
                seq.read_offset = 0  # its text starts after the prompt (Detokenizer.check_stop)
            if seq.finish_reason is not None:
                continue
            if d.token_ids and mirror.params.n > 1:
                mirror.forked = True
            cut = False
            for j, token in enumerate(d.token_ids):
                seq.token_ids.append(token)
                if d.logprobs is not None and j < len(d.logprobs):
                    entry = d.logprobs[j]
                    seq.cumulative_logprob += entry[token]
                    seq.logprobs.append(entry)
                self.detokenizer.check_stop(seq)
                if seq.finish_reason is not None:
                    cut = j + 1 < len(d.token_ids) or d.finish_reason is None
                    break
            if seq.finish_reason is None and d.finish_reason is not None:
                seq.finish_reason, seq.stop_reason = FinishReason(d.finish_reason), d.stop_reason
            elif cut and d.finish_reason is None:
                finish.append((mirror.request_id, d.index, seq.stop_reason))
            seq.num_preemptions = d.num_preemptions
            if seq.finish_reason is not None:
                seq.status = SeqStatus.FINISHED
        mirror.error = delta.error
        for key, value in delta.metrics.items():
            if value is not None:
                setattr(mirror, key, value)
        for seq in mirror.seqs:
            seq.num_cached_tokens = delta.num_cached_tokens
        if delta.finished:  # (e.g. aborted: every sequence the engine ended)
            for seq in mirror.seqs:
                if seq.finish_reason is None:
                    seq.finish_reason, seq.status = FinishReason.ABORT, SeqStatus.FINISHED
        if mirror.is_finished:
            mirror.finished_time = mirror.finished_time or time.monotonic()
            del self.mirrors[mirror.request_id]
        return OutputProcessor.output(mirror), finish

    def forget(self, request_id: str) -> None:
        self.mirrors.pop(request_id, None)

    def fail(self, request_id: str, message: str) -> RequestOutput | None:
        """End a request whose output could not be built (the engine is told to abort it)."""
        mirror = self.mirrors.pop(request_id, None)
        if mirror is None:
            return None
        logger.warning("request %s failed: %s", request_id, message)
        mirror.error = message
        for seq in mirror.seqs:
            if seq.finish_reason is None:
                seq.finish_reason, seq.status = FinishReason.ERROR, SeqStatus.FINISHED
        mirror.finished_time = time.monotonic()
        return OutputProcessor.output(mirror)
