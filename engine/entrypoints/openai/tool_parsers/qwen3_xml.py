"""`qwen3_coder` / `qwen3_xml` (Qwen3-Coder, Qwen3 2507 and later): each call is

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    </function>
    </tool_call>

Values are text; each is typed from the tool's JSON schema where it gives the parameter's type
(a string stays as written; numbers, booleans, objects and arrays are read as JSON), else read
as JSON where it parses and kept as a string where it does not.

Streamed: a value whose schema type is "string" as it is written; any other once it has ended
(its type shows only then).
"""

from __future__ import annotations

import json
from typing import Any

from engine.entrypoints.openai.tool_parsers.base import (
    Parsed,
    Schemas,
    ToolCall,
    ToolParser,
    before,
    first_marker,
    held_tail,
    marker_streamable,
)
from engine.entrypoints.openai.tool_parsers.streaming import CallInProgress, object_text

_MARKERS = ("<tool_call>", "<function=")
_FUNC, _PARAM, _PARAM_END, _FUNC_END = "<function=", "<parameter=", "</parameter>", "</function>"


def _json_or_text(raw: str) -> Any:
    try:
        return json.loads(raw)
    except ValueError:
        return raw


def _kind(schema: Any) -> Any:
    kind = schema.get("type") if isinstance(schema, dict) else None
    if isinstance(kind, list):  # ["integer", "null"]: the first type that is not null
        kind = next((k for k in kind if k != "null"), None)
    return kind


def is_text(schema: Any) -> bool:
    """Whether typed_value keeps a value under this schema as the text written (a stream can
    send it as it comes)."""
    return _kind(schema) == "string"


def typed_value(raw: str, schema: Any) -> Any:
    kind = _kind(schema)
    if kind == "string":
        return raw
    if kind is None:
        return _json_or_text(raw)
    value = _json_or_text(raw.strip())
    ok = {
        "integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
        "number": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
        "boolean": lambda v: isinstance(v, bool),
        "object": lambda v: isinstance(v, dict),
        "array": lambda v: isinstance(v, list),
        "null": lambda v: v is None,
    }.get(kind)
    if kind == "boolean" and raw.strip() in ("True", "False"):  # Python's spelling
        return raw.strip() == "True"
    return value if ok is None or ok(value) else raw


def _trim(raw: str) -> str:
    """The value less the one newline the format puts on each side of it."""
    if raw.startswith("\n"):
        raw = raw[1:]
    return raw[:-1] if raw.endswith("\n") else raw


def _skip_wrappers(body: str, pos: int) -> int:
    """Past whitespace and <tool_call> / </tool_call> tags."""
    while True:
        stripped = body[pos:].lstrip()
        pos = len(body) - len(stripped)
        for tag in ("<tool_call>", "</tool_call>"):
            if stripped.startswith(tag):
                pos += len(tag)
                break
        else:
            return pos


def _function(body: str, pos: int, schemas: Schemas) -> tuple[ToolCall, int] | None:
    """The call whose `<function=` tag starts at pos, and where it ends."""
    close = body.find(">", pos)
    name = body[pos + len(_FUNC) : close].strip() if close >= 0 else ""
    if not name or "\n" in name:
        return None
    props = (schemas.get(name) or {}).get("properties") or {}
    args: dict[str, Any] = {}
    pos = close + 1
    while True:
        pos = len(body) - len(body[pos:].lstrip())
        if body.startswith(_FUNC_END, pos):
            return ToolCall(name, json.dumps(args, ensure_ascii=False)), pos + len(_FUNC_END)
        if not body.startswith(_PARAM, pos):
            return None
        tag_end = body.find(">", pos)
        end = body.find(_PARAM_END, tag_end) if tag_end >= 0 else -1
        if end < 0:
            return None
        key = body[pos + len(_PARAM) : tag_end].strip()
        args[key] = typed_value(_trim(body[tag_end + 1 : end]), props.get(key))
        pos = end + len(_PARAM_END)


def parse_qwen3_xml(text: str, schemas: Schemas | None = None) -> Parsed:
    start = first_marker(text, _MARKERS)
    if start < 0:
        return text, []
    calls: list[ToolCall] = []
    pos = _skip_wrappers(text, start)
    while text.startswith(_FUNC, pos):
        found = _function(text, pos, schemas or {})
        if found is None:
            return text, []
        calls.append(found[0])
        pos = _skip_wrappers(text, found[1])
    return (before(text, start), calls) if calls else (text, [])


def open_text_value(raw: str, end_tag: str) -> str:
    """The certain text of a string value still being written: less a tail that may be its end
    tag arriving."""
    return raw[: len(raw) - held_tail(raw, end_tag)]


def _function_progress(body: str, pos: int, schemas: Schemas) -> tuple[CallInProgress | None, int]:
    """The call whose `<function=` tag starts at pos as written so far, and where it ends (-1:
    not yet); (None, -1) while its name is unfinished."""
    close = body.find(">", pos)
    name = body[pos + len(_FUNC) : close].strip() if close >= 0 else ""
    if not name or "\n" in name:
        return None, -1
    props = (schemas.get(name) or {}).get("properties") or {}
    members: list[tuple[str, Any]] = []
    pos = close + 1
    while True:
        pos = len(body) - len(body[pos:].lstrip())
        if body.startswith(_FUNC_END, pos):
            return CallInProgress(name, object_text(members, closed=True)), pos + len(_FUNC_END)
        tag_end = body.find(">", pos) if body.startswith(_PARAM, pos) else -1
        key = body[pos + len(_PARAM) : tag_end].strip()
        if tag_end < 0 or key in dict(members):  # unfinished (or a key written twice: no more streams)
            return CallInProgress(name, object_text(members)), -1
        end = body.find(_PARAM_END, tag_end)
        if end < 0:
            raw = open_text_value(body[tag_end + 1 :], _PARAM_END)
            raw = raw.removeprefix("\n").removesuffix("\n")  # (as _trim: the last may be the one it drops)
            open_string = (key, raw) if is_text(props.get(key)) else None
            return CallInProgress(name, object_text(members, open_string)), -1
        members.append((key, typed_value(_trim(body[tag_end + 1 : end]), props.get(key))))
        pos = end + len(_PARAM_END)


def qwen3_xml_progress(text: str, schemas: Schemas | None = None) -> list[CallInProgress]:
    """parse_qwen3_xml's calls as written so far (streaming.py)."""
    start = first_marker(text, _MARKERS)
    out: list[CallInProgress] = []
    pos = _skip_wrappers(text, start) if start >= 0 else len(text)
    while text.startswith(_FUNC, pos):
        call, end = _function_progress(text, pos, schemas or {})
        if call is None:
            break
        out.append(call)
        if end < 0:
            break
        pos = _skip_wrappers(text, end)
    return out


QWEN3_XML_PARSERS = {
    "qwen3_coder": ToolParser(parse_qwen3_xml, marker_streamable(_MARKERS), progress=qwen3_xml_progress),
    "qwen3_xml": ToolParser(parse_qwen3_xml, marker_streamable(_MARKERS), progress=qwen3_xml_progress),
}
