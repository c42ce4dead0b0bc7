"""Admission: the one step that turns what a caller gives (a prompt or its ids, SamplingParams,
a LoRA adapter, pooling) into a request the engine runs (`AdmittedRequest`), for the offline
`LLM` (through LLMEngine.add_request) and the server (engine/entrypoints/openai/) alike.

Each rule is written here once and checked once per request: the task fits the model, the
params fit the engine's limits (logprobs, n, token ids in the vocabulary), the prompt fits
max_model_len with room for max_tokens, the structured-output constraint compiles. The compiled
grammar travels with the request: the engine makes its matchers from it, it does not compile
again. SamplingParams check their own rules when they are made (SamplingParams.validate); here
they are only copied for the request (SamplingParams.clone), never validated again.

The server runs the steps one by one (tokenising off the event loop, compiling in its pool with
the client's disconnect watched); `admit` / `admit_async` run them in order for everyone else.
Which adapter a request runs with is settled when the engine takes it (adapters load and
unload between steps).
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from engine.core.request import InvalidRequestError, LoRARequest, PoolingParams, SamplingParams
from engine.core.request_kinds import Task, make_task


@dataclass
class AdmittedRequest:
    """A request that passed admission, ready for EngineCore.add_admitted."""

    request_id: str
    prompt: str | None  # the prompt's text (None: given as token ids, or truncated)
    prompt_token_ids: list[int]
    params: SamplingParams  # the request's own copy, max_tokens resolved
    task: Task
    priority: int = 0
    arrival_time: float = field(default_factory=time.monotonic)
    lora_request: LoRARequest | None = None
    grammar: Any = None  # params.structured_outputs compiled (engine/structured_output/grammars.py)


class Admission:
    """The engine's limits and the means to check against them (read-only after start-up: safe
    from any thread)."""

    def __init__(self, model_config, model_name: str, max_model_len: int, max_num_seqs: int, max_logprobs: int,
                 tokenizer, grammars, eos_token_ids: tuple[int, ...] = ()) -> None:
        self.model_config = model_config
        self.model_name = model_name
        self.vocab_size = model_config.vocab_size
        self.max_model_len = max_model_len
        self.max_num_seqs = max_num_seqs
        self.max_logprobs = max_logprobs
        self.tokenizer = tokenizer
        self.grammars = grammars  # the engine's StructuredOutputCompiler
        self.eos_token_ids = tuple(eos_token_ids)

    # ---- the rules ----
    def check_params(self, params: SamplingParams | None,
                     pooling: PoolingParams | None = None) -> tuple[SamplingParams, Task]:
        """The request's task (from params and pooling: engine/core/request_kinds.py) and the params
        it runs with, checked against the model and the engine's limits."""
        task = make_task(params, pooling)
        task.check(self.model_config, self.model_name)
        params = task.params(params)
        params.check_stop_tokens(self.eos_token_ids)
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(params, name)
            if value is not None and value > self.max_logprobs:
                raise InvalidRequestError(f"{name} must be at most {self.max_logprobs} (the server's "
                                          f"max_logprobs), got {value}", name)
        if params.n > self.max_num_seqs:
            raise InvalidRequestError(f"n ({params.n}) exceeds this server's max_num_seqs ({self.max_num_seqs})",
                                      "n")
        for name, ids in params.token_id_fields():
            self.check_token_ids(ids, name)
        return params, task

    def check_token_ids(self, ids: list[int], param: str) -> None:
        """Every id names a token of the model's vocabulary."""
        vocab = self.vocab_size
        bad = [t for t in ids if not isinstance(t, int) or not 0 <= t < vocab]
        if bad:
            raise InvalidRequestError(f"{param}: token ids must be integers in [0, {vocab}); got {bad[:3]}", param)

    def check_length(self, num_prompt_tokens: int, max_tokens: int | None, param: str = "prompt") -> None:
        """The prompt fits in max_model_len with room for max_tokens (None: at least one token)."""
        limit = self.max_model_len
        if num_prompt_tokens == 0:
            raise InvalidRequestError(f"{param}: the prompt is empty", param)
        if num_prompt_tokens >= limit:
            raise InvalidRequestError(f"{param}: the prompt has {num_prompt_tokens} tokens, which leaves no room "
                                      f"to generate within max_model_len={limit}", param)
        if max_tokens is not None and num_prompt_tokens + max_tokens > limit:
            raise InvalidRequestError(f"prompt ({num_prompt_tokens} tokens) + max_tokens ({max_tokens}) = "
                                      f"{num_prompt_tokens + max_tokens} exceeds max_model_len={limit}", "max_tokens")

    def fit_prompt(self, text: str | None, ids: list[int], params: SamplingParams,
                   param: str = "prompt") -> tuple[str | None, list[int]]:
        """(text, ids) of a tokenised prompt cut to params.truncate_prompt_tokens, its length checked."""
        keep = params.truncate_prompt_tokens
        if keep is not None and len(ids) > keep:
            ids, text = ids[-keep:], None  # (the text no longer matches the tokens)
        self.check_length(len(ids), params.max_tokens, param)
        return text, ids

    def encode(self, prompt: str | list[int], param: str = "prompt") -> tuple[str | None, list[int]]:
        """(text, ids) of a prompt given as text (tokenised here) or as token ids (checked)."""
        if isinstance(prompt, str):
            return prompt, self.tokenizer.encode(prompt)
        ids = list(prompt)
        self.check_token_ids(ids, param)
        return None, ids

    def prompt_ids(self, prompt: str | list[int], params: SamplingParams,
                   param: str = "prompt") -> tuple[str | None, list[int]]:
        """encode(), then fit_prompt()."""
        text, ids = self.encode(prompt, param)
        return self.fit_prompt(text, ids, params, param)

    def compile(self, params: SamplingParams) -> Any:
        """The compiled constraint of params.structured_outputs (None without one)."""
        if params.structured_outputs is None:
            return None
        return self.grammars.compile(params.structured_outputs)

    # ---- the request ----
    def request(self, text: str | None, ids: list[int], params: SamplingParams, task: Task,
                request_id: str | None = None, priority: int = 0, arrival_time: float | None = None,
                lora_request: LoRARequest | None = None, grammar: Any = None,
                output_kind: str | None = None) -> AdmittedRequest:
        """The admitted request of checked parts (nothing is checked here): its own params copy,
        max_tokens resolved (None: up to max_model_len), output_kind set if given."""
        changes: dict[str, Any] = {}
        if params.max_tokens is None:
            changes["max_tokens"] = self.max_model_len - len(ids)
        if output_kind is not None:
            changes["output_kind"] = output_kind
        return AdmittedRequest(request_id or uuid.uuid4().hex, text, ids, params.clone(**changes), task, priority,
                               arrival_time if arrival_time is not None else time.monotonic(), lora_request, grammar)

    def admit(self, prompt: str | list[int], params: SamplingParams | None = None, request_id: str | None = None,
              priority: int = 0, lora_request: LoRARequest | None = None, pooling: PoolingParams | None = None,
              output_kind: str | None = None, arrival_time: float | None = None) -> AdmittedRequest:
        """Every step, in order, on the calling thread (a constraint compiles here)."""
        params, task = self.check_params(params, pooling)
        text, ids = self.prompt_ids(prompt, params)
        return self.request(text, ids, params, task, request_id, priority, arrival_time, lora_request,
                            self.compile(params), output_kind)

    async def admit_async(self, prompt: str | list[int], params: SamplingParams | None = None,
                          request_id: str | None = None, priority: int = 0, lora_request: LoRARequest | None = None,
                          pooling: PoolingParams | None = None, output_kind: str | None = None,
                          arrival_time: float | None = None) -> AdmittedRequest:
        """admit() with the constraint compiled off the event loop (StructuredOutputCompiler.compile_async)."""
        params, task = self.check_params(params, pooling)
        text, ids = self.prompt_ids(prompt, params)
        grammar = None
        if params.structured_outputs is not None:
            grammar = await self.grammars.compile_async(params.structured_outputs)
        return self.request(text, ids, params, task, request_id, priority, arrival_time, lora_request, grammar,
                            output_kind)
