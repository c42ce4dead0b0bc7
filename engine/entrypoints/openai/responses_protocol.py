"""OpenAI's Responses API (POST /v1/responses): the request model, and the request written as the
chat request it asks for, so that every rule, the chat template, tools and sampling are the chat
route's own (chat.py); the answer is written back in responses.py.

What maps where: `instructions` is a system message (not carried to the next turn, as OpenAI
does); `input` is a text (one user message) or a list of items: messages (`input_text` /
`output_text` parts are text), `function_call` items (an assistant turn's tool calls) and
`function_call_output` items (tool messages answering them); a `previous_response_id` puts the
stored turn's input and output items first. Function `tools` are chat's function tools;
`tool_choice` and `parallel_tool_calls` are chat's; `max_output_tokens` is max_tokens;
`text.format` is chat's response_format.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from engine.entrypoints.openai.anthropic_protocol import chat_request
from engine.entrypoints.openai.protocol import INT64, ChatCompletionRequest, Lenient, RequestBody


class ResponseTool(Lenient):
    type: Literal["function"]
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class NamedFunction(Lenient):
    type: Literal["function"]
    name: str


class TextFormat(Lenient):
    type: Literal["text", "json_object", "json_schema"] = "text"
    name: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class TextConfig(Lenient):
    format: TextFormat | None = None


class ResponsesRequest(RequestBody):
    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    previous_response_id: str | None = None
    store: bool = True
    stream: bool = False
    max_output_tokens: int | None = Field(None, le=INT64, ge=-INT64)
    temperature: float | None = None
    top_p: float | None = None
    tools: list[ResponseTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedFunction | None = None
    parallel_tool_calls: bool | None = True
    text: TextConfig | None = None
    user: str | None = None
    metadata: dict[str, str] | None = None

    def input_items(self) -> list[dict[str, Any]]:
        """The input as a list of items (a text is one user message)."""
        if isinstance(self.input, str):
            return [{"type": "message", "role": "user", "content": self.input}]
        return list(self.input)

    def as_chat(self, earlier: list[dict[str, Any]]) -> ChatCompletionRequest:
        """The chat request this one asks for, after the `earlier` items of the turns before it."""
        messages = [{"role": "system", "content": self.instructions}] if self.instructions else []
        fields: dict[str, Any] = {
            "model": self.model,
            "messages": messages + chat_messages([*earlier, *self.input_items()]),
            "max_tokens": self.max_output_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "stream": self.stream,
            "user": self.user,
            "parallel_tool_calls": self.parallel_tool_calls,
        }
        if self.tools:
            fields["tools"] = [
                {"type": "function", "function": t.model_dump(exclude={"type"}, exclude_none=True)} for t in self.tools
            ]
        if isinstance(self.tool_choice, NamedFunction):
            fields["tool_choice"] = {"type": "function", "function": {"name": self.tool_choice.name}}
        elif self.tool_choice is not None:
            fields["tool_choice"] = self.tool_choice
        fmt = self.text.format if self.text is not None else None
        if fmt is not None and fmt.type == "json_object":
            fields["response_format"] = {"type": "json_object"}
        elif fmt is not None and fmt.type == "json_schema":
            schema = {"name": fmt.name, "schema": fmt.schema_, "strict": fmt.strict}
            fields["response_format"] = {"type": "json_schema", "json_schema": schema}
        return chat_request({k: v for k, v in fields.items() if v is not None})


def _text(content: Any) -> Any:
    """A message item's content as chat content: input_text / output_text parts are text parts
    (other part types stay as they are, for the chat rules to refuse)."""
    if not isinstance(content, list):
        return content
    parts = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        parts.append({"type": "text", "text": part.get("text")} if kind in ("input_text", "output_text") else part)
    return parts


def chat_messages(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Input (and stored output) items as chat messages: a function_call joins the assistant turn
    before it (or starts one); a function_call_output is a tool message; reasoning items are
    not sent back to the model."""
    out: list[dict[str, Any]] = []
    for item in items:
        kind = item.get("type", "message")
        if kind == "function_call":
            call = {
                "id": item.get("call_id"),
                "type": "function",
                "function": {"name": item.get("name"), "arguments": item.get("arguments", "")},
            }
            if not out or out[-1]["role"] != "assistant":
                out.append({"role": "assistant", "content": ""})
            out[-1].setdefault("tool_calls", []).append(call)
        elif kind == "function_call_output":
            out.append({"role": "tool", "tool_call_id": item.get("call_id"), "content": item.get("output", "")})
        elif kind == "reasoning":
            continue
        else:  # a message (a role with no type); an unknown type is refused by the chat rules
            content = _text(item.get("content"))
            if kind != "message":
                content = [{"type": kind}]
            out.append({"role": item.get("role", "user"), "content": content if content is not None else ""})
    return out
