"""The engine's limits (max_model_len, max_num_seqs, max_logprobs, the vocabulary, the KV pool,
request ids in use) and its LoRA adapters, each taken as an argument: core holds no engine state."""

from __future__ import annotations

from typing import Any, Callable, Container

from engine.core.admission_rules.params import MAX_STOP_CHARS, MAX_STOP_STRINGS
from engine.core.admission_rules.refusal import InvalidRequestError


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


# A tool's definition (its name, description and JSON schema) is rendered into the prompt by the
# chat template and may be compiled into a grammar: bounded in JSON values, nesting and in all.
MAX_TOOL_VALUES = 10_000  # one tool's definition
MAX_TOOL_DEPTH = 32  # containers inside one another, the tool's own object counted
MAX_TOOLS_VALUES = 50_000  # all of a request's tools together


def _json_size(value: Any, max_values: int, max_depth: int, tick: Callable[[], None] | None) -> tuple[int, int]:
    """(values, deepest nesting) of a parsed JSON value, the walk stopped as soon as either
    passes its bound (the work is bounded by them, not by what was sent)."""
    values, deepest = 0, 0
    stack = [(value, 1)]
    while stack and values <= max_values and deepest <= max_depth:
        item, depth = stack.pop()
        values += 1
        if isinstance(item, (dict, list)) and len(item) > max_values:
            return values + len(item), max(deepest, depth)  # (too many at once: no need to walk them)
        if isinstance(item, dict):
            deepest = max(deepest, depth)
            stack.extend((v, depth + 1) for v in item.values())
            values += len(item)  # (the keys)
        elif isinstance(item, list):
            deepest = max(deepest, depth)
            stack.extend((v, depth + 1) for v in item)
        if tick is not None and values & 1023 == 0:
            tick()
    return values, deepest


def tool_definition_size(tools: list, tick: Callable[[], None] | None = None) -> None:
    """Each tool's definition within MAX_TOOL_VALUES JSON values (keys counted) and MAX_TOOL_DEPTH
    levels of nesting, and all of them within MAX_TOOLS_VALUES (the server's body parser, before
    validation; `tick`: called every 1,024 values)."""
    total = 0
    for i, tool in enumerate(tools):
        values, depth = _json_size(tool, MAX_TOOL_VALUES, MAX_TOOL_DEPTH, tick)
        if depth > MAX_TOOL_DEPTH:
            raise InvalidRequestError(
                f"tools[{i}]: the definition is nested more than {MAX_TOOL_DEPTH} levels deep", f"tools[{i}]"
            )
        if values > MAX_TOOL_VALUES:
            raise InvalidRequestError(
                f"tools[{i}]: the definition holds more than {MAX_TOOL_VALUES} JSON values", f"tools[{i}]"
            )
        total += values
        if total > MAX_TOOLS_VALUES:
            raise InvalidRequestError(
                f"tools: the definitions hold more than {MAX_TOOLS_VALUES} JSON values together", "tools"
            )


def content_part_count(count: int, max_model_len: int) -> None:
    """Content parts over all messages: each takes at least a token of the context."""
    if count > max_model_len:
        raise InvalidRequestError(
            f"messages: {count} content parts cannot fit in max_model_len={max_model_len} tokens", "messages"
        )


def stop_string_count(stops: list, param: str) -> None:
    """A request's stop strings before they are validated one by one (the server's body parser):
    SamplingParams' stop rows, checked from len() first."""
    if len(stops) > MAX_STOP_STRINGS:
        raise InvalidRequestError(f"at most {MAX_STOP_STRINGS} stop strings, got {len(stops)}", param)
    chars = sum(len(s) for s in stops if isinstance(s, str))
    if chars > MAX_STOP_CHARS:
        raise InvalidRequestError(f"the stop strings hold {chars} characters, more than {MAX_STOP_CHARS}", param)


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
