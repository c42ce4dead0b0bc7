"""Beam search on top of the engine (as vLLM V1 runs it): every step, each live beam is one
one-token request asking for its top 2 x beam_width logprobs; the prefix cache makes the
shared prompt and beam prefixes cheap to run again. Candidates are ranked by cumulative
logprob and the best beam_width continue; a candidate ending in EOS is set aside as a
finished beam. At the end finished and live beams are ranked by cumulative logprob /
length ** length_penalty and the best beam_width are returned.

The search itself (`expand`, `best`) is plain Python over token lists; `BeamSearch.run` is the one
driver of it, for both callers: each step it hands the live beams to a `run_batch` that runs
their one-token requests (`LLM.beam_search` offline through LLMEngine, the server through the
AsyncEngine) and returns their top logprobs.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Awaitable, Callable

from engine.core.outputs import CompletionOutput, RequestOutput
from engine.core.params import LoRARequest, SamplingParams

if TYPE_CHECKING:
    from engine.runtime.admission import Admission, AdmittedRequest

# Runs one step's one-token requests (token lists) -> each one's top logprobs, in order.
RunBatch = Callable[[list[list[int]]], "list[dict[int, float]] | Awaitable[list[dict[int, float]]]"]


@dataclass(frozen=True)
class BeamSearchParams:
    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    length_penalty: float = 1.0

    def __post_init__(self) -> None:
        # The search asks for beam_width samples of up to max_tokens: SamplingParams' rules (the
        # admission table's) refuse what they refuse, with the same messages.
        SamplingParams(n=self.beam_width, max_tokens=self.max_tokens)

    def step_params(self, max_logprobs: int) -> SamplingParams:
        """One step of one beam: a single greedy token and the top 2 x beam_width logprobs (as many
        as the engine's max_logprobs allows)."""
        return SamplingParams(
            temperature=0.0,
            max_tokens=1,
            logprobs=min(2 * self.beam_width, max_logprobs),
            ignore_eos=True,
            detokenize=False,
            output_kind="final_only",
        )


@dataclass
class Beam:
    tokens: list[int]  # prompt and generated tokens
    num_prompt_tokens: int
    logprob: float = 0.0  # cumulative over the generated tokens
    logprobs: list[dict[int, float]] = field(default_factory=list)
    finished: bool = False  # ended with EOS

    @property
    def output_ids(self) -> list[int]:
        return self.tokens[self.num_prompt_tokens :]

    def score(self, length_penalty: float) -> float:
        return self.logprob / max(1, len(self.output_ids)) ** length_penalty


def expand(
    beams: list[Beam], candidates: list[dict[int, float]], params: BeamSearchParams, eos_token_ids: tuple[int, ...]
) -> tuple[list[Beam], list[Beam]]:
    """(the next live beams, the beams finished this step) from each live beam's {token: logprob}."""
    live, done = [], []
    for beam, options in zip(beams, candidates):
        for token, logprob in options.items():
            grown = Beam(
                beam.tokens + [token], beam.num_prompt_tokens, beam.logprob + logprob, beam.logprobs + [options]
            )
            if token in eos_token_ids and not params.ignore_eos:
                grown.finished = True
                done.append(grown)
            else:
                live.append(grown)
    live.sort(key=lambda b: b.logprob, reverse=True)
    return live[: params.beam_width], done


def best(finished: list[Beam], live: list[Beam], params: BeamSearchParams) -> list[Beam]:
    ranked = sorted(finished + live, key=lambda b: b.score(params.length_penalty), reverse=True)
    return ranked[: params.beam_width]


def to_output(request_id: str, prompt: str | None, beams: list[Beam], tokenizer) -> RequestOutput:
    """The beams as one finished RequestOutput, a choice per beam (best first)."""
    outs = []
    for i, beam in enumerate(beams):
        ids = beam.output_ids
        outs.append(
            CompletionOutput(
                index=i,
                text=tokenizer.decode(ids, skip_special_tokens=True),
                token_ids=ids,
                cumulative_logprob=beam.logprob,
                logprobs=beam.logprobs,
                finish_reason="stop" if beam.finished else "length",
            )
        )
    first = beams[0] if beams else None
    prompt_ids = first.tokens[: first.num_prompt_tokens] if first else []
    return RequestOutput(request_id, prompt, prompt_ids, outs, True)


class BeamSearch:
    """The search over several prompts at once: `run(run_batch)` until every beam is done, then
    `outputs()` gives one RequestOutput per prompt. Admission checks the prompts' room
    (prompt + max_tokens within max_model_len) and the step params once, up front."""

    def __init__(
        self, prompts: list[list[int]], params: BeamSearchParams, admission: Admission, eos_token_ids: tuple[int, ...]
    ) -> None:
        for ids in prompts:
            admission.check_length(len(ids), params.max_tokens)
        self.params = params
        self.admission = admission
        self.step_params, self.task = admission.check_params(params.step_params(admission.max_logprobs))
        self.eos_token_ids = eos_token_ids
        self.live = [[Beam(list(ids), len(ids))] for ids in prompts]
        self.finished: list[list[Beam]] = [[] for _ in prompts]
        self.steps = 0
        self._jobs: list[tuple[int, Beam]] = []

    def step_request(
        self, tokens: list[int], priority: int = 0, lora_request: LoRARequest | None = None, **kwargs: Any
    ) -> AdmittedRequest:
        """One beam's one-token request (its params were checked once, in __init__)."""
        return self.admission.request(
            None, tokens, self.step_params, self.task, priority=priority, lora_request=lora_request, **kwargs
        )

    async def run(self, run_batch: RunBatch) -> None:
        """The loop: every live beam of every prompt, one step at a time, until max_tokens or no
        beam is left. run_batch may return the logprobs or an awaitable of them."""
        while batch := self.pending():
            options = run_batch(batch)
            if inspect.isawaitable(options):
                options = await options
            self.advance(options)

    def run_sync(self, run_batch: RunBatch) -> None:
        """run() with a run_batch that returns the logprobs themselves (offline): the coroutine
        never suspends, so one send drives it to the end (also inside a running event loop)."""
        coro = self.run(run_batch)
        try:
            coro.send(None)
        except StopIteration:
            return
        coro.close()
        raise RuntimeError("BeamSearch.run_sync: run_batch returned an awaitable; use run()")

    def pending(self) -> list[list[int]]:
        if self.steps >= self.params.max_tokens:
            return []
        self._jobs = [(i, beam) for i, beams in enumerate(self.live) for beam in beams]
        return [beam.tokens for _, beam in self._jobs]

    def advance(self, options: list[dict[int, float]]) -> None:
        if len(options) != len(self._jobs):
            raise ValueError(f"expected {len(self._jobs)} logprob dicts, got {len(options)}")
        for i in range(len(self.live)):
            mine = [k for k, (j, _) in enumerate(self._jobs) if j == i]
            self.live[i], done = expand(
                [self._jobs[k][1] for k in mine], [options[k] for k in mine], self.params, self.eos_token_ids
            )
            self.finished[i] += done
        self.steps += 1

    def outputs(self, request_ids: list[str], texts: list[str | None], tokenizer) -> list[RequestOutput]:
        return [
            to_output(request_ids[i], texts[i], best(self.finished[i], self.live[i], self.params), tokenizer)
            for i in range(len(self.live))
        ]
