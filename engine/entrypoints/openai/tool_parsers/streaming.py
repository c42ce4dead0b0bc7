"""Tool calls streamed as they are written (auto tool choice): each call's header (index, id,
name) as soon as its name is complete, then its arguments in pieces, as OpenAI's API streams them.

A format whose arguments are a JSON object in the text (the JSON formats, `NAME[ARGS]{...}`)
gives its calls in progress (`CallInProgress`: the name once complete, the raw text from the
arguments' `{` on). The raw text is not what the finished call carries: the whole parse
re-serialises the arguments (json.dumps, ensure_ascii=False). So what streams is the canonical
form of the raw prefix: every token that is complete, written as json.dumps writes it (strings
char by char, numbers and literals once they end). Its pieces add up to the finished call's
arguments exactly.

A format that writes no JSON (Python calls, XML parameters) gives the JSON of what it has
revealed (`object_text`): each argument once its value is complete, and a string value as it is
written where the format leaves no doubt that the value is a string and what its text is (a
Python string literal; an XML value whose schema type is "string"); other values (numbers,
objects, values with no schema) only show what they are at their end, so they go whole.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from engine.entrypoints.openai.tool_parsers.base import Schemas, ToolCall


class CallInProgress(NamedTuple):
    name: str | None  # None until the name is complete
    arguments: str | None  # raw text from the arguments' "{" (maybe unfinished); None: not (yet) an object
    id: str | None = None  # the model's own call id, where the format has one


Progress = Callable[[str, Schemas], list[CallInProgress]]

_SCALAR = re.compile(r"[-+0-9.eE]+|true|false|null|[A-Za-z]+")
_ESCAPES = {'"': '"', "\\": "\\", "/": "/", "b": "\b", "f": "\f", "n": "\n", "r": "\r", "t": "\t"}


def _char(c: str) -> str:
    return json.dumps(c, ensure_ascii=False)[1:-1]  # (json.dumps escapes char by char)


def _escape(raw: str, i: int) -> tuple[str | None, int]:
    """The character of the escape at raw[i] ("\\") and where it ends; None while it is unfinished
    (a high surrogate waits for its low half: json decodes the pair as one character)."""
    if i + 1 >= len(raw):
        return None, i
    kind = raw[i + 1]
    if kind != "u":
        return _ESCAPES.get(kind, kind), i + 2
    if i + 6 > len(raw):
        return None, i
    code = int(raw[i + 2 : i + 6], 16)
    if 0xD800 <= code < 0xDC00:
        low = raw[i + 6 : i + 12]
        if len(low) < 6 and "\\u".startswith(low[:2]):
            return None, i  # (its low half may be on its way)
        if low.startswith("\\u") and 0xDC00 <= (half := int(low[2:], 16)) < 0xE000:
            return chr(0x10000 + ((code - 0xD800) << 10) + (half - 0xDC00)), i + 12
    return chr(code), i + 6


class CanonicalJSON:
    """The certain part of a JSON value (an object, maybe unfinished) written as
    json.dumps(value, ensure_ascii=False) writes it, made as the raw text comes: feed(piece)
    returns what the piece adds (a token split across pieces goes once it is whole), so a stream
    costs its length once. Stops for good at anything malformed, or where the value has ended."""

    def __init__(self) -> None:
        self._rest = ""  # raw text not consumed yet: the start of a token still being written
        self._stack: list[str] = []  # the open objects and arrays
        self._in_string = False
        self._started = False
        self._stopped = False

    def feed(self, piece: str) -> str:
        raw, out, i = self._rest + piece, [], 0
        n = len(raw)
        try:
            while i < n and not self._stopped:
                c = raw[i]
                if self._in_string:
                    if c == '"':
                        out.append('"')
                        self._in_string = False
                        i += 1
                    elif c == "\\":
                        decoded, end = _escape(raw, i)
                        if decoded is None:
                            break  # (its end is on its way)
                        out.append(_char(decoded))
                        i = end
                    else:
                        out.append(_char(c))
                        i += 1
                    continue
                if c in " \t\r\n":
                    i += 1
                    continue
                if self._started and not self._stack:
                    self._stopped = True  # the value has ended
                    break
                self._started = True
                if c in "{[":
                    self._stack.append(c)
                    out.append(c)
                elif c in "}]":
                    if not self._stack or (self._stack.pop() == "{") != (c == "}"):
                        self._stopped = True
                        break
                    out.append(c)
                elif c in ":,":
                    out.append(c + " ")
                elif c == '"':
                    out.append('"')
                    self._in_string = True
                else:
                    m = _SCALAR.match(raw, i)
                    if m is None:
                        self._stopped = True
                        break
                    if m.end() == n:
                        break  # a number or literal that may go on
                    out.append(json.dumps(json.loads(m.group())))
                    i = m.end()
                    continue
                i += 1
        except ValueError:
            self._stopped = True  # (a malformed number or escape: what came before stands)
        self._rest = "" if self._stopped else raw[i:]
        return "".join(out)


def canonical_prefix(raw: str) -> str:
    """CanonicalJSON's output for the whole of raw at once."""
    return CanonicalJSON().feed(raw)


