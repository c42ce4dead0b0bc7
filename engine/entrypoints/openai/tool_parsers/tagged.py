"""Formats built from the model's own special tokens:

- `deepseek_v3` (DeepSeek V3 / R1-0528): `<｜tool▁calls▁begin｜>` and then, per call,
  `<｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME` + a ```json fenced block of the arguments +
  `<｜tool▁call▁end｜>`, and `<｜tool▁calls▁end｜>`. `deepseek_v31` (V3.1): per call
  `<｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{arguments}<｜tool▁call▁end｜>`. Each parser reads both.
- `kimi_k2` (Kimi K2): `<|tool_calls_section_begin|>` and per call
  `<|tool_call_begin|>functions.NAME:INDEX<|tool_call_argument_begin|>{arguments}<|tool_call_end|>`;
  the model's `functions.NAME:INDEX` is kept as the call's id (Kimi's template writes it back).
- `openai` (gpt-oss, harmony): a commentary message addressed `to=functions.NAME` whose body is
  the arguments; final-channel text and preambles are content, analysis (reasoning) is dropped.

Each writes the arguments as a JSON object, so they stream as they are written (streaming.py).
"""

from __future__ import annotations

import json

from engine.entrypoints.openai import harmony
from engine.entrypoints.openai.tool_parsers.base import (
    Parsed,
    Schemas,
    ToolCall,
    ToolParser,
    before,
    first_marker,
    marker_streamable,
)
from engine.entrypoints.openai.tool_parsers.streaming import CallInProgress

_CALLS_BEGIN, _CALL_BEGIN = "<｜tool▁calls▁begin｜>", "<｜tool▁call▁begin｜>"
_SEP, _CALL_END = "<｜tool▁sep｜>", "<｜tool▁call▁end｜>"
_DEEPSEEK_MARKERS = (_CALLS_BEGIN, _CALL_BEGIN)


def _segments(text: str, markers: tuple[str, ...], begin: str, end_marker: str) -> list[str]:
    """The text of each call (from its begin marker to its end marker, or on to the end of the
    text for the last one still being written), once one of the markers has come."""
    if first_marker(text, markers) < 0:
        return []
    out, pos = [], 0
    while (pos := text.find(begin, pos)) >= 0:
        end = text.find(end_marker, pos)
        out.append(text[pos + len(begin) : end if end >= 0 else len(text)])
        if end < 0:
            break
        pos = end + len(end_marker)
    return out


def _object_text(body: str) -> str | None:
    """The arguments of a call: a JSON object, maybe in a ```json fence; None if not one."""
    body = body.strip()
    if body.startswith("```"):
        body = body[3:].removeprefix("json").strip()
        body = body.removesuffix("```").strip()
    try:
        value = json.loads(body, strict=False)
    except ValueError:
        return None
    return json.dumps(value, ensure_ascii=False) if isinstance(value, dict) else None


def _deepseek_call(segment: str) -> ToolCall | None:
    head, sep, rest = segment.partition(_SEP)
    if not sep:
        return None
    if rest.lstrip().startswith("{"):  # V3.1: NAME<sep>{...}
        name, args = head.strip(), _object_text(rest)
    else:  # V3: function<sep>NAME\n```json ...```
        name, _, body = rest.partition("\n")
        name, args = name.strip(), _object_text(body)
    return ToolCall(name, args) if name and args is not None else None


def parse_deepseek(text: str, schemas: Schemas | None = None) -> Parsed:
    start = first_marker(text, _DEEPSEEK_MARKERS)
    found = [_deepseek_call(segment) for segment in _segments(text, _DEEPSEEK_MARKERS, _CALL_BEGIN, _CALL_END)]
    calls = [call for call in found if call is not None]
    return (before(text, start), calls) if calls and len(calls) == len(found) else (text, [])


_KIMI_SECTION, _KIMI_BEGIN = "<|tool_calls_section_begin|>", "<|tool_call_begin|>"
_KIMI_ARGS, _KIMI_END = "<|tool_call_argument_begin|>", "<|tool_call_end|>"
_KIMI_MARKERS = (_KIMI_SECTION, _KIMI_BEGIN)


