"""Anthropic's Messages API (POST /v1/messages, /v1/messages/count_tokens): the request models,
and the request written as the chat request it asks for, so that every rule, the chat template,
tools and sampling are the chat route's own (chat.py); the answer is written back in messages.py.

What maps where: `system` (text or text blocks) is a system message; `text` blocks are text;
an assistant's `tool_use` blocks are its tool calls; a user's `tool_result` blocks are tool
messages answering them; `tools` ({name, description, input_schema}) are function tools;
`tool_choice` auto / any / tool / none is "auto" / "required" / the named function / "none";
`stop_sequences` are stop strings; `metadata.user_id` is the tenant of the grammar compile pool.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from fastapi.exceptions import RequestValidationError
from pydantic import Field, ValidationError

from engine.entrypoints.openai.protocol import INT64, ChatCompletionRequest, Lenient, RequestBody


class AnthropicBlock(Lenient):
    """A content block: text, tool_use (assistant), tool_result (user); other types are refused
    by the chat rules (only text parts)."""

    type: str
    text: str | None = None
    id: str | None = None  # tool_use
    name: str | None = None  # tool_use
    input: dict[str, Any] | None = None  # tool_use
    tool_use_id: str | None = None  # tool_result
    content: str | list[AnthropicBlock] | None = None  # tool_result
    is_error: bool | None = None  # tool_result


class AnthropicMessage(Lenient):
    role: Literal["user", "assistant"]
    content: str | list[AnthropicBlock]


class AnthropicTool(Lenient):
    name: str
    description: str | None = None
    input_schema: dict[str, Any] = Field(default_factory=lambda: {"type": "object", "properties": {}})


class AnthropicToolChoice(Lenient):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class AnthropicMetadata(Lenient):
    user_id: str | None = None


class MessagesPrompt(RequestBody):
    """What makes a Messages request's prompt: POST /v1/messages/count_tokens takes just this."""

    model: str | None = None
    messages: list[AnthropicMessage]
    system: str | list[AnthropicBlock] | None = None
    tools: list[AnthropicTool] | None = None
    tool_choice: AnthropicToolChoice | None = None

    def as_chat(self) -> ChatCompletionRequest:
        """The chat request this one asks for (a field that does not fit is a 400 naming it)."""
        return chat_request({k: v for k, v in self.chat_fields().items() if v is not None})

    def chat_fields(self) -> dict[str, Any]:
        fields: dict[str, Any] = {"model": self.model, "messages": chat_messages(self.system, self.messages)}
        if self.tools:
            fields["tools"] = [
                {
                    "type": "function",
                    "function": {"name": t.name, "description": t.description, "parameters": t.input_schema},
                }
                for t in self.tools
            ]
        choice = self.tool_choice
        if choice is not None:
            fields["tool_choice"] = (
                {"type": "function", "function": {"name": choice.name}}
                if choice.type == "tool"
                else {"auto": "auto", "any": "required", "none": "none"}[choice.type]
            )
            if choice.disable_parallel_tool_use:
                fields["parallel_tool_calls"] = False
        return fields


class MessagesRequest(MessagesPrompt):
    max_tokens: int = Field(le=INT64, ge=-INT64)
    stop_sequences: list[str] | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = Field(None, le=INT64, ge=-INT64)
    stream: bool = False
    metadata: AnthropicMetadata | None = None

    def chat_fields(self) -> dict[str, Any]:
        return {
            **super().chat_fields(),
            "max_tokens": self.max_tokens,
            "stop": self.stop_sequences,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "stream": self.stream,
            "user": self.metadata.user_id if self.metadata is not None else None,
        }


def chat_request(fields: dict[str, Any]) -> ChatCompletionRequest:
    """A chat request made from another API's fields; what does not validate is a 400."""
    try:
        return ChatCompletionRequest.model_validate(fields)
    except ValidationError as exc:
        raise RequestValidationError(exc.errors()) from exc


def block_text(content: str | list[AnthropicBlock] | None) -> str | list[dict[str, Any]]:
    """Text content as chat messages take it (a list of blocks stays parts, checked there)."""
    if content is None or isinstance(content, str):
        return content or ""
    return [{"type": b.type, "text": b.text} for b in content]


def chat_messages(system: str | list[AnthropicBlock] | None, messages: list[AnthropicMessage]) -> list[dict]:
    out: list[dict[str, Any]] = []
    if system:
        out.append({"role": "system", "content": block_text(system)})
    for m in messages:
        if isinstance(m.content, str):
            out.append({"role": m.role, "content": m.content})
            continue
        parts, calls = [], []
        for b in m.content:
            if b.type == "tool_result":  # answers a call of the previous assistant turn
                out.append({"role": "tool", "tool_call_id": b.tool_use_id, "content": block_text(b.content)})
            elif b.type == "tool_use" and m.role == "assistant":
                arguments = json.dumps(b.input or {}, ensure_ascii=False)
                calls.append({"id": b.id, "type": "function", "function": {"name": b.name, "arguments": arguments}})
            else:
                parts.append({"type": b.type, "text": b.text})
        if parts or calls:
            message: dict[str, Any] = {"role": m.role, "content": parts}
            if calls:
                message["tool_calls"] = calls
            out.append(message)
    return out
