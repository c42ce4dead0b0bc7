"""Calls written as Python: `[get_weather(city="Paris", days=3), get_time(zone="UTC")]`.

- `pythonic` (Llama 3.2/4 with a pythonic template, ToolACE and others): the whole output is
  one such list (after an optional `<|python_tag|>`).
- `llama4_pythonic`: as pythonic, or the list inside `<|python_start|>…<|python_end|>` where the
  model writes those markers (text before them is content).

The list is read with `ast` and nothing is evaluated: each element must be a call of a plain
(or dotted) name with keyword arguments whose values are literals (strings, numbers, lists,
dicts, tuples, True/False/None, and JSON's true/false/null).

Streamed (python_progress.py): a call once its name and its first keyword (or its ")") are
written, a string argument ('...' or "...") as it is written, any other once its value has ended.
"""

from __future__ import annotations

import ast
import json
from typing import Any

from engine.entrypoints.openai.tool_parsers.base import Parsed, Schemas, ToolCall, ToolParser, before, held_tail
from engine.entrypoints.openai.tool_parsers.python_progress import calls_so_far
from engine.entrypoints.openai.tool_parsers.streaming import CallInProgress, object_text


class _NotLiteral(ValueError):
    pass


_NAMES = {"true": True, "false": False, "null": None, "True": True, "False": False, "None": None}


def _literal(node: ast.AST) -> Any:
    if isinstance(node, ast.Constant) and isinstance(node.value, (str, int, float, bool, type(None))):
        return node.value
    if isinstance(node, (ast.List, ast.Tuple)):
        return [_literal(e) for e in node.elts]
    if isinstance(node, ast.Dict):
        if any(k is None for k in node.keys):  # {**x}
            raise _NotLiteral()
        keys = [_literal(k) for k in node.keys if k is not None]
        if not all(isinstance(k, (str, int, float, bool)) for k in keys):
            raise _NotLiteral()
        return {k if isinstance(k, str) else json.dumps(k): _literal(v) for k, v in zip(keys, node.values)}
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        value = _literal(node.operand)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise _NotLiteral()
        return -value if isinstance(node.op, ast.USub) else value
    if isinstance(node, ast.Name) and node.id in _NAMES:
        return _NAMES[node.id]
    raise _NotLiteral()


def _dotted(node: ast.AST) -> str:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return f"{_dotted(node.value)}.{node.attr}"
    raise _NotLiteral()


def literal_source(source: str) -> Any:
    """The value of a literal's source text (_NotLiteral or SyntaxError for anything else)."""
    return _literal(ast.parse(source.strip(), mode="eval").body)


def python_calls(source: str) -> list[ToolCall] | None:
    """The calls of a Python list of calls; None for anything else."""
    try:
        tree = ast.parse(source.strip(), mode="eval").body
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return None
    if isinstance(tree, ast.Call):  # a lone call without the brackets
        tree = ast.List(elts=[tree])
    if not isinstance(tree, ast.List) or not tree.elts:
        return None
    calls = []
    try:
        for node in tree.elts:
            if not isinstance(node, ast.Call) or node.args or any(k.arg is None for k in node.keywords):
                return None
            args = {k.arg: _literal(k.value) for k in node.keywords if k.arg is not None}
            calls.append(ToolCall(_dotted(node.func), json.dumps(args, ensure_ascii=False)))
    except (_NotLiteral, RecursionError):
        return None
    return calls


_PYTHON_TAG = "<|python_tag|>"


def parse_pythonic(text: str, schemas: Schemas | None = None) -> Parsed:
    body = text.strip()
    if body.startswith(_PYTHON_TAG):
        body = body[len(_PYTHON_TAG) :].strip()
    if not body.startswith("["):
        return text, []
    calls = python_calls(body)
    return (None, calls) if calls else (text, [])


def _pythonic_streamable(text: str) -> int:
    body = text.lstrip()
    if not body or body.startswith("[") or body.startswith(_PYTHON_TAG) or _PYTHON_TAG.startswith(body):
        return 0  # a call list may be starting: hold it all
    return len(text)


_START, _END = "<|python_start|>", "<|python_end|>"


def parse_llama4_pythonic(text: str, schemas: Schemas | None = None) -> Parsed:
    start = text.find(_START)
    if start < 0:
        return parse_pythonic(text)
    end = text.find(_END, start)
    calls = python_calls(text[start + len(_START) : end if end >= 0 else len(text)])
    return (before(text, start), calls) if calls else (text, [])


def _llama4_streamable(text: str) -> int:
    if _pythonic_streamable(text) == 0:
        return 0
    start = text.find(_START)
    end = start if start >= 0 else len(text) - held_tail(text, _START)
    return len(text[:end].rstrip())


def calls_in_progress(src: str) -> list[CallInProgress]:
    """The calls of a call list (the text after its "[") as written so far, their arguments as
    far as they are known (streaming.object_text). A value that is no literal, or a keyword given
    twice, stops the stream there (the whole parse decides)."""
    out: list[CallInProgress] = []
    for call in calls_so_far(src):
        members: list[tuple[str, Any]] = []
        for key, source in call.values:
            try:
                value = literal_source(source)
            except (_NotLiteral, SyntaxError, ValueError, RecursionError, MemoryError):
                return [*out, CallInProgress(call.name, object_text(members))]
            if key in dict(members):
                return [*out, CallInProgress(call.name, object_text(members))]
            members.append((key, value))
        open_string = call.open_string if call.open_string and call.open_string[0] not in dict(members) else None
        out.append(CallInProgress(call.name, object_text(members, open_string, closed=call.ended)))
    return out


def pythonic_progress(text: str, schemas: Schemas | None = None) -> list[CallInProgress]:
    """parse_pythonic's calls as written so far (streaming.py)."""
    body = text.lstrip()
    body = body.removeprefix(_PYTHON_TAG).lstrip() if body.startswith(_PYTHON_TAG) else body
    return calls_in_progress(body[1:]) if body.startswith("[") else []


def llama4_pythonic_progress(text: str, schemas: Schemas | None = None) -> list[CallInProgress]:
    start = text.find(_START)
    if start < 0:
        return pythonic_progress(text)
    body = text[start + len(_START) :].lstrip()
    return calls_in_progress(body[1:] if body.startswith("[") else body)


PYTHONIC_PARSERS = {
    "pythonic": ToolParser(parse_pythonic, _pythonic_streamable, progress=pythonic_progress),
    "llama4_pythonic": ToolParser(parse_llama4_pythonic, _llama4_streamable, progress=llama4_pythonic_progress),
}
