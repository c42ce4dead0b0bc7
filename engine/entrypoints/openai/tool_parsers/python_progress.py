"""Where the parts of a Python list of calls end, in text still being written, for streaming the
pythonic formats' calls (pythonic.py reads the values): each call's name, the source of each
keyword argument whose value has ended (a "," or ")" outside brackets and strings), and the
certain text of a string argument still being written. Nothing is evaluated here."""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass, field

_NAME = re.compile(r"\s*([A-Za-z_]\w*(?:\s*\.\s*[A-Za-z_]\w*)*)\s*\(")
_KEYWORD = re.compile(r"\s*([A-Za-z_]\w*)\s*=(?!=)")
_OPENERS, _CLOSERS = "([{", ")]}"
_HEX_DIGITS = {"x": 2, "u": 4, "U": 8}


@dataclass
class CallSoFar:
    name: str
    values: list[tuple[str, str]] = field(default_factory=list)  # (keyword, its value's source), ended ones
    open_string: tuple[str, str] | None = None  # a string argument still being written: (keyword, its text)
    ended: bool = False  # its ")" has come


def _skip_ws(src: str, i: int) -> int:
    while i < len(src) and src[i].isspace():
        i += 1
    return i


def _string_end(src: str, i: int) -> int | None:
    """Where the string literal whose quote is at src[i] ends (past its closing quote)."""
    quote = src[i] * 3 if src.startswith(src[i] * 3, i) else src[i]
    j = i + len(quote)
    while j < len(src):
        if src[j] == "\\":
            j += 2
        elif src.startswith(quote, j):
            return j + len(quote)
        else:
            j += 1
    return None


def value_end(src: str, i: int) -> int | None:
    """Where the value starting at src[i] ends: the index of the "," or ")" after it outside
    brackets and strings; None while it is still being written (or never ends)."""
    depth = 0
    while i < len(src):
        c = src[i]
        if c in "'\"":
            end = _string_end(src, i)
            if end is None:
                return None
            i = end
            continue
        if depth == 0 and c in ",)":
            return i
        if c in _OPENERS:
            depth += 1
        elif c in _CLOSERS:
            depth -= 1
            if depth < 0:
                return None
        i += 1
    return None


def _certain(content: str) -> str:
    """The part of a string literal's text that is sure: less an escape that may go on."""
    i, n = 0, len(content)
    while i < n:
        if content[i] != "\\":
            i += 1
            continue
        kind = content[i + 1] if i + 1 < n else ""
        if kind in _HEX_DIGITS:
            end = i + 2 + _HEX_DIGITS[kind]
        elif kind == "N":
            close = content.find("}", i)
            end = close + 1 if close >= 0 else n + 1
        elif kind and kind in "01234567":  # up to three octal digits
            end = i + 2
            while end < min(n, i + 4) and content[end] in "01234567":
                end += 1
            end = n + 1 if end == n and end < i + 4 else end
        else:
            end = i + 2
        if end > n:
            return content[:i]
        i = end
    return content


def open_string_text(source: str) -> str | None:
    """The text so far of a '...' or "..." string literal still being written (its end, if it
    has come, left out: what follows may still join it, as "a" "b" does); None for any other value."""
    source = source.lstrip()
    quote = source[:1]
    if quote not in ("'", '"') or source.startswith(quote * 2):
        return None  # (not a plain string, or "" that may be the start of a triple quote)
    end = _string_end(source, 0)
    content = _certain(source[1 : end - 1] if end is not None else source[1:])
    try:
        text = ast.literal_eval(quote + content + quote)
    except (SyntaxError, ValueError):
        return None
    return text if isinstance(text, str) else None


def calls_so_far(src: str) -> list[CallSoFar]:
    """The calls of `src` (the text after a call list's "["): a call once its name and its first
    keyword argument (or its ")") are written."""
    out: list[CallSoFar] = []
    pos = 0
    while (head := _NAME.match(src, pos)) is not None:
        call = CallSoFar(re.sub(r"\s", "", head.group(1)))
        pos = head.end()
        while True:
            pos = _skip_ws(src, pos)
            if src.startswith(")", pos):
                call.ended = True
                pos += 1
                break
            keyword = _KEYWORD.match(src, pos)
            if keyword is None:
                return out + [call] if call.values else out
            end = value_end(src, keyword.end())
            if end is None:
                text = open_string_text(src[keyword.end() :])
                call.open_string = (keyword.group(1), text) if text is not None else None
                return [*out, call]
            call.values.append((keyword.group(1), src[keyword.end() : end]))
            pos = end + (src[end] == ",")
        out.append(call)
        pos = _skip_ws(src, pos)
        if not src.startswith(",", pos):
            break
        pos += 1
    return out
