"""POST /v1/messages: Anthropic's Messages API (as vLLM and llama-server serve it), whole or
streamed. The request runs as the chat request it asks for (anthropic_protocol.py); here the
chat answer (its text, reasoning and tool calls, as chat.py splits them) is written as
Anthropic's message, or as its stream of events: message_start, content_block_start / _delta /
_stop per block, message_delta (the stop reason and usage), message_stop. Errors on this route
are in Anthropic's shape (errors.py)."""

from __future__ import annotations

import json
from typing import Any

from fastapi import APIRouter, Request

from engine.core.outputs import RequestOutput
from engine.entrypoints.openai.admission import check_model
from engine.entrypoints.openai.answer_blocks import AnswerBlocks
from engine.entrypoints.openai.anthropic_protocol import MessagesPrompt, MessagesRequest
from engine.entrypoints.openai.chat import ChatFormat, chat_generation, conversation_ids
from engine.entrypoints.openai.errors import anthropic_error_body, post_route
from engine.entrypoints.openai.generation import generate
from engine.entrypoints.openai.generation_request import GenerationRequest
from engine.entrypoints.openai.jobs import Choice, Job


def stop_reason(finish: str | None, matched: int | str | None, called: bool) -> tuple[str, str | None]:
    """(Anthropic's stop_reason, stop_sequence) of a finished choice."""
    if called:
        return "tool_use", None
    if finish == "length":
        return "max_tokens", None
    if isinstance(matched, str):
        return "stop_sequence", matched
    return "end_turn", None


def usage(job: Job, prompt_tokens: int | None = None) -> dict[str, int]:
    """Anthropic's usage: input_tokens leaves out the tokens read from the prefix cache."""
    cached = job.cached_tokens()
    prompt = job.num_prompt_tokens if prompt_tokens is None else prompt_tokens
    return {
        "input_tokens": prompt - cached,
        "output_tokens": job.num_completion_tokens,
        "cache_read_input_tokens": cached,
        "cache_creation_input_tokens": 0,
    }


def tool_use_block(call: dict[str, Any]) -> dict[str, Any]:
    """A chat tool call as a tool_use block (arguments that are not a JSON object stay text)."""
    fn = call["function"]
    try:
        arguments = json.loads(fn["arguments"], strict=False)  # (raw control characters: see json_text)
    except ValueError:
        arguments = None
    if not isinstance(arguments, dict):
        return {"type": "text", "text": fn["arguments"]}
    return {"type": "tool_use", "id": call["id"], "name": fn["name"], "input": arguments}


class MessageFormat(ChatFormat):
    """The whole answer as Anthropic's message, made from the chat body."""

    def final_body(self, job: Job, results: list[tuple[Choice, RequestOutput | None]]) -> dict[str, Any]:
        chat = super().final_body(job, results)
        choice = chat["choices"][0]
        message = choice["message"]
        content: list[dict[str, Any]] = []
        if message.get("reasoning_content"):
            content.append({"type": "thinking", "thinking": message["reasoning_content"], "signature": ""})
        if message.get("content"):
            content.append({"type": "text", "text": message["content"]})
        content += [tool_use_block(c) for c in message.get("tool_calls") or []]
        called = any(b["type"] == "tool_use" for b in content)
        reason, sequence = stop_reason(choice["finish_reason"], choice["stop_reason"], called)
        return {
            "id": job.id,
            "type": "message",
            "role": "assistant",
            "model": self.state.model_name,
            "content": content,
            "stop_reason": reason,
            "stop_sequence": sequence,
            "usage": usage(job),
        }


def event(name: str, data: dict[str, Any]) -> str:
    return f"event: {name}\ndata: {json.dumps({'type': name, **data})}\n\n"


class MessageEvents(AnswerBlocks):
    """Anthropic's stream: message_start, then per block of the answer (thinking, text,
    tool_use) content_block_start, its deltas and content_block_stop; then message_delta and
    message_stop. A call's arguments stream as input_json_delta pieces as they are written."""

    def __init__(self, model: str, gen: GenerationRequest) -> None:
        super().__init__()
        self.model, self.gen = model, gen

    def started(self, kind: str) -> list[str]:
        block: dict[str, Any] = {
            "reasoning": {"type": "thinking", "thinking": "", "signature": ""},
            "text": {"type": "text", "text": ""},
        }.get(kind) or {"type": "tool_use", **(self.call or {}), "input": {}}
        return [event("content_block_start", {"index": self.index, "content_block": block})]

    def delta(self, kind: str, text: str) -> list[str]:
        if kind == "reasoning":
            piece = {"type": "thinking_delta", "thinking": text}
        elif kind == "call":
            piece = {"type": "input_json_delta", "partial_json": text}
        else:
            piece = {"type": "text_delta", "text": text}
        return [event("content_block_delta", {"index": self.index, "delta": piece})]

    def stopped(self, kind: str, text: str) -> list[str]:
        return [event("content_block_stop", {"index": self.index})]

    def opening(self, job: Job) -> list[str]:
        prompt = sum(len(p) for p in self.gen.prompts)
        message = {
            "id": job.id,
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": {"input_tokens": prompt, "output_tokens": 0},
        }
        return [event("message_start", {"message": message})]

    def choice(self, job: Job, ch: Choice, idx: int, pidx: int, c, delta: RequestOutput, first: bool) -> list[str]:
        return self.feed(job, ch, c)

    def closing(self, job: Job) -> list[str]:
        reason, sequence = stop_reason(*self.finish, self.called)
        final = {"delta": {"stop_reason": reason, "stop_sequence": sequence}, "usage": usage(job)}
        return [*self.close(), event("message_delta", final), event("message_stop", {})]

    def failure(self, job: Job, error: dict[str, Any]) -> list[str]:
        return [f"event: error\ndata: {json.dumps(anthropic_error_body(error))}\n\n"]


async def create_message(state, body: MessagesRequest, request: Request):
    """Run as the chat request it asks for; answered in Anthropic's shapes."""
    gen = await chat_generation(state, body.as_chat(), request)
    gen.kind = "message"
    return await generate(state, gen, MessageFormat(state), request, MessageEvents(state.model_name, gen))


async def count_tokens(state, body: MessagesPrompt, request: Request) -> dict[str, int]:
    """Anthropic's token count: the prompt /v1/messages would run (the same chat template, tools
    and generation prompt), so it equals that request's input_tokens + cache_read_input_tokens."""
    check_model(state, body.model)
    chat = body.as_chat()
    ids = await conversation_ids(state, chat.conversation(), chat.add_generation_prompt, chat.template_tools())
    return {"input_tokens": len(ids)}


def router(state) -> APIRouter:
    r = APIRouter()
    post_route(r, "/v1/messages", MessagesRequest, create_message, state)
    post_route(r, "/v1/messages/count_tokens", MessagesPrompt, count_tokens, state)
    return r
