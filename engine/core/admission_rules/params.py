"""The params' own rules: SamplingParams, StructuredOutputsParams and PoolingParams check
themselves with these rows when made; the task against the model (generate, embed)."""

from __future__ import annotations

import json
from typing import Any, Callable

from engine.core.admission_rules.refusal import InvalidRequestError, Row, _check

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
