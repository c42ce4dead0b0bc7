"""OutputProcessor: the output side, turning the core's RequestUpdates into RequestOutputs.

It keeps its own small state per request (`RequestState`: the output ids seen, each sample's
text and logprobs, what was handed out) and never reads the core's Request: the core owns the
tokens, and tells this side what it kept (engine/core/outputs.py). Here: detokenisation, stop
strings, logprob formatting, and the RequestOutput each request hands out (cumulative, delta or
final only). One path: the offline `LLM` runs it inline after each step (LLMEngine.step), the
server on the AsyncEngine's output thread.

A stop string ends a sample here, so its output ends here; the core still runs it until told:
`process` returns those samples (`Processed.stopped`), and the driver finishes them in the core
(inline at once; the server through the step thread's inbox). Tokens the core computed
meanwhile are dropped here, never shown.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from engine.core.outputs import CompletionOutput, FinishReason, RequestOutput, RequestUpdate, SeqUpdate
from engine.runtime.detokenizer import Detokenizer, TextState, visible_len
from engine.runtime.stop_strings import SampleStops, StopMatcher

if TYPE_CHECKING:
    from engine.runtime.admission import AdmittedRequest

logger = logging.getLogger(__name__)


class SampleState:
    """One sample's output so far, as handed out."""

    __slots__ = (
        "index",
        "token_ids",
        "logprobs",
        "cumulative_logprob",
        "text",
        "stops",
        "finish_reason",
        "stop_reason",
        "num_preemptions",
        "emitted_tokens",
        "emitted_chars",
        "emitted_finish",
    )

    def __init__(self, index: int, text: TextState | None, stops: StopMatcher | None) -> None:
        self.index = index
        self.stops = SampleStops(stops) if stops is not None and text is not None else None
        self.token_ids: list[int] = []
        self.logprobs: list[dict[int, float]] = []
        self.cumulative_logprob = 0.0
        self.text = text  # None: not detokenised
        self.finish_reason: FinishReason | None = None
        self.stop_reason: int | str | None = None
        self.num_preemptions = 0
        # output_kind "delta": how much has been handed out already.
        self.emitted_tokens = 0
        self.emitted_chars = 0
        self.emitted_finish = False


class RequestState:
    """The output side's own state of one request (made from the admitted request)."""

    def __init__(self, admitted: AdmittedRequest) -> None:
        self.request_id = admitted.request_id
        self.prompt = admitted.prompt
        self.prompt_token_ids = admitted.prompt_token_ids
        self.params = admitted.params
        # Built once for the request, shared by its samples (each keeps its own place in it).
        stop = self.params.stop
        assert not isinstance(stop, str)  # (SamplingParams.__post_init__ made it a list)
        self.stop_matcher = StopMatcher(stop) if stop else None
        self.arrival_time = admitted.arrival_time
        self.text_output = admitted.task.text_output  # False: an embedding
        self.samples: dict[int, SampleState] = {}
        self.finished = False
        self.core = RequestUpdate(self.request_id, [], False)  # the core's latest: timings, cached tokens, error, ...
        self.error: str | None = None  # this side's own (the output could not be built)
        self.finished_time: float | None = None  # when this side ended it (a stop string, a failure)

    def sample(self, index: int) -> SampleState:
        sample = self.samples.get(index)
        if sample is None:
            params = self.params
            text = TextState(self.prompt_token_ids, params.skip_special_tokens) if params.detokenize else None
            sample = self.samples[index] = SampleState(index, text, self.stop_matcher)
        return sample

    def all_ended(self) -> bool:
        return len(self.samples) == self.params.n and all(s.finish_reason is not None for s in self.samples.values())


@dataclass
class Processed:
    """One batch of updates, processed: the outputs to hand out, and what the core must be told."""

    outputs: list[RequestOutput] = field(default_factory=list)
    stopped: list[tuple[str, int, str]] = field(default_factory=list)  # (request id, sample, stop string)
    failed: list[str] = field(default_factory=list)  # request ids whose output could not be built


