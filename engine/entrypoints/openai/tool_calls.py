"""Tool calling for /v1/chat/completions: what OpenAI's `tools` / `tool_choice` ask for, and
how kiln gets it from a model.

- `tool_choice` naming a function: the output is constrained (structured outputs) to that
  function's parameter schema, and returned as one call (finish_reason "stop", as OpenAI does).
- `"required"`: the output is constrained to a JSON array of {"name", "parameters"} objects,
  one schema per tool, and each element becomes a call (finish_reason "tool_calls").
- `"auto"` (the default when tools are given): the model writes calls in its own format and a
  parser chosen at start-up (`tool_call_parser`, as vLLM's `--tool-call-parser`) finds them:
  `hermes` (`<tool_call>{json}</tool_call>`: Qwen 2.5/3, Hermes) or `llama3_json` (a bare
  `{"name": ..., "parameters": ...}`, several joined by ";": Llama 3.1+).
- `"none"`: plain text.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any

from engine.core import admission_rules as rules
from engine.core.params import StructuredOutputsParams

TOOL_CALL_PARSERS = ("hermes", "llama3_json")


@dataclass
class ToolCall:
    name: str
    arguments: str  # JSON text, as OpenAI sends it
    id: str = ""

    def __post_init__(self) -> None:
        self.id = self.id or f"call_{uuid.uuid4().hex[:24]}"

    def to_openai(self, index: int | None = None) -> dict[str, Any]:
        out: dict[str, Any] = {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }
        if index is not None:  # stream deltas carry the call's position
            out = {"index": index, **out}
        return out


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
            return PARSERS[self.parser](text)
        return text, []

    def streamable(self, text: str) -> int:
        """How much of an unfinished output can be streamed as content now (auto: everything
        before a possible call; forced: nothing, the calls come at the end)."""
        if self.kind == "none":
            return len(text)
        if self.forced:
            return 0
        return HOLDBACK[self.parser](text)


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


# ---- auto parsers: (content, calls) of a finished output, and the streamable prefix ----
_HERMES_OPEN, _HERMES_CLOSE = "<tool_call>", "</tool_call>"


def _call_from(obj: Any) -> ToolCall | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    return ToolCall(obj["name"], args if isinstance(args, str) else json.dumps(args, ensure_ascii=False))


def parse_hermes(text: str) -> tuple[str | None, list[ToolCall]]:
    start = text.find(_HERMES_OPEN)
    if start < 0:
        return text, []
    calls: list[ToolCall] = []
    pos = start
    while (pos := text.find(_HERMES_OPEN, pos)) >= 0:
        end = text.find(_HERMES_CLOSE, pos)
        body = text[pos + len(_HERMES_OPEN) : end if end >= 0 else len(text)]
        try:
            call = _call_from(json.loads(body.strip(), strict=False))
        except ValueError:
            call = None
        if call is None:
            return text, []  # not a well-formed call: the whole output is content
        calls.append(call)
        if end < 0:
            break
        pos = end + len(_HERMES_CLOSE)
    content = text[:start].strip()
    return content or None, calls


def _hermes_streamable(text: str) -> int:
    start = text.find(_HERMES_OPEN)
    if start >= 0:
        return start
    for k in range(min(len(_HERMES_OPEN) - 1, len(text)), 0, -1):  # a marker may be arriving
        if _HERMES_OPEN.startswith(text[-k:]):
            return len(text) - k
    return len(text)


_PYTHON_TAG = "<|python_tag|>"


def parse_llama3_json(text: str) -> tuple[str | None, list[ToolCall]]:
    body = text.strip()
    if body.startswith(_PYTHON_TAG):
        body = body[len(_PYTHON_TAG) :].lstrip()
    if not body.startswith("{"):
        return text, []
    decoder = json.JSONDecoder(strict=False)
    calls: list[ToolCall] = []
    pos = 0
    while pos < len(body):
        try:
            obj, pos = decoder.raw_decode(body, pos)
        except ValueError:
            return text, []
        call = _call_from(obj)
        if call is None:
            return text, []
        calls.append(call)
        rest = body[pos:].lstrip()
        if not rest:
            break
        if not rest.startswith(";"):
            return text, []
        pos = len(body) - len(rest) + 1
        while pos < len(body) and body[pos].isspace():
            pos += 1
    return None, calls


def _llama3_streamable(text: str) -> int:
    body = text.lstrip()
    if not body or body.startswith("{") or _PYTHON_TAG.startswith(body[: len(_PYTHON_TAG)]):
        return 0  # a call may be starting: hold it all
    return len(text)


PARSERS = {"hermes": parse_hermes, "llama3_json": parse_llama3_json}
HOLDBACK = {"hermes": _hermes_streamable, "llama3_json": _llama3_streamable}
