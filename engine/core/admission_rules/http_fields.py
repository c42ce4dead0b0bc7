"""The HTTP API's fields (engine/entrypoints/openai/protocol.py), chat templates and tools."""

from __future__ import annotations

from typing import Any, Container

from engine.core.admission_rules.refusal import InvalidRequestError


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
