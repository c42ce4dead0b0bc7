"""Formats whose calls are JSON objects behind a marker (or the whole output):

- `hermes` (Qwen 2.5/3, Hermes): `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, one
  block per call, text before them is content.
- `llama3_json`, `llama4_json` (Llama 3.1+, Llama 4 in JSON mode): the whole output is
  `{"name": ..., "parameters": {...}}`, several joined by ";", after an optional `<|python_tag|>`.
- `granite` (Granite 3.x): `<|tool_call|>` (Granite 3.0 and others: `<tool_call>`) and then a JSON
  list of call objects.
- `internlm` (InternLM 2.5): `<|action_start|><|plugin|>{"name": ..., "parameters": {...}}<|action_end|>`.
- `mistral`: `[TOOL_CALLS]` and then a JSON list of call objects (tokenizers before v11), or
  `name[ARGS]{...}` for each call, each after its own `[TOOL_CALLS]` (v11 on; `[CALL_ID]id`
  may come before `[ARGS]`). Mistral's templates want 9-character alphanumeric call ids.
"""

from __future__ import annotations

import json
import re
import uuid

from engine.entrypoints.openai.tool_parsers.base import (
    Parsed,
    Schemas,
    ToolCall,
    ToolParser,
    before,
    call_from,
    calls_from,
    first_marker,
    hold_if_starts,
    json_prefix,
    json_sequence,
    marker_streamable,
)
from engine.entrypoints.openai.tool_parsers.streaming import CallInProgress, after_marker, between_markers, json_calls

_HERMES_OPEN, _HERMES_CLOSE = "<tool_call>", "</tool_call>"


def parse_hermes(text: str, schemas: Schemas | None = None) -> Parsed:
    start = text.find(_HERMES_OPEN)
    if start < 0:
        return text, []
    calls: list[ToolCall] = []
    pos = start
    while (pos := text.find(_HERMES_OPEN, pos)) >= 0:
        end = text.find(_HERMES_CLOSE, pos)
        body = text[pos + len(_HERMES_OPEN) : end if end >= 0 else len(text)]
        try:
            call = call_from(json.loads(body.strip(), strict=False))
        except ValueError:
            call = None
        if call is None:
            return text, []  # not a well-formed call: the whole output is content
        calls.append(call)
        if end < 0:
            break
        pos = end + len(_HERMES_CLOSE)
    return before(text, start), calls


_PYTHON_TAG = "<|python_tag|>"


def parse_llama_json(text: str, schemas: Schemas | None = None) -> Parsed:
    body = text.strip()
    if body.startswith(_PYTHON_TAG):
        body = body[len(_PYTHON_TAG) :]
    if not body.lstrip().startswith("{"):
        return text, []
    calls = calls_from(json_sequence(body, ";") or [])
    return (None, calls) if calls else (text, [])


_GRANITE_MARKERS = ("<|tool_call|>", "<tool_call>")


def parse_granite(text: str, schemas: Schemas | None = None) -> Parsed:
    start = first_marker(text, _GRANITE_MARKERS)
    if start < 0:
        return text, []
    marker = next(m for m in _GRANITE_MARKERS if text.startswith(m, start))
    found = json_prefix(text[start + len(marker) :])
    value = found[0] if found else None
    calls = calls_from(value if isinstance(value, list) else [value])
    return (before(text, start), calls) if calls else (text, [])


_ACTION_OPEN, _ACTION_CLOSE = "<|action_start|><|plugin|>", "<|action_end|>"


def parse_internlm(text: str, schemas: Schemas | None = None) -> Parsed:
    start = text.find(_ACTION_OPEN)
    if start < 0:
        return text, []
    calls: list[ToolCall] = []
    pos = start
    while (pos := text.find(_ACTION_OPEN, pos)) >= 0:
        end = text.find(_ACTION_CLOSE, pos)
        body = text[pos + len(_ACTION_OPEN) : end if end >= 0 else len(text)]
        found = json_prefix(body)
        call = call_from(found[0]) if found and not body[found[1] :].strip() else None
        if call is None:
            return text, []
        calls.append(call)
        if end < 0:
            break
        pos = end + len(_ACTION_CLOSE)
    return before(text, start), calls