class OutputProcessor:
    def __init__(self, tokenizer) -> None:
        self.detokenizer = Detokenizer(tokenizer)
        self.states: dict[str, RequestState] = {}

    def set_tokenizer(self, tokenizer) -> None:
        self.detokenizer = Detokenizer(tokenizer)

    def add(self, admitted: AdmittedRequest) -> None:
        """Expect updates for a request the core accepted."""
        self.states[admitted.request_id] = RequestState(admitted)

    def process(self, updates: list[RequestUpdate]) -> Processed:
        outputs: list[RequestOutput] = []
        stopped: list[tuple[str, int, str]] = []
        failed: list[str] = []
        states = self.states
        apply = self._apply
        for update in updates:
            state = states.get(update.request_id)
            if state is None:
                continue  # ended here already (a stop string): the core's late tokens are dropped
            try:
                out = apply(state, update, stopped)
            except Exception as exc:  # noqa: BLE001 - e.g. the tokenizer fails on this output: fail only it
                logger.exception("request %s: building its output failed", update.request_id)
                out = self._fail(state, f"processing the output failed: {type(exc).__name__}: {exc}")
                failed.append(update.request_id)
            if out is not None:
                outputs.append(out)
        return Processed(outputs, stopped, failed)

    def _apply(self, state: RequestState, update: RequestUpdate, stopped: list) -> RequestOutput | None:
        state.core = update
        ended = update.finished
        samples = state.samples
        for seq in update.seqs:
            sample = samples.get(seq.index) or state.sample(seq.index)
            if sample.finish_reason is not None:
                continue  # (ended here by a stop string)
            if seq.token_ids:
                self._take_tokens(state, sample, seq, stopped)
            if sample.finish_reason is None and seq.finish_reason is not None:
                sample.finish_reason, sample.stop_reason = seq.finish_reason, seq.stop_reason
            sample.num_preemptions = seq.num_preemptions
            ended = ended or sample.finish_reason is not None
        if update.finished:
            for sample in state.samples.values():
                if sample.finish_reason is None:  # (never expected: the core ends every sample it reports)
                    sample.finish_reason = FinishReason.ABORT
        if ended and (update.finished or state.all_ended()):
            self._end(state)
        return self._output(state)

    def _take_tokens(self, state: RequestState, sample: SampleState, seq: SeqUpdate, stopped: list) -> None:
        """Append seq's new tokens to the sample, with their logprobs and text, one token at a
        time: a stop string ends the sample at the token that completes it (later ones dropped)."""
        params = state.params
        text = sample.text
        tokens, logprobs = seq.token_ids, seq.logprobs
        stops = sample.stops
        if logprobs is None and (text is None or (len(tokens) == 1 and stops is None and not seq.stop_token)):
            sample.token_ids += tokens  # (the common cases: no text, or one token's text and no stop strings)
            if text is not None:
                text.ids += tokens
                self.detokenizer.step(text)
            return
        step = self.detokenizer.step
        last = len(tokens) - 1
        for j, token in enumerate(tokens):
            sample.token_ids.append(token)
            entry_j = logprobs[j] if logprobs is not None else None
            if entry_j is not None:
                chosen, top = entry_j
                sample.cumulative_logprob += chosen
                entry = dict(top)
                entry[token] = chosen
                sample.logprobs.append(entry)
            if text is None:
                continue
            if j == last and seq.stop_token:  # (EOS or a stop token id: shown only if asked, never searched)
                if seq.stop_reason is not None and params.include_stop_str_in_output:
                    text.ids.append(token)
                    step(text)
                continue
            text.ids.append(token)
            if stops is None:
                step(text)
                continue
            before = len(text.text)
            if step(text):
                if len(sample.token_ids) < params.min_tokens:
                    stops.skip()
                    continue
                hit = stops.find(text.text, before)
                if hit is not None:
                    at, stop = hit
                    text.text = text.text[: at + len(stop)] if params.include_stop_str_in_output else text.text[:at]
                    sample.finish_reason, sample.stop_reason = FinishReason.STOP, stop
                    if seq.finish_reason is None:  # the core still runs it
                        stopped.append((state.request_id, seq.index, stop))
                    return

    def _end(self, state: RequestState) -> None:
        state.finished = True
        if state.core.finished_time is None:  # (ended here first)
            state.finished_time = time.monotonic()
        self.states.pop(state.request_id, None)

    def _fail(self, state: RequestState, message: str) -> RequestOutput | None:
        """End a request whose output could not be built (the core is told to drop it)."""
        logger.warning("request %s failed: %s", state.request_id, message)
        state.error = message
        for sample in state.samples.values():
            if sample.finish_reason is None:
                sample.finish_reason = FinishReason.ERROR
        self._end(state)
        return self._output(state)

    # ---- RequestOutput building ----
    def _output(self, state: RequestState) -> RequestOutput | None:
        """The request's output now, as its params.output_kind asks (None: nothing to hand out:
        final_only before the end, or a delta with nothing new)."""
        params = state.params
        finished = state.finished
        if params.output_kind == "final_only" and not finished:
            return None
        core = state.core
        if not state.text_output:  # (an embedding: one output, when it is done)
            if not finished:
                return None
            return RequestOutput(
                state.request_id,
                state.prompt,
                state.prompt_token_ids,
                [],
                True,
                core.num_cached_tokens,
                state.error or core.error,
                {"arrival_time": state.arrival_time, "finished_time": core.finished_time or state.finished_time},
                None,
                core.embedding,
            )
        samples = state.samples
        ordered = samples.values() if len(samples) == 1 else sorted(samples.values(), key=lambda s: s.index)
        if params.output_kind == "delta":
            outs = []
            for sample in ordered:
                choice = self._delta_choice(state, sample)
                if choice is not None:
                    outs.append(choice)
            if not outs and not finished:
                return None  # new tokens whose text is held back: they come with their text
        else:
            outs = [self._choice(state, s, 0, 0, self._visible(state, s)) for s in ordered]
        metrics = {
            "arrival_time": state.arrival_time,
            "first_scheduled_time": core.first_scheduled_time,
            "first_token_time": core.first_token_time,
            "finished_time": core.finished_time or state.finished_time,
            "n": params.n,
            "max_tokens": params.max_tokens,
        }  # (n, max_tokens: request_params_* metrics)
        return RequestOutput(
            state.request_id,
            state.prompt,
            state.prompt_token_ids,
            outs,
            finished,
            core.num_cached_tokens,
            state.error or core.error,
            metrics,
            core.prompt_logprobs,
        )

    @staticmethod
    def _visible(state: RequestState, sample: SampleState) -> int:
        """How much of the sample's text may be shown now (a possible stop string's start held back)."""
        text = sample.text
        if text is None:
            return 0
        matcher = state.stop_matcher
        return visible_len(text.text, matcher.max_len, sample.finish_reason is not None) if matcher else len(text.text)

    @staticmethod
    def _choice(
        state: RequestState, sample: SampleState, tokens_from: int, chars_from: int, chars_to: int
    ) -> CompletionOutput:
        """The sample's output tokens from `tokens_from` on, and its text [chars_from, chars_to)."""
        logprobs = state.params.logprobs is not None
        return CompletionOutput(
            index=sample.index,
            text=sample.text.text[chars_from:chars_to] if sample.text is not None else "",
            token_ids=sample.token_ids[tokens_from:],
            cumulative_logprob=sample.cumulative_logprob if logprobs else None,
            logprobs=sample.logprobs[tokens_from:] if logprobs else None,
            finish_reason=sample.finish_reason.value if sample.finish_reason else None,
            stop_reason=sample.stop_reason,
            num_preemptions=sample.num_preemptions,
        )

    def _delta_choice(self, state: RequestState, sample: SampleState) -> CompletionOutput | None:
        """What is new in the sample since its last delta, or None. New tokens whose text is still
        held back (a split UTF-8 character, a possible stop string) wait for their text, unless
        the request is not detokenised; the delta that ends a sample comes once."""
        if sample.emitted_finish:
            return None
        text = sample.text
        matcher = state.stop_matcher
        if text is None:
            chars = 0
        elif matcher is not None:
            chars = visible_len(text.text, matcher.max_len, sample.finish_reason is not None)
        else:
            chars = len(text.text)
        finished = sample.finish_reason is not None
        num_out = len(sample.token_ids)
        new_tokens = num_out > sample.emitted_tokens
        if not (chars > sample.emitted_chars or finished or (new_tokens and text is None)):
            return None
        out = self._choice(state, sample, sample.emitted_tokens, sample.emitted_chars, chars)
        sample.emitted_tokens, sample.emitted_chars, sample.emitted_finish = num_out, chars, finished
        return out
