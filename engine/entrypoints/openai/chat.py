"""POST /v1/chat/completions and its response format: tool calls and reasoning content,
whole or streamed."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request

from engine.core import admission_rules as rules
from engine.core.outputs import RequestOutput
from engine.entrypoints.openai.admission import (
    chat_prompt_ids,
    check_constraint,
    check_model,
    check_params,
    conversation_chars,
    fit_prompts,
    tenant_of,
    text_bound,
    with_reasoning_markers,
)
from engine.entrypoints.openai.errors import post_route
from engine.entrypoints.openai.generation import generate
from engine.entrypoints.openai.generation_request import GenerationRequest
from engine.entrypoints.openai.jobs import Choice, FormatBase, Job, envelope
from engine.entrypoints.openai.protocol import ChatCompletionRequest
from engine.entrypoints.openai.reasoning import KEEP_SPECIAL_TOKENS, ReasoningParser
from engine.entrypoints.openai.tool_calls import ToolCall, ToolMode
from engine.entrypoints.openai.tool_parsers import REGISTRY


def tool_finish_reason(mode: ToolMode, calls: list[ToolCall], finish: str | None) -> str | None:
    """OpenAI's finish reasons with tools: "tool_calls" when the model chose to call (auto,
    required); a named choice keeps "stop", as OpenAI's API does."""
    if calls and finish == "stop" and mode.kind != "named":
        return "tool_calls"
    return finish


def keeps_special_tokens(mode: ToolMode, reasoning: str | None) -> bool:
    """Whether the output's text must keep special tokens: the auto tool parser's or the
    reasoning parser's markers are special tokens (Mistral's [TOOL_CALLS], harmony's channels)."""
    tools = mode.kind == "auto" and mode.parser is not None and REGISTRY[mode.parser].keep_special_tokens
    return tools or (reasoning is not None and reasoning in KEEP_SPECIAL_TOKENS)


def split_answer(job: Job, text: str, final: bool) -> tuple[str | None, str]:
    """(reasoning, content) of a chat answer: the reasoning parser's split when the job has one."""
    if job.reasoning is None:
        return None, text
    reasoning, content = job.reasoning.split(text, final)
    return reasoning, content or ""


def chat_stream_delta(job: Job, ch: Choice, piece: str, finish: str | None) -> tuple[dict[str, Any], str | None]:
    """The delta of one streamed chat choice with a reasoning parser or tools. Reasoning streams
    as reasoning_content; a named call streams its arguments as they come; auto streams content
    up to where a call may start, and each call as it is written where the parser can tell
    (tool_parsers/streaming.py), else whole when the output ends."""
    ch.text += piece
    final = finish is not None
    reasoning, content = split_answer(job, ch.text, final)
    delta: dict[str, Any] = {}
    if reasoning and len(reasoning) > ch.reasoning_sent:
        delta["reasoning_content"] = reasoning[ch.reasoning_sent :]
        ch.reasoning_sent = len(reasoning)
    mode = job.tool_mode
    if mode is None:
        if len(content) > ch.streamed:
            delta["content"] = content[ch.streamed :]
            ch.streamed = len(content)
        return delta, finish
    if mode.kind == "named":
        new, ch.streamed = content[ch.streamed :], len(content)
        if ch.call is None:
            ch.call = ToolCall(mode.name, new)
            delta["tool_calls"] = [ch.call.to_openai(0)]
            return delta, tool_finish_reason(mode, [ch.call], finish)
        if new:
            delta["tool_calls"] = [{"index": 0, "function": {"arguments": new}}]
        return delta, finish
    if not final:
        safe = mode.streamable(content)
        if safe > ch.streamed:
            delta["content"] = content[ch.streamed : safe]
            ch.streamed = safe
        if called := ch.calls.update(mode.progress(content)):
            delta["tool_calls"] = called
        return delta, None
    answer, calls = mode.calls(content)
    if ch.calls.sent and not calls:
        # Calls went out, and the whole output does not parse as calls (cut short by max_tokens, or
        # malformed): they stay as sent (as OpenAI's stream leaves a cut call), their text is no content.
        answer = content[: mode.streamable(content)]
    sent = content[: ch.streamed]
    rest = (answer or "")[len(sent) :] if (answer or "").startswith(sent) else ""
    if rest:
        delta["content"] = rest
    if called := ch.calls.finish(calls):
        delta["tool_calls"] = called
    return delta, tool_finish_reason(mode, calls, finish)


