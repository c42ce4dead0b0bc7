"""What every tool-call parser shares: the call, the parser's two functions, and the helpers
the formats have in common (JSON call objects, the text before a call, holding back a marker
that may be arriving in a stream)."""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

Schemas = Mapping[str, dict[str, Any]]  # tool name -> its parameters' JSON schema


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


Parsed = tuple[str | None, list[ToolCall]]


@dataclass(frozen=True)
class ToolParser:
    """One model family's call format.

    parse(text, schemas) -> (content, calls) of a finished output; text that is not a
    well-formed call stays content (never an error). streamable(text) -> how many leading
    characters of an unfinished output are surely content: a stream sends those and holds the
    rest, so nothing of a call (not even a marker's first characters) leaks into content. The
    content parse returns starts with every such prefix, so a stream's content deltas add up
    to it. keep_special_tokens: the markers are special tokens, which the text must keep.
    progress(text, schemas): the calls written so far, for streaming them as they come
    (streaming.py).
    """

    parse: Callable[[str, Schemas], Parsed]
    streamable: Callable[[str], int]
    keep_special_tokens: bool = False
    # The calls of an unfinished output as written so far (streaming.CallInProgress), for a
    # format whose arguments stream as they are written; None: each call goes whole at the end.
    progress: Callable[[str, Schemas], list[Any]] | None = None


def arguments_json(args: Any) -> str:
    return args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)


def call_from(obj: Any, make_id: Callable[[], str] | None = None) -> ToolCall | None:
    """A call from {"name", "arguments" | "parameters"}; None for anything else."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if not isinstance(args, (dict, str)):
        return None
    return ToolCall(obj["name"], arguments_json(args), make_id() if make_id else "")


def calls_from(objs: Iterable[Any], make_id: Callable[[], str] | None = None) -> list[ToolCall] | None:
    """Calls from a list of call objects; None if any is not one (or there are none)."""
    calls = [call_from(o, make_id) for o in objs]
    return calls if calls and all(c is not None for c in calls) else None  # type: ignore[return-value]


def before(text: str, start: int) -> str | None:
    """The content ahead of a call starting at `start` (trailing whitespace dropped; a stream
    holds trailing whitespace back, so what it sent is always a prefix of this)."""
    return text[:start].rstrip() or None


def held_tail(text: str, marker: str) -> int:
    """Length of the longest tail of text that is a proper prefix of marker."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-k:]):
            return k
    return 0


def first_marker(text: str, markers: Iterable[str]) -> int:
    """Where the first of the markers starts in text (-1: none does)."""
    found = [i for i in (text.find(m) for m in markers) if i >= 0]
    return min(found) if found else -1


def marker_streamable(markers: tuple[str, ...]) -> Callable[[str], int]:
    """streamable() of a format whose calls start with one of the markers: content up to the
    first marker, less a tail that may be a marker arriving, less trailing whitespace."""

    def streamable(text: str) -> int:
        start = first_marker(text, markers)
        end = start if start >= 0 else len(text) - max(held_tail(text, m) for m in markers)
        return len(text[:end].rstrip())

    return streamable


def hold_if_starts(prefixes: tuple[str, ...]) -> Callable[[str], int]:
    """streamable() of a format whose calls are the whole output: while the output (less
    leading whitespace) is empty or begins like one of the prefixes, hold it all."""

    def streamable(text: str) -> int:
        body = text.lstrip()
        for p in prefixes:
            if body.startswith(p) or p.startswith(body):
                return 0
        return len(text)

    return streamable


def json_sequence(body: str, separators: str = ";,") -> list[Any] | None:
    """The JSON values of body, one after another (whitespace or one separator between them);
    None unless body is just that."""
    decoder = json.JSONDecoder(strict=False)
    values: list[Any] = []
    pos, n = 0, len(body)
    while True:
        while pos < n and body[pos].isspace():
            pos += 1
        if pos == n:
            return values or None
        if values and body[pos] in separators:
            pos += 1
            while pos < n and body[pos].isspace():
                pos += 1
        try:
            value, pos = decoder.raw_decode(body, pos)
        except ValueError:
            return None
        values.append(value)


def json_prefix(body: str) -> tuple[Any, int] | None:
    """The JSON value at the start of body (after whitespace) and where it ends; None if none."""
    start = len(body) - len(body.lstrip())
    try:
        return json.JSONDecoder(strict=False).raw_decode(body, start)
    except ValueError:
        return None