def _kimi_call(segment: str) -> ToolCall | None:
    head, sep, body = segment.partition(_KIMI_ARGS)
    call_id = head.strip()
    name = call_id.removeprefix("functions.").rsplit(":", 1)[0]
    args = _object_text(body) if sep else None
    return ToolCall(name, args, call_id) if name and " " not in call_id and args is not None else None


def parse_kimi_k2(text: str, schemas: Schemas | None = None) -> Parsed:
    start = first_marker(text, _KIMI_MARKERS)
    found = [_kimi_call(segment) for segment in _segments(text, _KIMI_MARKERS, _KIMI_BEGIN, _KIMI_END)]
    calls = [call for call in found if call is not None]
    return (before(text, start), calls) if calls and len(calls) == len(found) else (text, [])


def parse_harmony(text: str, schemas: Schemas | None = None) -> Parsed:
    lead, msgs = harmony.messages(text)
    if not msgs:
        return text, []
    calls: list[ToolCall] = []
    content = [lead.rstrip()]
    for msg in msgs:
        if not msg.opened:
            return text, []
        recipient = msg.recipient
        if recipient is not None:
            args = _object_text(msg.body)
            if not recipient.startswith("functions.") or args is None:
                return text, []
            calls.append(ToolCall(recipient.removeprefix("functions."), args))
        elif msg.channel != "analysis":  # the answer, or a preamble to calls
            content.append(msg.body)
    return "".join(content) or None, calls


def _object_start(body: str) -> str | None:
    """The arguments as written so far, from their "{" (after a ```json fence's opening)."""
    at = body.find("{")
    return body[at:] if at >= 0 and body[:at].strip() in ("", "```", "```json") else None


def deepseek_progress(text: str, schemas: Schemas | None = None) -> list[CallInProgress]:
    """parse_deepseek's calls as written so far (streaming.py): V3.1's `NAME<sep>{` or V3's
    `function<sep>NAME` + newline; a call whose form is not clear yet holds back."""
    out: list[CallInProgress] = []
    for segment in _segments(text, _DEEPSEEK_MARKERS, _CALL_BEGIN, _CALL_END):
        head, sep, rest = segment.partition(_SEP)
        call: CallInProgress | None
        if rest.lstrip().startswith("{"):
            call = CallInProgress(head.strip(), rest.lstrip())
        else:
            name, newline, body = rest.partition("\n")
            call = CallInProgress(name.strip(), _object_start(body)) if newline and name.strip() else None
        if not sep or call is None or not call.name:
            break
        out.append(call)
    return out


def kimi_progress(text: str, schemas: Schemas | None = None) -> list[CallInProgress]:
    """parse_kimi_k2's calls as written so far (streaming.py), each with the model's own id."""
    out: list[CallInProgress] = []
    for segment in _segments(text, _KIMI_MARKERS, _KIMI_BEGIN, _KIMI_END):
        head, sep, body = segment.partition(_KIMI_ARGS)
        call_id = head.strip()
        name = call_id.removeprefix("functions.").rsplit(":", 1)[0]
        if not sep or not name or " " in call_id:
            break
        out.append(CallInProgress(name, _object_start(body), call_id))
    return out


def harmony_progress(text: str, schemas: Schemas | None = None) -> list[CallInProgress]:
    """parse_harmony's calls as written so far (streaming.py): each message to a function, once
    its header is complete."""
    out: list[CallInProgress] = []
    for msg in harmony.messages(text)[1]:
        recipient = msg.recipient
        if not msg.opened or (recipient is not None and not recipient.startswith("functions.")):
            break
        if recipient is not None:
            out.append(CallInProgress(recipient.removeprefix("functions."), _object_start(msg.body)))
    return out


TAGGED_PARSERS = {
    "deepseek_v3": ToolParser(
        parse_deepseek, marker_streamable(_DEEPSEEK_MARKERS), keep_special_tokens=True, progress=deepseek_progress
    ),
    "deepseek_v31": ToolParser(
        parse_deepseek, marker_streamable(_DEEPSEEK_MARKERS), keep_special_tokens=True, progress=deepseek_progress
    ),
    "kimi_k2": ToolParser(
        parse_kimi_k2, marker_streamable(_KIMI_MARKERS), keep_special_tokens=True, progress=kimi_progress
    ),
    "openai": ToolParser(
        parse_harmony, marker_streamable(harmony.MARKERS), keep_special_tokens=True, progress=harmony_progress
    ),
}