class ChatFormat(FormatBase):
    chunk_object = "chat.completion.chunk"

    def first_chunks(self, job: Job) -> list[dict[str, Any]]:
        return [
            {"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
            for i in range(len(job.streams) * job.n)
        ]

    def _logprobs(self, job: Job, token_ids: list[int], entries: list[dict[int, float]]) -> dict | None:
        if job.params.logprobs is None:
            return None
        return {"content": self.lp.chat(token_ids, entries, job.params.logprobs)}

    def stream_choice(
        self, job: Job, ch: Choice, idx: int, pidx: int, c, delta: RequestOutput, first: bool
    ) -> dict[str, Any]:
        lp = self._logprobs(job, c.token_ids, c.logprobs or [])
        if job.tool_mode is not None or job.reasoning is not None:
            msg, finish = chat_stream_delta(job, ch, c.text, c.finish_reason)
        else:
            msg, finish = ({"content": c.text} if c.text or not c.finish_reason else {}), c.finish_reason
        return {"index": idx, "delta": msg, "logprobs": lp, "finish_reason": finish, "stop_reason": c.stop_reason}

    def final_body(self, job: Job, results: list[tuple[Choice, RequestOutput | None]]) -> dict[str, Any]:
        choices = []
        for i, (ch, out) in enumerate(results):
            reasoning, content = split_answer(job, ch.text, final=True)
            message: dict[str, Any] = {"role": "assistant", "content": content}
            if job.reasoning is not None:
                message = {"role": "assistant", "reasoning_content": reasoning, "content": content or None}
            finish = ch.finish_reason
            if job.tool_mode is not None:
                answer, calls = job.tool_mode.calls(content)
                message["content"] = answer
                if calls:
                    message["tool_calls"] = [c.to_openai() for c in calls]
                finish = tool_finish_reason(job.tool_mode, calls, finish)
            choices.append(
                {
                    "index": i,
                    "message": message,
                    "logprobs": self._logprobs(job, ch.token_ids, ch.logprobs),
                    "finish_reason": finish,
                    "stop_reason": ch.stop_reason,
                }
            )
        body = envelope(job, "chat.completion", self.state.model_name, choices)
        if job.params.prompt_logprobs is not None:
            body["prompt_logprobs"] = self.lp.prompt(results[0][1] if results else None)
        return body


async def conversation_ids(
    state,
    conversation: list[dict[str, Any]],
    add_generation_prompt: bool,
    tools: list[dict[str, Any]] | None = None,
    continue_final: bool = False,
    template_kwargs: dict[str, Any] | None = None,
) -> list[int]:
    """The chat-templated prompt's ids, made on the tokenising threads. The whole conversation
    is bounded before templating, the rendered text before tokenising. The server's
    --default-chat-template-kwargs sit under the request's own."""
    defaults = state.settings.default_chat_template_kwargs
    if defaults:
        template_kwargs = {**defaults, **(template_kwargs or {})}
    max_chars = text_bound(state.info, state.max_token_chars)
    chars = conversation_chars(conversation, tools)
    rules.text_length(chars, max_chars, state.info.max_model_len, "messages", "the conversation")
    return await state.off_loop(
        chat_prompt_ids,
        state.tokenizer,
        conversation,
        add_generation_prompt,
        tools,
        continue_final,
        template_kwargs,
        max_chars,
        state.info,
        size=chars,
    )


async def chat_generation(state, body: ChatCompletionRequest, request: Request) -> GenerationRequest:
    """The body's parts checked in order (model, tools, params, the templated prompt, the
    constraint) into the one generation request they make (the Messages and Responses APIs
    come here too, their bodies written as a chat request)."""
    lora = check_model(state, body.model)
    tool_mode = body.tool_mode(state.settings.auto_tool_parser)
    params, task = check_params(state, body.sampling_params(tool_mode, state.info.generation_defaults), 1)
    if keeps_special_tokens(tool_mode, state.settings.reasoning_parser):
        params.skip_special_tokens = False  # the parser's markers are special tokens
    conversation = body.conversation()
    tools = body.template_tools()
    ids = await conversation_ids(
        state, conversation, body.add_generation_prompt, tools, body.continue_final_message, body.chat_template_kwargs
    )
    ids = fit_prompts(state, [ids], params, "messages")
    grammar = await check_constraint(state, params, body.constraint_field(), tenant_of(request, body.user), request)
    with_reasoning_markers(state, params)
    reasoning = state.settings.reasoning_parser
    return GenerationRequest(
        "chat",
        ids,
        [None],
        params,
        task,
        grammar,
        lora,
        priority=body.priority,
        stream=bool(body.stream),
        include_usage=body.include_usage,
        continuous_usage=body.continuous_usage,
        use_beam_search=body.use_beam_search,
        length_penalty=body.length_penalty,
        tool_mode=tool_mode if tool_mode.kind != "none" else None,
        reasoning=ReasoningParser(reasoning) if reasoning is not None else None,
    )


async def create_chat_completion(state, body: ChatCompletionRequest, request: Request):
    return await generate(state, await chat_generation(state, body, request), ChatFormat(state), request)


def router(state) -> APIRouter:
    r = APIRouter()
    post_route(r, "/v1/chat/completions", ChatCompletionRequest, create_chat_completion, state)
    return r
