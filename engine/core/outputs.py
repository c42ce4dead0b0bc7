"""What crosses the core's edges after a step, as plain values.

In: `SamplerOutput`, a step's sampled tokens as the host sees them (the worker fills it).
Out: a `RequestUpdate` per request that has something new, made by the core's one pass over
the step (engine/core/sched/step_update.py): the tokens it kept, how each sequence ended. The
output side (engine/runtime/output_processor.py) turns updates into RequestOutputs; it never
reads the core's Request, so it may run on another thread.
And what the API hands users: `RequestOutput` / `CompletionOutput` (vLLM's shapes), an embedding's
`EmbeddingRequestOutput`, a pair's `ScoringRequestOutput`, and how a sample ended (`FinishReason`).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any, NamedTuple

# A sampled row's logprobs: (the chosen token's logprob, {token: logprob} for the top N).
LogprobEntry = tuple[float, dict[int, float]]


class FinishReason(str, enum.Enum):
    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"
    ERROR = "error"


@dataclass
class SamplerOutput:
    token_ids: list[int]
    # Per row: a LogprobEntry, or None (not asked).
    logprobs: list[LogprobEntry | None]
    # Rows that failed (a logits processor raised, or the logits were NaN / +inf / all -inf):
    # row -> message. Their token is -1; the core fails their requests, the rest go on.
    errors: dict[int, str] = field(default_factory=dict)
    # What tasks read off this step's hidden states: seq id -> result (engine/core/request_kinds.py).
    task_results: dict[int, Any] = field(default_factory=dict)
    # A device proposer's drafts (a draft model, an EAGLE head: made inside the launch, so the
    # message held only markers): seq id -> the drafts its verify rows checked.
    drafts: dict[int, list[int]] = field(default_factory=dict)


# (The updates are NamedTuples: made for every sequence every step, read once, never changed.)
class SeqUpdate(NamedTuple):
    """One sequence's news: output tokens it kept since its previous update, and its end."""

    index: int  # type: ignore[assignment]  # the sample index (the field shadows tuple.index)
    token_ids: list[int]
    logprobs: list[LogprobEntry | None] | None  # one per new token (None: the request asks for none)
    finish_reason: FinishReason | None
    stop_reason: int | str | None
    # The last token ended the sequence as a stop token (EOS or one of stop_token_ids): the
    # output side shows its text only for stop_token_ids with include_stop_str_in_output, and
    # looks for no stop string in it.
    stop_token: bool
    num_preemptions: int


class RequestUpdate(NamedTuple):
    """A request's news from one step (or an abort, or a failure)."""

    request_id: str
    seqs: list[SeqUpdate]
    finished: bool  # the core is done with the request (every sample ended, or it was aborted / failed)
    error: str | None = None
    num_cached_tokens: int = 0
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    # Prompt logprobs (complete once the first token exists; the core's list, not copied per step).
    prompt_logprobs: list[dict[int, float] | None] | None = None
    embedding: list[float] | None = None  # an embedding request's result


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[dict[int, float]] | None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_preemptions: int = 0

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    error: str | None = None
    metrics: dict[str, Any] = field(default_factory=dict)
    prompt_logprobs: list[dict[int, float] | None] | None = None
    embedding: list[float] | None = None  # embedding requests (PoolingParams)


@dataclass
class EmbeddingOutput:
    embedding: list[float]


@dataclass
class EmbeddingRequestOutput:
    """An embedding request's result in vLLM's shape (`.outputs.embedding`); `.embedding` too."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: EmbeddingOutput
    finished: bool
    num_cached_tokens: int = 0

    @property
    def embedding(self) -> list[float]:
        return self.outputs.embedding

    @classmethod
    def of(cls, out: "RequestOutput") -> "EmbeddingRequestOutput":
        return cls(
            out.request_id,
            out.prompt,
            out.prompt_token_ids,
            EmbeddingOutput(list(out.embedding or [])),
            out.finished,
            out.num_cached_tokens,
        )


@dataclass
class ScoringOutput:
    score: float


@dataclass
class ScoringRequestOutput:
    """A pair's score in vLLM's shape (`.outputs.score`): LLM.score."""

    request_id: str
    prompt_token_ids: list[int]  # the two prompts' ids, one after the other
    outputs: ScoringOutput
    finished: bool = True
