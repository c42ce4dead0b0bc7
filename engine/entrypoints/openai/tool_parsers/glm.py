"""`glm45` (GLM-4.5 / 4.6): each call is

    <tool_call>get_weather
    <arg_key>city</arg_key>
    <arg_value>Paris</arg_value>
    </tool_call>

The chat template writes string values as they are and others as JSON, so values are typed as
qwen3_coder's are: from the tool's schema where it gives a type, else JSON where it parses.
Streamed as qwen3_coder's: a value of schema type "string" as it is written, any other whole.
"""

from __future__ import annotations

import json
import re
from typing import Any

from engine.entrypoints.openai.tool_parsers.base import Parsed, Schemas, ToolCall, ToolParser, before, marker_streamable
from engine.entrypoints.openai.tool_parsers.qwen3_xml import is_text, open_text_value, typed_value
from engine.entrypoints.openai.tool_parsers.streaming import CallInProgress, object_text

_OPEN, _CLOSE = "<tool_call>", "</tool_call>"
_PAIR = re.compile(r"\s*<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.S)
_OPEN_PAIR = re.compile(r"\s*<arg_key>(.*?)</arg_key>\s*<arg_value>", re.S)  # a value still being written
_VALUE_END = "</arg_value>"


def _call(body: str, schemas: Schemas) -> ToolCall | None:
    name, _, rest = body.partition("\n")
    name = name.strip()
    if not name or "<" in name:
        return None
    props = (schemas.get(name) or {}).get("properties") or {}
    args: dict[str, Any] = {}
    pos = 0
    while (pair := _PAIR.match(rest, pos)) is not None:
        key = pair.group(1).strip()
        args[key] = typed_value(pair.group(2), props.get(key))
        pos = pair.end()
    if rest[pos:].strip():
        return None
    return ToolCall(name, json.dumps(args, ensure_ascii=False))


def parse_glm45(text: str, schemas: Schemas | None = None) -> Parsed:
    start = text.find(_OPEN)
    if start < 0:
        return text, []
    calls: list[ToolCall] = []
    pos = start
    while (pos := text.find(_OPEN, pos)) >= 0:
        end = text.find(_CLOSE, pos)
        call = _call(text[pos + len(_OPEN) : end if end >= 0 else len(text)], schemas or {})
        if call is None:
            return text, []
        calls.append(call)
        if end < 0:
            break
        pos = end + len(_CLOSE)
    return before(text, start), calls


def _call_progress(body: str, schemas: Schemas, ended: bool) -> CallInProgress | None:
    """One call as written so far (ended: its </tool_call> has come); None while its name is
    unfinished."""
    name, newline, rest = body.partition("\n")
    name = name.strip()
    if not newline or not name or "<" in name:
        return None
    props = (schemas.get(name) or {}).get("properties") or {}
    members: list[tuple[str, Any]] = []
    pos = 0
    while (pair := _PAIR.match(rest, pos)) is not None:
        key = pair.group(1).strip()
        if key in dict(members):  # (written twice: the whole parse keeps the last; no more streams)
            return CallInProgress(name, object_text(members))
        members.append((key, typed_value(pair.group(2), props.get(key))))
        pos = pair.end()
    if ended:
        return CallInProgress(name, object_text(members, closed=not rest[pos:].strip()))
    opened = _OPEN_PAIR.match(rest, pos)
    open_string = None
    if opened is not None and is_text(props.get(key := opened.group(1).strip())) and key not in dict(members):
        open_string = (key, open_text_value(rest[opened.end() :], _VALUE_END))
    return CallInProgress(name, object_text(members, open_string))


def glm45_progress(text: str, schemas: Schemas | None = None) -> list[CallInProgress]:
    """parse_glm45's calls as written so far (streaming.py)."""
    out: list[CallInProgress] = []
    pos = 0
    while (pos := text.find(_OPEN, pos)) >= 0:
        end = text.find(_CLOSE, pos)
        call = _call_progress(text[pos + len(_OPEN) : end if end >= 0 else len(text)], schemas or {}, end >= 0)
        if call is None:
            break
        out.append(call)
        if end < 0:
            break
        pos = end + len(_CLOSE)
    return out


GLM_PARSERS = {"glm45": ToolParser(parse_glm45, marker_streamable((_OPEN,)), progress=glm45_progress)}
