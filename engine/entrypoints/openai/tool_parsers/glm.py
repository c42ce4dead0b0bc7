"""`glm45` (GLM-4.5 / 4.6): each call is

    <tool_call>get_weather
    <arg_key>city</arg_key>
    <arg_value>Paris</arg_value>
    </tool_call>

The chat template writes string values as they are and others as JSON, so values are typed as
qwen3_coder's are: from the tool's schema where it gives a type, else JSON where it parses.
"""

from __future__ import annotations

import json
import re
from typing import Any

from engine.entrypoints.openai.tool_parsers.base import Parsed, Schemas, ToolCall, ToolParser, before, marker_streamable
from engine.entrypoints.openai.tool_parsers.qwen3_xml import typed_value

_OPEN, _CLOSE = "<tool_call>", "</tool_call>"
_PAIR = re.compile(r"\s*<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.S)


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


GLM_PARSERS = {"glm45": ToolParser(parse_glm45, marker_streamable((_OPEN,)))}
