"""Admission's rules: everything that refuses a request, each rule written once, here.

A refusal is an InvalidRequestError naming the request field at fault (the server's 400 and its
`param`). Every caller meets the same rules through this table: the offline `LLM`, the server
(engine/entrypoints/openai/), beam search (its params are SamplingParams, checked as any other),
and the params' own constructors (SamplingParams, PoolingParams, StructuredOutputsParams check
themselves with the rows below when made). tests/core/test_admission.py fails on any refusal
written elsewhere in engine/ (but a short allow-list: malformed JSON, a grammar's compile...).

The table lives in core (plain Python, no engine imports) because core's params use it; the
rules that need the engine's state (its limits, KV pool, adapters) take it as arguments.
"""

from __future__ import annotations

import json
from typing import Any, Callable, Container


class InvalidRequestError(ValueError):
    """A request that can never be served as given (bad parameters, too long)."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


Row = tuple[str, Callable[[Any], bool], Callable[[Any], str]]  # (param, holds, message)


def _check(rows: tuple[Row, ...], value: Any) -> None:
    for param, holds, message in rows:
        if not holds(value):
            raise InvalidRequestError(message(value), param)


# ---- SamplingParams (checked when made) ----
OUTPUT_KINDS = ("cumulative", "delta", "final_only")
# Stop strings: checking them costs one matcher whatever their number (engine/runtime/stop_strings.py);
# these bound what building it may take (docs/usage.md).
MAX_STOP_STRINGS = 1024
MAX_STOP_CHARS = 65536  # all of a request's stop strings together

SAMPLING: tuple[Row, ...] = (
    ("n", lambda p: p.n >= 1, lambda p: f"n must be at least 1, got {p.n}"),
    ("temperature", lambda p: p.temperature >= 0, lambda p: f"temperature must be non-negative, got {p.temperature}"),
    ("top_p", lambda p: 0.0 < p.top_p <= 1.0, lambda p: f"top_p must be in (0, 1], got {p.top_p}"),
    ("top_k", lambda p: p.top_k >= -1, lambda p: f"top_k must be -1 (off) or at least 1, got {p.top_k}"),
    ("min_p", lambda p: 0.0 <= p.min_p <= 1.0, lambda p: f"min_p must be in [0, 1], got {p.min_p}"),
    (
        "presence_penalty",
        lambda p: -2.0 <= p.presence_penalty <= 2.0,
        lambda p: f"presence_penalty must be in [-2, 2], got {p.presence_penalty}",
    ),
    (
        "frequency_penalty",
        lambda p: -2.0 <= p.frequency_penalty <= 2.0,
        lambda p: f"frequency_penalty must be in [-2, 2], got {p.frequency_penalty}",
    ),
    (
        "repetition_penalty",
        lambda p: p.repetition_penalty > 0,
        lambda p: f"repetition_penalty must be positive, got {p.repetition_penalty}",
    ),
    (
        "max_tokens",
        lambda p: p.max_tokens is None or p.max_tokens >= 1,
        lambda p: f"max_tokens must be at least 1, got {p.max_tokens}",
    ),
    ("min_tokens", lambda p: p.min_tokens >= 0, lambda p: f"min_tokens must be non-negative, got {p.min_tokens}"),
    (
        "min_tokens",
        lambda p: p.max_tokens is None or p.min_tokens <= p.max_tokens,
        lambda p: f"min_tokens ({p.min_tokens}) must not exceed max_tokens ({p.max_tokens})",
    ),
    # (the upper bounds are the engine's max_logprobs: logprobs_limit)
    (
        "logprobs",
        lambda p: p.logprobs is None or p.logprobs >= 0,
        lambda p: f"logprobs must be non-negative, got {p.logprobs}",
    ),
    (
        "prompt_logprobs",
        lambda p: p.prompt_logprobs is None or p.prompt_logprobs >= 0,
        lambda p: f"prompt_logprobs must be non-negative, got {p.prompt_logprobs}",
    ),
    (
        "logit_bias",
        lambda p: not p.logit_bias or all(-100.0 <= b <= 100.0 for b in p.logit_bias.values()),
        lambda p: "logit_bias values must be in [-100, 100]",
    ),
    (
        "truncate_prompt_tokens",
        lambda p: p.truncate_prompt_tokens is None or p.truncate_prompt_tokens >= 1,
        lambda p: f"truncate_prompt_tokens must be at least 1, got {p.truncate_prompt_tokens}",
    ),
    (
        "allowed_token_ids",
        lambda p: p.allowed_token_ids is None or bool(p.allowed_token_ids),
        lambda p: "allowed_token_ids must not be empty",
    ),
    (
        "output_kind",
        lambda p: p.output_kind in OUTPUT_KINDS,
        lambda p: f"output_kind must be one of {', '.join(OUTPUT_KINDS)}, got {p.output_kind!r}",
    ),
    ("stop", lambda p: all(p.stop or ()), lambda p: "stop strings must be non-empty"),
    (
        "stop",
        lambda p: len(p.stop or ()) <= MAX_STOP_STRINGS,
        lambda p: f"at most {MAX_STOP_STRINGS} stop strings, got {len(p.stop)}",
    ),
    (
        "stop",
        lambda p: sum(map(len, p.stop or ())) <= MAX_STOP_CHARS,
        lambda p: f"the stop strings hold {sum(map(len, p.stop))} characters, more than {MAX_STOP_CHARS}",
    ),
    (
        "logits_processors",
        lambda p: all(callable(f) for f in p.logits_processors or []),
        lambda p: "logits_processors must be callables (output_token_ids, logits_row) -> logits_row",
    ),
    (
        "structured_outputs",
        lambda p: p.structured_outputs is None or hasattr(p.structured_outputs, "cache_key"),
        lambda p: "structured_outputs must be a StructuredOutputsParams",
    ),  # (which check themselves)
)


def sampling(params) -> None:
    _check(SAMPLING, params)


def logit_bias_map(raw: dict | None) -> dict[int, float] | None:
    """logit_bias with int keys (JSON gives the token ids as strings) and float values."""
    try:
        return {int(t): float(b) for t, b in (raw or {}).items()} or None
    except (TypeError, ValueError) as exc:
        raise InvalidRequestError(f"logit_bias must map token ids to numbers: {exc}", "logit_bias") from exc


def constraint_from_fields(make: Callable[..., Any], fields: dict, param: str = "structured_outputs") -> Any:
    """make(**fields) (a StructuredOutputsParams), refused under `param` if it does not make one."""
    try:
        return make(**fields)
    except TypeError as exc:  # an unknown key
        raise InvalidRequestError(f"{param}: {exc}", param) from exc
    except InvalidRequestError as exc:
        raise InvalidRequestError(str(exc), param) from exc


def stop_tokens_leave_a_choice(params, eos_token_ids) -> None:
    """min_tokens bans the stop tokens (EOS and stop_token_ids) until it is reached: an
    allowed_token_ids holding nothing else leaves no token to sample."""
    if (
        params.min_tokens > 0
        and params.allowed_token_ids is not None
        and set(params.allowed_token_ids) <= {*eos_token_ids, *(params.stop_token_ids or ())}
    ):
        raise InvalidRequestError(
            f"allowed_token_ids: every allowed token is a stop token (EOS or stop_token_ids), which "
            f"min_tokens={params.min_tokens} forbids until then: no token could be sampled",
            "allowed_token_ids",
        )


# ---- structured outputs (StructuredOutputsParams) ----
CONSTRAINT_KINDS = ("json", "regex", "choice", "grammar")


def schema_from_text(text: str) -> dict:
    try:
        return json.loads(text)
    except ValueError as exc:
        raise InvalidRequestError(
            f"structured output: the JSON schema is not valid JSON: {exc}", "structured_outputs"
        ) from exc


def constraint_kind(spec) -> str:
    """Exactly one of json, json_object, regex, choice or grammar is set: which."""
    given = [name for name in CONSTRAINT_KINDS if getattr(spec, name) is not None]
    if spec.json_object:
        given.append("json_object")
    if len(given) != 1:
        raise InvalidRequestError(
            "structured output: give exactly one of json, json_object, regex, choice or "
            f"grammar (got {', '.join(given) or 'none'})",
            "structured_outputs",
        )
    return given[0]


def _markers_ok(markers) -> bool:
    return markers is None or (len(markers) == 2 and all(m and all(isinstance(t, int) for t in m) for m in markers))


CONSTRAINT: tuple[Row, ...] = (
    (
        "structured_outputs",
        lambda s: s.json is None or isinstance(s.json, dict),
        lambda s: "structured output: json must be a JSON schema object",
    ),
    (
        "structured_outputs",
        lambda s: s.choice is None or (bool(s.choice) and all(isinstance(c, str) and c for c in s.choice)),
        lambda s: "structured output: choice must be a non-empty list of non-empty strings",
    ),
    (
        "structured_outputs",
        lambda s: s.regex is None or (isinstance(s.regex, str) and bool(s.regex)),
        lambda s: "structured output: regex must be a non-empty string",
    ),
    (
        "structured_outputs",
        lambda s: s.grammar is None or (isinstance(s.grammar, str) and bool(s.grammar)),
        lambda s: "structured output: grammar must be a non-empty string",
    ),
    (
        "structured_outputs",
        lambda s: _markers_ok(s.reasoning_markers),
        lambda s: "structured output: reasoning_markers must be (start token ids, end token ids)",
    ),
)


def constraint(spec) -> None:
    constraint_kind(spec)
    _check(CONSTRAINT, spec)


# ---- embeddings (PoolingParams) and the task against the model ----
POOLING_TYPES = ("last", "mean")

POOLING: tuple[Row, ...] = (
    (
        "pooling_type",
        lambda p: p.pooling_type in POOLING_TYPES,
        lambda p: f"pooling_type must be one of {', '.join(POOLING_TYPES)}, got {p.pooling_type!r}",
    ),
    (
        "dimensions",
        lambda p: p.dimensions is None or p.dimensions >= 1,
        lambda p: f"dimensions must be at least 1, got {p.dimensions}",
    ),
)


def pooling(params) -> None:
    _check(POOLING, params)


def model_generates(model_config, model_name: str) -> None:
    if not model_config.generates:
        raise InvalidRequestError(
            f"this checkpoint ({model_name}) has no language-model head: it "
            "serves embeddings only (/v1/embeddings, LLM.embed)",
            "model",
        )


def dimensions_fit(dims: int | None, hidden: int) -> None:
    if dims is not None and dims > hidden:
        raise InvalidRequestError(f"dimensions ({dims}) exceeds the model's hidden size ({hidden})", "dimensions")


# ---- the engine's limits ----
def logprobs_limit(name: str, value: int | None, max_logprobs: int) -> None:
    """logprobs, prompt_logprobs (and the chat API's top_logprobs) up to the max_logprobs setting."""
    if value is not None and value > max_logprobs:
        raise InvalidRequestError(
            f"{name} must be at most {max_logprobs} (the server's max_logprobs), got {value}", name
        )


def samples_limit(n: int, max_num_seqs: int) -> None:
    if n > max_num_seqs:
        raise InvalidRequestError(f"n ({n}) exceeds this server's max_num_seqs ({max_num_seqs})", "n")


def token_ids(ids: list, vocab: int, param: str) -> None:
    """Every id names a token of the model's vocabulary."""
    bad = [t for t in ids if not isinstance(t, int) or not 0 <= t < vocab]
    if bad:
        raise InvalidRequestError(f"{param}: token ids must be integers in [0, {vocab}); got {bad[:3]}", param)


def token_id_count(count: int, vocab: int, param: str) -> None:
    """A list of distinct-token ids (allowed_token_ids, stop_token_ids) longer than the vocabulary
    (refused from len() alone, before the body is parsed)."""
    if count > vocab:
        raise InvalidRequestError(f"{param}: {count} token ids, more than the vocabulary ({vocab})", param)


def prompt_length(num_prompt_tokens: int, max_tokens: int | None, max_model_len: int, param: str = "prompt") -> None:
    """The prompt fits in max_model_len with room for max_tokens (None: at least one token)."""
    if num_prompt_tokens == 0:
        raise InvalidRequestError(f"{param}: the prompt is empty", param)
    if num_prompt_tokens >= max_model_len:
        raise InvalidRequestError(
            f"{param}: the prompt has {num_prompt_tokens} token ids, which leaves no room "
            f"to generate within max_model_len={max_model_len}",
            param,
        )
    if max_tokens is not None and num_prompt_tokens + max_tokens > max_model_len:
        raise InvalidRequestError(
            f"prompt ({num_prompt_tokens} tokens) + max_tokens ({max_tokens}) = "
            f"{num_prompt_tokens + max_tokens} exceeds max_model_len={max_model_len}",
            "max_tokens",
        )


def text_length(chars: int, max_chars: int, max_model_len: int, param: str, what: str = "the text") -> None:
    """A text that must be longer than max_model_len tokens (refused before tokenising it)."""
    if chars > max_chars:
        raise InvalidRequestError(
            f"{param}: {what} ({chars} characters) is far longer than max_model_len={max_model_len} tokens", param
        )


def message_count(count: int, max_model_len: int) -> None:
    if count > max_model_len:
        raise InvalidRequestError(
            f"messages: {count} messages cannot fit in max_model_len={max_model_len} tokens", "messages"
        )


MAX_TOOLS = 1024  # (OpenAI's API takes 128)


def tool_count(count: int) -> None:
    """Tools offered in one chat request (refused from len() alone, before any tool is validated)."""
    if count > MAX_TOOLS:
        raise InvalidRequestError(f"tools: {count} tools, more than {MAX_TOOLS}", "tools")


def content_part_count(count: int, max_model_len: int) -> None:
    """Content parts over all messages: each takes at least a token of the context."""
    if count > max_model_len:
        raise InvalidRequestError(
            f"messages: {count} content parts cannot fit in max_model_len={max_model_len} tokens", "messages"
        )


def logit_bias_count(count: int, vocab: int) -> None:
    if count > vocab:
        raise InvalidRequestError(f"logit_bias: {count} entries, more than the vocabulary ({vocab})", "logit_bias")


def prompt_count(count: int, limit: int, param: str) -> None:
    """Prompts (times samples) in one request."""
    if count > limit:
        raise InvalidRequestError(
            f"{param}: too many prompts or samples in one request ({count}; at most {limit})", param
        )


def kv_capacity(kv, num_tokens: int, priority: int) -> None:
    """A request that may grow to num_tokens must fit the KV cache even when alone in it (the
    blocks its priority may use: engine/core/kv/allocator.py)."""
    needed = -(-num_tokens // kv.block_size)
    usable = kv.usable_blocks(priority)
    if needed > usable:
        raise InvalidRequestError(
            f"the request needs up to {needed} KV blocks but the cache holds only {usable} for priority {priority}",
            "max_tokens",
        )


def request_id_free(request_id: str, in_use: Container[str]) -> None:
    if request_id in in_use:
        raise InvalidRequestError(f"request id {request_id!r} is already in use", "request_id")


# ---- LoRA adapters ----
def lora_adapter(manager, lora_request) -> None:
    """The adapter can run: LoRA is on, and it is loaded or can be (engine/lora/adapters.py
    LoRAManager.why_not: its name is not another adapter's, a slot is free)."""
    if lora_request is None:
        return
    if manager is None:
        raise InvalidRequestError("LoRA adapters need the engine started with enable_lora", "model")
    why = manager.why_not(lora_request)
    if why is not None:
        raise InvalidRequestError(why, "model")


def adapter_unreadable(exc: Exception) -> InvalidRequestError:
    """An adapter whose files the loader refused (they are read when it loads, between steps)."""
    return InvalidRequestError(str(exc), "model")


# ---- the HTTP API's fields (engine/entrypoints/openai/protocol.py) ----
def prompt_given(count: int, param: str) -> None:
    if not count:
        raise InvalidRequestError(f"{'the prompt' if param == 'prompt' else param} must not be empty", param)


def suffix_unsupported(suffix: str | None) -> None:
    if suffix:
        raise InvalidRequestError(
            "suffix is not supported (fill-in-the-middle needs the model's own prompt format: put it in the prompt)",
            "suffix",
        )


def best_of(best_of: int | None, n: int) -> None:
    if best_of is not None and best_of != n:
        raise InvalidRequestError(
            "best_of is not supported (as in vLLM V1); ask for n samples and their logprobs instead", "best_of"
        )


def zero_max_tokens(echo: bool) -> None:
    """max_tokens=0 scores the prompt (with echo), else max_tokens' own rule (SAMPLING) holds."""
    if not echo:
        raise InvalidRequestError(
            "max_tokens must be at least 1 (0 only with echo=true, to score the prompt)", "max_tokens"
        )


def top_logprobs(value: int | None, logprobs: bool | None) -> None:
    """The chat API's top_logprobs (its upper bound is max_logprobs, as logprobs': logprobs_limit)."""
    if value is not None and not logprobs:
        raise InvalidRequestError("top_logprobs requires logprobs=true", "top_logprobs")
    if value is not None and value < 0:
        raise InvalidRequestError(f"top_logprobs must be non-negative, got {value}", "top_logprobs")


def json_schema_given(schema: dict | None) -> None:
    if schema is None:
        raise InvalidRequestError("response_format: type json_schema needs json_schema.schema", "response_format")


def one_constraint_field(names: list[str]) -> None:
    if len(names) > 1:
        raise InvalidRequestError("give one structured-output constraint, not several: " + ", ".join(names), names[1])


def forced_tool_alone(kind: str, other_constraint: bool) -> None:
    if other_constraint:
        raise InvalidRequestError(
            f"tool_choice {kind!r} constrains the output itself; it cannot be combined with "
            "response_format or another structured-output field",
            "tool_choice",
        )


CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")


def messages_given(count: int) -> None:
    if not count:
        raise InvalidRequestError("messages must not be empty", "messages")


def message_role(i: int, role: str) -> None:
    if role not in CHAT_ROLES:
        raise InvalidRequestError(
            f"messages[{i}].role: unknown role {role!r} (expected one of {', '.join(CHAT_ROLES)})",
            f"messages[{i}].role",
        )


def text_part(i: int, part_type: str, text: str | None) -> None:
    if part_type != "text" or text is None:
        raise InvalidRequestError(
            f"messages[{i}].content: only text parts are supported, got {part_type!r}", f"messages[{i}].content"
        )


def one_of_prompt_messages(prompt_set: bool, messages_set: bool) -> None:
    """/tokenize takes a prompt or messages."""
    if prompt_set == messages_set:
        raise InvalidRequestError("give exactly one of prompt or messages", "prompt")


def beam_search_alone(stream: bool, constrained: bool) -> None:
    """use_beam_search returns whole beams, unconstrained."""
    if stream:
        raise InvalidRequestError("use_beam_search cannot stream", "stream")
    if constrained:
        raise InvalidRequestError(
            "use_beam_search does not combine with structured outputs or tools", "use_beam_search"
        )


def constraint_does_not_compile(kind: str, why: Any) -> InvalidRequestError:
    """The compiler's verdict (engine/structured_output/grammars.py: only compiling tells)."""
    return InvalidRequestError(
        f"structured output: the {kind} constraint does not compile: {why}", "structured_outputs"
    )


def constraint_compile_timeout(kind: str, timeout_s: Any) -> InvalidRequestError:
    return InvalidRequestError(
        f"structured output: the {kind} constraint did not compile within "
        f"grammar_compile_timeout_s={timeout_s}s of CPU time; simplify it (e.g. fewer "
        "optional properties)",
        "structured_outputs",
    )


def constraint_compile_cancelled() -> InvalidRequestError:
    return InvalidRequestError("structured output: the compile was cancelled", "structured_outputs")


def constraints_unavailable() -> InvalidRequestError:
    return InvalidRequestError(
        "structured outputs need the xgrammar package (pip install xgrammar)", "structured_outputs"
    )


def constraint_in_field(name: str, exc: Exception) -> InvalidRequestError:
    """A constraint that does not compile (engine/structured_output/grammars.py's verdict), named by
    the request field it came in."""
    return InvalidRequestError(f"{name}: {exc}", name)


# ---- chat templates and tools ----
RESERVED_TEMPLATE_KWARGS = frozenset(
    {"conversation", "tokenize", "add_generation_prompt", "tools", "continue_final_message"}
)


def continue_final_message(add_generation_prompt: bool, last_role: str) -> None:
    if add_generation_prompt:
        raise InvalidRequestError("continue_final_message needs add_generation_prompt=false", "continue_final_message")
    if last_role != "assistant":
        raise InvalidRequestError("continue_final_message needs an assistant message last", "continue_final_message")


def template_kwargs(kwargs: dict) -> None:
    reserved = set(kwargs) & RESERVED_TEMPLATE_KWARGS
    if reserved:
        raise InvalidRequestError(
            f"chat_template_kwargs may not set {', '.join(sorted(reserved))}", "chat_template_kwargs"
        )


def template_failed(exc: Exception) -> InvalidRequestError:
    """The chat template raised on this conversation (a template's errors are the request's)."""
    return InvalidRequestError(f"messages: the chat template failed: {exc}", "messages")


def tool_name_unused(i: int, name: str, seen: Container[str]) -> None:
    if name in seen:
        raise InvalidRequestError(f"tools[{i}]: the function name {name!r} is used twice", "tools")


def named_tool_given(name: str, tools: Container[str]) -> None:
    if name not in tools:
        raise InvalidRequestError(f"tool_choice names the function {name!r}, which is not in tools", "tool_choice")


def tool_choice_needs_tools(tool_choice: Any) -> None:
    if tool_choice not in (None, "none"):
        raise InvalidRequestError(f"tool_choice {tool_choice!r} needs tools", "tool_choice")


def auto_tool_parser(parser: str | None) -> None:
    if parser is None:
        raise InvalidRequestError(
            'tool_choice "auto" (the default when tools are given) needs the server started with '
            "--enable-auto-tool-choice and --tool-call-parser (the model family's call format, e.g. hermes); "
            'or ask for "required", a named function, or "none"',
            "tool_choice",
        )