_TOOL_CALLS, _ARGS, _CALL_ID = "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"
_MISTRAL_NAME = re.compile(r"\s*([A-Za-z0-9_.\-]+)(?:\[CALL_ID\]([A-Za-z0-9]+))?\[ARGS\]")


def mistral_id() -> str:
    return uuid.uuid4().hex[:9]


def _mistral_named(rest: str) -> list[ToolCall] | None:
    """`name[ARGS]{...}` calls, each but the first after its own [TOOL_CALLS]."""
    calls: list[ToolCall] = []
    pos = 0
    while True:
        head = _MISTRAL_NAME.match(rest, pos)
        if head is None:
            return None
        found = json_prefix(rest[head.end() :])
        if found is None or not isinstance(found[0], dict):
            return None
        calls.append(ToolCall(head.group(1), json.dumps(found[0], ensure_ascii=False), head.group(2) or mistral_id()))
        pos = head.end() + found[1]
        tail = rest[pos:].lstrip()
        if not tail:
            return calls
        pos = len(rest) - len(tail)
        if tail.startswith(_TOOL_CALLS):
            pos += len(_TOOL_CALLS)


def parse_mistral(text: str, schemas: Schemas | None = None) -> Parsed:
    start = text.find(_TOOL_CALLS)
    if start < 0:
        return text, []
    rest = text[start + len(_TOOL_CALLS) :]
    if rest.lstrip()[:1] in ("[", "{"):  # the JSON list form
        found = json_prefix(rest)
        value = found[0] if found else None
        calls = calls_from(value if isinstance(value, list) else [value], mistral_id)
    else:
        calls = _mistral_named(rest)
    return (before(text, start), calls) if calls else (text, [])


def mistral_progress(text: str, schemas: Schemas | None = None) -> list[CallInProgress]:
    """parse_mistral's calls as written so far (streaming.py)."""
    start = text.find(_TOOL_CALLS)
    if start < 0:
        return []
    rest = text[start + len(_TOOL_CALLS) :]
    if rest.lstrip()[:1] in ("[", "{"):
        return [call._replace(id=mistral_id()) for call in json_calls(rest)]
    out, pos = [], 0
    while head := _MISTRAL_NAME.match(rest, pos):
        args = rest[head.end() :].lstrip()
        out.append(CallInProgress(head.group(1), args if args.startswith("{") else None, head.group(2) or mistral_id()))
        found = json_prefix(rest[head.end() :])
        if found is None:
            break
        pos = head.end() + found[1]
        tail = rest[pos:].lstrip()
        pos = len(rest) - len(tail) + (len(_TOOL_CALLS) if tail.startswith(_TOOL_CALLS) else 0)
    return out


def llama_progress(text: str, schemas: Schemas | None = None) -> list[CallInProgress]:
    body = text.lstrip().removeprefix(_PYTHON_TAG)
    return json_calls(body) if body.lstrip().startswith("{") else []


_llama_streamable = hold_if_starts(("{", _PYTHON_TAG))

JSON_PARSERS = {
    "hermes": ToolParser(
        parse_hermes, marker_streamable((_HERMES_OPEN,)), progress=between_markers(_HERMES_OPEN, _HERMES_CLOSE)
    ),
    "llama3_json": ToolParser(parse_llama_json, _llama_streamable, progress=llama_progress),
    "llama4_json": ToolParser(parse_llama_json, _llama_streamable, progress=llama_progress),
    "granite": ToolParser(parse_granite, marker_streamable(_GRANITE_MARKERS), progress=after_marker(_GRANITE_MARKERS)),
    "internlm": ToolParser(
        parse_internlm,
        marker_streamable((_ACTION_OPEN,)),
        keep_special_tokens=True,
        progress=between_markers(_ACTION_OPEN, _ACTION_CLOSE),
    ),
    "mistral": ToolParser(
        parse_mistral, marker_streamable((_TOOL_CALLS,)), keep_special_tokens=True, progress=mistral_progress
    ),
}
