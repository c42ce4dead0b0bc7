"""Admission: the one step that turns what a caller gives (a prompt or its ids, SamplingParams,
a LoRA adapter, pooling) into a request the engine runs (`AdmittedRequest`), for the offline
`LLM` (through LLMEngine.add_request) and the server (engine/entrypoints/openai/) alike.

The rules themselves are engine/core/admission_rules/'s table; here each is applied once per
request against this engine's state: the task fits the model, the params fit the engine's limits
(logprobs, n, token ids in the vocabulary), the prompt fits max_model_len with room for
max_tokens and the KV cache, the adapter can run, the structured-output constraint compiles. The compiled
grammar travels with the request: the engine makes its matchers from it, it does not compile
again. SamplingParams check their own rules when they are made (SamplingParams.validate); here
they are only copied for the request (SamplingParams.clone), never validated again.

The server runs the steps one by one (tokenising off the event loop, compiling in its pool with
the client's disconnect watched); `admit` / `admit_async` run them in order for everyone else.
A new adapter's weights are read when the engine takes the request (adapters load and unload
between steps); whether it can load at all (LoRA on, a free slot, its name) is settled here.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from engine.core import admission_rules as rules
from engine.core.params import LoRARequest, PoolingParams, SamplingParams
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

    def __init__(
        self,
        model_config,
        model_name: str,
        max_model_len: int,
        max_num_seqs: int,
        max_logprobs: int,
        tokenizer,
        grammars,
        eos_token_ids: tuple[int, ...] = (),
        kv=None,
        lora=None,
    ) -> None:
        self.model_config = model_config
        self.model_name = model_name
        self.vocab_size = model_config.vocab_size
        self.max_model_len = max_model_len
        self.max_num_seqs = max_num_seqs
        self.max_logprobs = max_logprobs
        self.tokenizer = tokenizer
        self.grammars = grammars  # the engine's StructuredOutputCompiler
        self.eos_token_ids = tuple(eos_token_ids)
        self.kv = kv  # the scheduler's KVAllocator (None: no KV rule, as in tests without a cache)
        self.lora = lora  # the LoRAManager (None: LoRA off)

    # ---- the rules ----
    def check_params(
        self, params: SamplingParams | None, pooling: PoolingParams | None = None
    ) -> tuple[SamplingParams, Task]:
        """The request's task (from params and pooling: engine/core/request_kinds.py) and the params
        it runs with, checked against the model and the engine's limits."""
        task = make_task(params, pooling)
        task.check(self.model_config, self.model_name)
        params = task.params(params)
        rules.stop_tokens_leave_a_choice(params, self.eos_token_ids)
        for name in ("logprobs", "prompt_logprobs"):
            rules.logprobs_limit(name, getattr(params, name), self.max_logprobs)
        rules.samples_limit(params.n, self.max_num_seqs)
        for name, ids in params.token_id_fields():
            self.check_token_ids(ids, name)
        return params, task

    def check_token_ids(self, ids: list[int], param: str) -> None:
        rules.token_ids(ids, self.vocab_size, param)

    def check_length(self, num_prompt_tokens: int, max_tokens: int | None, param: str = "prompt") -> None:
        rules.prompt_length(num_prompt_tokens, max_tokens, self.max_model_len, param)

    def fit_prompt(
        self, text: str | None, ids: list[int], params: SamplingParams, param: str = "prompt"
    ) -> tuple[str | None, list[int]]:
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

    def prompt_ids(
        self, prompt: str | list[int], params: SamplingParams, param: str = "prompt"
    ) -> tuple[str | None, list[int]]:
        """encode(), then fit_prompt()."""
        text, ids = self.encode(prompt, param)
        return self.fit_prompt(text, ids, params, param)

    def compile(self, params: SamplingParams) -> Any:
        """The compiled constraint of params.structured_outputs (None without one)."""
        if params.structured_outputs is None:
            return None
        return self.grammars.compile(params.structured_outputs)

    # ---- the request ----
    def request(
        self,
        text: str | None,
        ids: list[int],
        params: SamplingParams,
        task: Task,
        request_id: str | None = None,
        priority: int = 0,
        arrival_time: float | None = None,
        lora_request: LoRARequest | None = None,
        grammar: Any = None,
        output_kind: str | None = None,
    ) -> AdmittedRequest:
        """The admitted request of checked parts, with the rules of the engine's state checked here
        (the adapter can run, the request fits the KV cache at its priority): its own params copy,
        max_tokens resolved (None: up to max_model_len), output_kind set if given."""
        rules.lora_adapter(self.lora, lora_request)
        changes: dict[str, Any] = {}
        max_tokens = params.max_tokens if params.max_tokens is not None else self.max_model_len - len(ids)
        if self.kv is not None:
            rules.kv_capacity(self.kv, len(ids) + max_tokens, priority)
        if params.max_tokens is None:
            changes["max_tokens"] = max_tokens
        if output_kind is not None:
            changes["output_kind"] = output_kind
        return AdmittedRequest(
            request_id or uuid.uuid4().hex,
            text,
            ids,
            params.clone(**changes),
            task,
            priority,
            arrival_time if arrival_time is not None else time.monotonic(),
            lora_request,
            grammar,
        )

    def admit(
        self,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
        priority: int = 0,
        lora_request: LoRARequest | None = None,
        pooling: PoolingParams | None = None,
        output_kind: str | None = None,
        arrival_time: float | None = None,
    ) -> AdmittedRequest:
        """Every step, in order, on the calling thread (a constraint compiles here)."""
        params, task = self.check_params(params, pooling)
        text, ids = self.prompt_ids(prompt, params)
        return self.request(
            text, ids, params, task, request_id, priority, arrival_time, lora_request, self.compile(params), output_kind
        )

    async def admit_async(
        self,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
        priority: int = 0,
        lora_request: LoRARequest | None = None,
        pooling: PoolingParams | None = None,
        output_kind: str | None = None,
        arrival_time: float | None = None,
    ) -> AdmittedRequest:
        """admit() with the constraint compiled off the event loop (StructuredOutputCompiler.compile_async)."""
        params, task = self.check_params(params, pooling)
        text, ids = self.prompt_ids(prompt, params)
        grammar = None
        if params.structured_outputs is not None:
            grammar = await self.grammars.compile_async(params.structured_outputs)
        return self.request(
            text, ids, params, task, request_id, priority, arrival_time, lora_request, grammar, output_kind
        )