_DECODER = json.JSONDecoder(strict=False)


def _skip_ws(raw: str, i: int) -> int:
    while i < len(raw) and raw[i] in " \t\r\n":
        i += 1
    return i


def object_members(raw: str) -> dict[str, int]:
    """The top-level keys of the JSON object starting raw (maybe unfinished) -> where each value
    starts, for every key written so far."""
    out: dict[str, int] = {}
    i = _skip_ws(raw, 0)
    if raw[i : i + 1] != "{":
        return out
    i += 1
    try:
        while True:
            i = _skip_ws(raw, i)
            if raw[i : i + 1] == ",":
                i = _skip_ws(raw, i + 1)
            if raw[i : i + 1] != '"':
                return out
            key, i = _DECODER.raw_decode(raw, i)
            i = _skip_ws(raw, i)
            if raw[i : i + 1] != ":":
                return out
            i = _skip_ws(raw, i + 1)
            if i >= len(raw):
                return out
            out[key] = i
            _, i = _DECODER.raw_decode(raw, i)
    except ValueError:
        return out  # a key or value still being written


def json_call(raw: str, arg_keys: tuple[str, ...] = ("arguments", "parameters")) -> CallInProgress:
    """A {"name": ..., "arguments": {...}} call object in progress."""
    members = object_members(raw)
    name = None
    if "name" in members:
        try:
            value, _ = _DECODER.raw_decode(raw, members["name"])
            name = value if isinstance(value, str) else None
        except ValueError:
            pass
    args = next((raw[members[k] :] for k in arg_keys if k in members), None)
    return CallInProgress(name, args if args is not None and args.startswith("{") else None)


def json_calls(raw: str) -> list[CallInProgress]:
    """Call objects one after another (whitespace, ";" or "," between), or in a JSON list."""
    out: list[CallInProgress] = []
    i = _skip_ws(raw, 0)
    if raw[i : i + 1] == "[":
        i += 1
    while True:
        i = _skip_ws(raw, i)
        if out and raw[i : i + 1] in (",", ";"):
            i = _skip_ws(raw, i + 1)
        if raw[i : i + 1] != "{":
            return out
        out.append(json_call(raw[i:]))
        try:
            _, i = _DECODER.raw_decode(raw, i)
        except ValueError:
            return out  # the last call is still being written


def between_markers(open_marker: str, close_marker: str) -> Progress:
    """Calls each in its own open ... close block, a JSON call object inside."""

    def progress(text: str, schemas: Schemas | None = None) -> list[CallInProgress]:
        out, pos = [], 0
        while (pos := text.find(open_marker, pos)) >= 0:
            end = text.find(close_marker, pos)
            out.append(json_call(text[pos + len(open_marker) : end if end >= 0 else len(text)].lstrip()))
            if end < 0:
                break
            pos = end + len(close_marker)
        return out

    return progress


