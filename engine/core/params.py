"""What a request asks for: its sampling parameters (vLLM's SamplingParams), an embedding's pooling,
a structured-output constraint and a LoRA adapter. Each checks itself against the admission table
(engine/core/admission_rules/) when made."""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any, Callable

from engine.core import admission_rules as rules


@dataclass(frozen=True)
class PoolingParams:
    """An embedding request (vLLM's PoolingParams): the prompt's final hidden states pooled
    ("last": the last token's, as LLM-based embedders such as Qwen3-Embedding and e5-mistral
    use; "mean": the average over the prompt), L2-normalised unless normalize is False, and
    cut to the first `dimensions` values first (Matryoshka embeddings) if given."""

    pooling_type: str = "last"
    normalize: bool = True
    dimensions: int | None = None

    def __post_init__(self) -> None:
        rules.pooling(self)


@dataclass(frozen=True)
class LoRARequest:
    """Which LoRA adapter (a PEFT directory) a request runs with; vLLM's LoRARequest (engine/lora/adapters.py)."""

    lora_name: str
    lora_int_id: int
    lora_path: str


@dataclass
class StructuredOutputsParams:
    """Constrain the output to a language (vLLM's StructuredOutputsParams); set exactly one of
    json (a JSON schema, dict or string), json_object (any JSON object), regex, choice (one of
    these strings) or grammar (EBNF, xgrammar's dialect of GBNF). engine/structured_output/grammars.py
    compiles it."""

    json: dict | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool = False
    # JSON only: no free whitespace between tokens (compact output; fewer tokens to sample).
    disable_any_whitespace: bool = False
    # Reasoning models: (token ids that open the thinking block, ids that close it). The output
    # is free until the block closes, and constrained after (the server sets this when it has a
    # reasoning parser). A prompt whose last block is already closed starts constrained.
    reasoning_markers: tuple[tuple[int, ...], tuple[int, ...]] | None = None

    def __post_init__(self) -> None:
        if isinstance(self.json, str):
            self.json = rules.schema_from_text(self.json)
        if self.choice is not None:
            self.choice = list(self.choice)
        self.validate()

    @property
    def kind(self) -> str:
        return rules.constraint_kind(self)

    def validate(self) -> None:
        rules.constraint(self)

    def cache_key(self) -> str:
        """Equal constraints, equal keys (compiled grammars are cached by it)."""
        import json

        return json.dumps(
            [self.kind, self.json, self.regex, self.choice, self.grammar, self.disable_any_whitespace], sort_keys=True
        )


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 or 0: off
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    max_tokens: int | None = 16  # None: up to max_model_len
    min_tokens: int = 0
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    logprobs: int | None = None  # top-N logprobs per generated token (0: only the chosen token)
    # top-N logprobs of each prompt token given the tokens before it (0: only the prompt token's own);
    # such a request is computed whole, without prefix-cache hits.
    prompt_logprobs: int | None = None
    # Added to the token's logit before sampling (OpenAI's logit_bias; -100 bans, +100 forces).
    logit_bias: dict[int, float] | None = None
    # Only these tokens may be sampled (vLLM's allowed_token_ids).
    allowed_token_ids: list[int] | None = None
    skip_special_tokens: bool = True
    detokenize: bool = True
    # What each step's RequestOutput holds (vLLM's RequestOutputKind): "cumulative" (everything so
    # far), "delta" (only what is new since the request's previous output; AsyncEngine's streams)
    # or "final_only" (one output, when the request finishes; LLM.generate).
    output_kind: str = "cumulative"
    # Callables (output_token_ids, logits_row) -> logits_row, applied in order to this request's
    # rows before sampling. One that raises (or yields NaN / +inf) fails only this request.
    logits_processors: list[Callable[[list[int], Any], Any]] | None = None
    # Constrain the output to a JSON schema, regex, choice or grammar (vLLM's structured outputs).
    structured_outputs: StructuredOutputsParams | None = None
    # Keep only the last N prompt tokens (vLLM's truncate_prompt_tokens; for inputs over max_model_len).
    truncate_prompt_tokens: int | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        self.logits_processors = list(self.logits_processors or [])
        self.logit_bias = rules.logit_bias_map(self.logit_bias)
        if self.allowed_token_ids is not None:
            self.allowed_token_ids = list(self.allowed_token_ids)
        if isinstance(self.structured_outputs, dict):
            self.structured_outputs = rules.constraint_from_fields(StructuredOutputsParams, self.structured_outputs)
        self.validate()

    def validate(self) -> None:
        rules.sampling(self)

    def clone(self, **changes: Any) -> "SamplingParams":
        """A request's own copy (its own stop lists), with the engine's `changes` set. Not validated
        again: the params were validated when they were made, and the changes are the engine's."""
        new = copy.copy(self)
        new.stop, new.stop_token_ids = list(self.stop or ()), list(self.stop_token_ids or ())
        for name, value in changes.items():
            if name not in self.__dataclass_fields__:
                raise TypeError(f"SamplingParams has no field {name!r}")
            setattr(new, name, value)
        return new

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5

    def token_id_fields(self) -> list[tuple[str, list[int]]]:
        """(parameter, token ids) for every parameter naming tokens (checked against the vocabulary)."""
        return [
            ("stop_token_ids", self.stop_token_ids or []),
            ("logit_bias", list(self.logit_bias or ())),
            ("allowed_token_ids", self.allowed_token_ids or []),
        ]

    @property
    def restricts_tokens(self) -> bool:
        """logit_bias or allowed_token_ids change this request's logits."""
        return bool(self.logit_bias) or self.allowed_token_ids is not None

    @property
    def needs_penalties(self) -> bool:
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1.0
