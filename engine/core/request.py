"""Requests and their sequences: the core's state of what it is running.

A Request holds one prompt and `n` Sequences (one per parallel sample). Sequences
are what the scheduler schedules; the n samples of one request share the prompt's
KV blocks (forked after the prompt's prefill, copy-on-write).
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any

from engine.core.outputs import FinishReason
from engine.core.params import LoRARequest, SamplingParams


class SeqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    SWAPPED = "swapped"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    """One stream of tokens: the prompt plus what has been generated for it."""

    seq_id: int
    request: "Request"
    sample_index: int  # which of the request's n samples
    token_ids: list[int]
    num_prompt_tokens: int
    num_computed_tokens: int = 0
    block_ids: list[int] = field(default_factory=list)
    status: SeqStatus = SeqStatus.WAITING
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    ended_by_stop_token: bool = False  # its last token is the EOS or stop_token_ids token that ended it
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    num_preemptions: int = 0
    num_new_tokens: int = 0  # tokens the last step appended (more than 1 with speculative decoding)
    # Overlap scheduling: trailing token_ids sampled by launched steps but not yet known on the host
    # (placeholders; the device feeds the real ids to the next step).
    num_pending: int = 0
    table_version: int = 0  # bumped when an entry of block_ids is replaced in place (copy-on-write)
    # What the output side has been told (engine/core/sched/step_update.py): output tokens, the end.
    num_emitted: int = 0
    finish_emitted: bool = False

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status is SeqStatus.FINISHED


@dataclass(eq=False)
class Request:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float = field(default_factory=time.monotonic)
    priority: int = 0
    seqs: list[Sequence] = field(default_factory=list)
    forked: bool = False  # n > 1: samples forked after the prompt's prefill
    # Timing for metrics.
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    error: str | None = None
    # With params.structured_outputs: one grammar matcher per sample (index = sample_index), each
    # advanced by its sample's tokens (engine/structured_output/grammars.py).
    grammars: list[Any] | None = None
    embedding: list[float] | None = None  # an embedding request's result (engine/core/request_kinds.py Pool)
    pooled: tuple[Any, int] | None = None  # a mean pool's running (sum of hidden states, rows) until then
    lora_request: LoRARequest | None = None
    # Its reader is behind (back-pressure from a client that does not read): its sequences are not
    # scheduled, and keep their KV, until it reads (Scheduler.set_paused).
    paused: bool = False
    lora_slot: int = -1  # the adapter's slot in the model (-1: the base model)
    prefix_root: bytes | None = None  # prefix-cache namespace (an adapter's KV is its own)
    # With params.prompt_logprobs: one entry per prompt token, the first None (nothing before it),
    # filled as the prompt's chunks are computed.
    prompt_logprobs: list[dict[int, float] | None] | None = None
    task: Any = None  # what its steps are for: engine/core/request_kinds.py (None: made from params when scheduled)
    # The output side wants every step's tokens: it hands out more than the final output, looks
    # for stop strings as the text comes, or records logprobs, which the core does not keep.
    # Otherwise (LLM.generate's final outputs) a sequence's tokens go out once, when it ends, and
    # are detokenised then, one by one as they would have been step by step.
    every_step: bool = field(init=False)

    def __post_init__(self) -> None:
        params = self.params
        if params.prompt_logprobs is not None and self.prompt_logprobs is None:
            self.prompt_logprobs = [None] * len(self.prompt_token_ids)
        self.every_step = (
            params.output_kind != "final_only" or bool(params.stop and params.detokenize) or params.logprobs is not None
        )

    @property
    def is_finished(self) -> bool:
        """Every sample is done (a request with n > 1 is done early only if it ended before forking)."""
        seqs = self.seqs
        if len(seqs) == 1 and self.params.n == 1:  # (the common case, asked several times a step)
            return seqs[0].status is SeqStatus.FINISHED
        if not self.seqs or not all(s.is_finished for s in self.seqs):
            return False
        return (
            self.forked or self.params.n == 1 or self.seqs[0].finish_reason in (FinishReason.ABORT, FinishReason.ERROR)
        )