def after_marker(markers: tuple[str, ...]) -> Progress:
    """Calls after the first of the markers: call objects, or a JSON list of them."""

    def progress(text: str, schemas: Schemas | None = None) -> list[CallInProgress]:
        found = [(i, m) for m in markers if (i := text.find(m)) >= 0]
        if not found:
            return []
        start, marker = min(found)
        return json_calls(text[start + len(marker) :])

    return progress


def object_text(
    members: list[tuple[str, Any]], open_string: tuple[str, str] | None = None, closed: bool = False
) -> str:
    """The arguments of a call in a format that writes no JSON, as far as they are known: the
    members whose values are complete, then a string value still being written (its key and text
    so far: its quote stays open), then "}" once the call has ended. Written as json.dumps writes
    the whole object, so its canonical_prefix is where the finished call's arguments begin."""
    parts = [f"{_dumps(k)}: {_dumps(v)}" for k, v in members]
    if open_string is not None:
        parts.append(f"{_dumps(open_string[0])}: {_dumps(open_string[1])[:-1]}")
    # (It only grows as the call goes on; a number at its end goes once the next member or "}" comes.)
    return "{" + ", ".join(parts) + ("}" if closed and open_string is None else "")


def _dumps(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)


def new_call_id() -> str:
    return ToolCall("", "").id


@dataclass
class StreamedCalls:
    """What a streamed choice has sent of its calls: per call, its id and its arguments so far.
    Each call's raw arguments are made canonical as they grow (CanonicalJSON, fed only what is
    new), so a long argument costs its length once, not once per delta."""

    ids: list[str] = field(default_factory=list)
    sent: list[str] = field(default_factory=list)
    _raw: list[str] = field(default_factory=list)  # per call: the raw arguments made canonical so far
    _canonical: list[tuple[CanonicalJSON, str]] = field(default_factory=list)  # per call: the maker, its output

    def _canonical_prefix(self, i: int, raw: str) -> str:
        """canonical_prefix(raw) of call i, from what its last raw text gave where raw goes on from
        it (a format whose raw text is rewritten, not extended, starts over)."""
        if i == len(self._raw):
            self._raw.append("")
            self._canonical.append((CanonicalJSON(), ""))
        maker, made = self._canonical[i]
        if raw.startswith(self._raw[i]):
            made += maker.feed(raw[len(self._raw[i]) :])
        else:
            maker = CanonicalJSON()
            made = maker.feed(raw)
        self._raw[i], self._canonical[i] = raw, (maker, made)
        return made

    def update(self, calls: list[CallInProgress], make_id: Callable[[], str] = new_call_id) -> list[dict[str, Any]]:
        """The tool_calls deltas that bring the client up to `calls` (calls go out in order: one
        whose name is unfinished holds back the ones after it)."""
        out: list[dict[str, Any]] = []
        for i, call in enumerate(calls):
            if call.name is None:
                break
            delta: dict[str, Any] = {"index": i, "function": {}}
            if i == len(self.sent):
                self.ids.append(call.id or make_id())
                self.sent.append("")
                delta = {"index": i, "id": self.ids[i], "type": "function", "function": {"name": call.name}}
            if call.arguments is not None:
                now = self._canonical_prefix(i, call.arguments)
                if len(now) > len(self.sent[i]) and now.startswith(self.sent[i]):
                    delta["function"]["arguments"] = now[len(self.sent[i]) :]
                    self.sent[i] = now
            if "id" in delta:
                delta["function"].setdefault("arguments", "")
            if delta["function"]:
                out.append(delta)
        return out

    def finish(self, calls: list[ToolCall]) -> list[dict[str, Any]]:
        """The last deltas, from the finished output's calls: the rest of each started call's
        arguments, and each call not started yet, whole."""
        out: list[dict[str, Any]] = []
        for i, call in enumerate(calls):
            if i >= len(self.sent):
                out.append(call.to_openai(i))
            elif call.arguments.startswith(self.sent[i]) and len(call.arguments) > len(self.sent[i]):
                out.append({"index": i, "function": {"arguments": call.arguments[len(self.sent[i]) :]}})
        return out
