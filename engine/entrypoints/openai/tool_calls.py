"""Tool calling for /v1/chat/completions: what OpenAI's `tools` / `tool_choice` ask for, and
how kiln gets it from a model.

- `tool_choice` naming a function: the output is constrained (structured outputs) to that
  function's parameter schema, and returned as one call (finish_reason "stop", as OpenAI does).
- `"required"`: the output is constrained to a JSON array of {"name", "parameters"} objects,
  one schema per tool, and each element becomes a call (finish_reason "tool_calls").
- `"auto"` (the default when tools are given): the model writes calls in its own format and a
  parser chosen at start-up (`tool_call_parser`, as vLLM's `--tool-call-parser`) finds them;
  the parsers, one module per family of formats, are in tool_parsers/.
- `"none"`: plain text.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from engine.core import admission_rules as rules
from engine.core.params import StructuredOutputsParams
from engine.entrypoints.openai.tool_parsers import REGISTRY, TOOL_CALL_PARSERS, ToolCall
from engine.entrypoints.openai.tool_parsers.json_formats import parse_hermes
from engine.entrypoints.openai.tool_parsers.json_formats import parse_llama_json as parse_llama3_json
from engine.entrypoints.openai.tool_parsers.streaming import CallInProgress

__all__ = [
    "TOOL_CALL_PARSERS",
    "ToolCall",
    "ToolMode",
    "arguments_for_template",
    "parse_hermes",
    "parse_llama3_json",
    "resolve_tool_mode",
]


@dataclass
class ToolMode:
    """How one chat request uses its tools: kind is "none", "auto", "required" or "named"."""

    kind: str
    tools: dict[str, dict[str, Any]]  # name -> parameters schema
    name: str | None = None  # the function of a "named" choice
    parser: str | None = None  # "auto": which format to look for

    @property
    def forced(self) -> bool:
        return self.kind in ("required", "named")

    def constraint(self, parallel: bool) -> StructuredOutputsParams | None:
        """The structured-output constraint that makes the model call (named / required). The
        JSON is compact: whitespace in arguments means nothing, and free whitespace is where a
        weak model loops until max_tokens."""
        if self.kind == "named":
            return StructuredOutputsParams(json=self.tools[self.name], disable_any_whitespace=True)
        if self.kind == "required":
            one_of = [
                {
                    "type": "object",
                    "additionalProperties": False,
                    "required": ["name", "parameters"],
                    "properties": {"name": {"enum": [name]}, "parameters": schema},
                }
                for name, schema in self.tools.items()
            ]
            array: dict[str, Any] = {
                "type": "array",
                "minItems": 1,
                "items": one_of[0] if len(one_of) == 1 else {"anyOf": one_of},
            }
            if not parallel:
                array["maxItems"] = 1
            return StructuredOutputsParams(json=array, disable_any_whitespace=True)
        return None

    def calls(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """(content, calls) of a finished output. Text that does not parse stays content."""
        if self.kind == "named":
            return None, [ToolCall(self.name, text)]
        if self.kind == "required":
            try:
                items = json.loads(text, strict=False)
                return None, [ToolCall(i["name"], json.dumps(i["parameters"], ensure_ascii=False)) for i in items]
            except (ValueError, TypeError, KeyError):
                return text, []  # cut short (max_tokens): hand back what was written
        if self.kind == "auto":
            return REGISTRY[self.parser].parse(text, self.tools)
        return text, []

    def progress(self, text: str) -> list[CallInProgress]:
        """The calls of an unfinished output as written so far (auto, with a parser that streams
        arguments: tool_parsers/streaming.py); [] otherwise."""
        found = REGISTRY[self.parser].progress if self.kind == "auto" else None
        return found(text, self.tools) if found is not None else []

    def streamable(self, text: str) -> int:
        """How much of an unfinished output can be streamed as content now (auto: everything
        before a possible call; forced: nothing, the calls come at the end)."""
        if self.kind == "none":
            return len(text)
        if self.forced:
            return 0
        return REGISTRY[self.parser].streamable(text)


def resolve_tool_mode(tools: list[dict[str, Any]] | None, tool_choice: Any, auto_parser: str | None) -> ToolMode:
    """The request's ToolMode; InvalidRequestError for a choice that cannot be honoured."""
    by_name: dict[str, dict[str, Any]] = {}
    for i, tool in enumerate(tools or []):
        fn = tool["function"]
        rules.tool_name_unused(i, fn["name"], by_name)
        params = fn.get("parameters")
        by_name[fn["name"]] = params if params is not None else {"type": "object", "properties": {}}
    if isinstance(tool_choice, dict):
        name = tool_choice["function"]["name"]
        rules.named_tool_given(name, by_name)
        return ToolMode("named", by_name, name=name)
    if not by_name:
        rules.tool_choice_needs_tools(tool_choice)
        return ToolMode("none", by_name)
    choice = tool_choice or "auto"
    if choice == "auto":
        rules.auto_tool_parser(auto_parser)
        return ToolMode("auto", by_name, parser=auto_parser)
    return ToolMode(choice, by_name)


def arguments_for_template(tool_calls: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """An assistant message's tool calls as chat templates read them: arguments as a dict
    (OpenAI sends a JSON string; Qwen's and Llama's templates serialise a mapping)."""
    out = []
    for call in tool_calls:
        fn = dict(call.get("function") or {})
        if isinstance(fn.get("arguments"), str):
            try:
                fn["arguments"] = json.loads(fn["arguments"])
            except ValueError:
                pass  # leave text that is not JSON as the client sent it
        out.append({**call, "function": fn})
    return out
