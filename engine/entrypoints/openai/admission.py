"""The server's side of admission: which model, is the text valid Unicode and of a size that can
fit, how many prompts and samples one HTTP request may hold, does the structured-output
constraint compile in time (in the compile pool, stopped if the client leaves). Tokenisation
and chat templates run here too, on the server's tokenising threads, never on the event loop.

The rules every request meets (the params against the engine's limits, token ids against the
vocabulary, the prompt's length) are the engine's one admission step's
(engine/runtime/admission.py), called from here step by step, once each; the engine takes the
admitted request as it is. Every rule, the server's own included, is written in
engine/core/admission_rules/.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from engine.core import admission_rules as rules
from engine.core.admission_rules import InvalidRequestError
from engine.core.params import LoRARequest, PoolingParams, SamplingParams
from engine.core.request_kinds import Task
from engine.entrypoints.openai.errors import APIError, ClientGone
from engine.entrypoints.openai.jobs import until_done
from engine.entrypoints.openai.reasoning import ReasoningParser
from engine.entrypoints.openai.request_body import max_prompts
from engine.runtime.engine_info import EngineInfo

# A tokenizer normalizer can shorten text a little (strip, collapse): leave room for it.
_NORMALIZER_SLACK = 2


# ---- which model ----
def check_model(state, model: str | None) -> LoRARequest | None:
    """None for the base model; the adapter's LoRARequest for a LoRA adapter's name; else 404."""
    if model is None or model == state.model_name or model in state.settings.model_names:
        return None
    adapter = state.engine.find_lora(model)
    if adapter is not None:
        return adapter
    served = ", ".join(repr(m) for m in [state.model_name, *(a.lora_name for a in state.adapters())])
    raise APIError(
        404,
        f"the model {model!r} does not exist; this server serves {served}",
        "invalid_request_error",
        "model",
        "model_not_found",
    )


# ---- text ----
def max_token_chars(tokenizer) -> int:
    """The most UTF-8 bytes any one token stands for (at least its text's length in characters)."""
    vocab = tokenizer.get_vocab()
    return max((len(t.encode("utf-8", "replace")) for t in vocab), default=1)


def text_bound(info: EngineInfo, per_token: int) -> int:
    """The most characters a text of max_model_len tokens can have (each token covers at most
    `per_token` characters, and the normalizer may shorten a little)."""
    return info.max_model_len * per_token * _NORMALIZER_SLACK


def check_text_size(info: EngineInfo, per_token: int, text: str, param: str) -> None:
    """Refuse a text that must be longer than max_model_len tokens without tokenising it: a
    6 MB prompt is refused in microseconds."""
    rules.text_length(len(text), text_bound(info, per_token), info.max_model_len, param)


def conversation_chars(conversation: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> int:
    """A lower bound on the length of the rendered conversation: every message's text, name and
    tool calls, and the tools, appear in it (counted without rendering anything)."""
    chars = len(json.dumps(tools)) if tools else 0
    for m in conversation:
        chars += len(m["content"]) + len(m.get("name") or "")
        if m.get("tool_calls"):
            chars += len(json.dumps(m["tool_calls"]))
    return chars


# ---- tokenising (call through ServerState.off_loop) ----
def encode(tokenizer, text: str, add_special_tokens: bool = True) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=add_special_tokens)


def chat_prompt_ids(
    tokenizer,
    conversation: list[dict[str, Any]],
    add_generation_prompt: bool = True,
    tools: list[dict[str, Any]] | None = None,
    continue_final_message: bool = False,
    template_kwargs: dict[str, Any] | None = None,
    max_chars: int | None = None,
    info: EngineInfo | None = None,
) -> list[int]:
    """The conversation templated and tokenised; a rendered text over `max_chars` is refused
    before tokenising (the template adds text of its own, unbounded by the messages)."""
    if continue_final_message:
        rules.continue_final_message(add_generation_prompt, conversation[-1]["role"])
    kwargs = dict(template_kwargs or {})
    rules.template_kwargs(kwargs)
    try:
        text = tokenizer.apply_chat_template(
            conversation,
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
            tools=tools,
            continue_final_message=continue_final_message,
            **kwargs,
        )
    except Exception as exc:  # noqa: BLE001 - template errors are the request's fault
        raise rules.template_failed(exc) from exc
    if max_chars is not None and info is not None:
        rules.text_length(len(text), max_chars, info.max_model_len, "messages", "the rendered conversation")
    return tokenizer.encode(text, add_special_tokens=False)


# Token ids checked against the vocabulary between two turns of the event loop (~0.5 ms): a
# prompt may hold up to max_request_json_values ids (with truncate_prompt_tokens), which checked at
# once held the loop ~50 ms.
IDS_PER_TURN = 16384


async def prompt_ids(state, prompts: list[str | list[int]], param: str) -> list[list[int]]:
    """Token ids of each prompt (texts tokenised off the loop; id lists checked against the
    vocabulary, IDS_PER_TURN at a time)."""
    out = []
    checked = 0
    for i, p in enumerate(prompts):
        where = param if len(prompts) == 1 else f"{param}[{i}]"
        if isinstance(p, str):
            check_text_size(state.info, state.max_token_chars, p, where)
            out.append(await state.off_loop(encode, state.tokenizer, p, size=len(p)))
            continue
        for start in range(0, len(p), IDS_PER_TURN):
            if checked >= IDS_PER_TURN:
                await asyncio.sleep(0)  # (the other streams' turn)
                checked = 0
            piece = p[start : start + IDS_PER_TURN] if len(p) > IDS_PER_TURN else p
            state.admission.check_token_ids(piece, where)
            checked += len(piece)
        out.append(list(p))
    return out


# ---- lengths and parameters ----
def fit_prompts(state, ids: list[list[int]], params: SamplingParams, param: str) -> list[list[int]]:
    """Each prompt's ids cut to truncate_prompt_tokens, its length checked (Admission.fit_prompt)."""
    return [
        state.admission.fit_prompt(None, p, params, param if len(ids) == 1 else f"{param}[{i}]")[1]
        for i, p in enumerate(ids)
    ]


def check_params(
    state, params: SamplingParams | None, num_prompts: int, pooling: PoolingParams | None = None
) -> tuple[SamplingParams, Task]:
    """The params and task the request runs with, checked against the engine's limits
    (Admission.check_params), and the number of prompts and samples against the server's."""
    params, task = state.admission.check_params(params, pooling)
    rules.prompt_count(num_prompts * params.n, max_prompts(state.info), "prompt" if pooling is None else "input")
    return params, task


# ---- structured outputs ----
async def check_constraint(state, params: SamplingParams, field: str, tenant: tuple[str, str], request) -> Any:
    """Compile the request's constraint in the server's compile pool (time-limited, stopped if
    the client goes away) so that one that does not compile, or not in time, is a 400 naming the
    `field` it came in. Returns the compiled grammar (None without a constraint): it travels with
    the admitted request, and the engine makes the matchers from it."""
    if params.structured_outputs is None:
        return None
    try:
        done = await until_done(
            state.engine.grammar_compiler.compile_async(params.structured_outputs, tenant), request, None, "compile"
        )
    except InvalidRequestError as exc:
        raise rules.constraint_in_field(field, exc) from exc
    if done is None:  # the client left: the compile was stopped with it
        raise ClientGone()
    return done


def with_reasoning_markers(state, params: SamplingParams) -> None:
    """With a reasoning parser, the constraint starts once the model has closed its thinking block."""
    if state.settings.reasoning_parser is None or params.structured_outputs is None:
        return
    tok = state.tokenizer
    tags = ReasoningParser(state.settings.reasoning_parser).markers
    markers = tuple(tuple(tok.encode(m, add_special_tokens=False)) for m in tags)
    params.structured_outputs.reasoning_markers = markers  # (the request's own constraint; not compiled in)


def tenant_of(request, user: str | None) -> tuple[str, str]:
    """Who a request is from, for fair sharing of the compile pool: (the connection's address,
    OpenAI's `user` field). The address is what the client cannot multiply; `user`, which it
    sets freely, only shares out its address's turn. (kiln has one API key for every client,
    so the key would not tell clients apart.)"""
    client = request.client
    return (client.host if client else "-"), (user or "")
