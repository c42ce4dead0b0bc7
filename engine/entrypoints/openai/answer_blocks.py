"""A streamed chat answer as a sequence of blocks, for the APIs whose streams open and close one
block (Anthropic's content blocks, the Responses API's output items) per piece of the answer:
its reasoning, its text, each tool call. The split itself is chat.py's (chat_stream_delta), so
every API finds reasoning and calls the same way.

A subclass says what starting a block, a piece of its text and its end look like. A call's
arguments reach `stopped` whole: they are sent as strict JSON, which needs them whole."""

from __future__ import annotations

import json
from typing import Any

from engine.entrypoints.openai.chat import chat_stream_delta
from engine.entrypoints.openai.jobs import Choice, Job


def json_text(arguments: str) -> str:
    """A call's arguments as strict JSON: a model's JSON may hold raw control characters in its
    strings (read leniently, as tool_calls.py does), which clients' strict parsers refuse."""
    try:
        return json.dumps(json.loads(arguments, strict=False), ensure_ascii=False)
    except ValueError:
        return arguments  # (cut short: sent as written)


def answer_piece(job: Job, ch: Choice, c) -> dict[str, Any]:
    """The chat delta of one output delta: reasoning_content, content, tool_calls (chat.py)."""
    if job.tool_mode is not None or job.reasoning is not None:
        piece, _ = chat_stream_delta(job, ch, c.text, c.finish_reason)
        return piece
    return {"content": c.text} if c.text else {}


class AnswerBlocks:
    """Routes the pieces of one streamed answer into blocks of kind "reasoning", "text" or
    "call" (numbered from 0 in the order they open); subclasses frame them."""

    def __init__(self) -> None:
        self.index = -1  # the open (or last) block's number
        self.kind: str | None = None  # the open block's kind; None when none is open
        self.text = ""  # the open block's text (a call: its arguments) so far
        self.call: dict[str, Any] | None = None  # the open call's {"id", "name"}
        self.called = False  # the answer holds a call
        self.finish: tuple[str | None, int | str | None] = (None, None)  # (finish_reason, stop_reason)

    # ---- what a subclass frames ----
    def started(self, kind: str) -> list[str]:
        return []

    def delta(self, kind: str, text: str) -> list[str]:
        return []

    def stopped(self, kind: str, text: str) -> list[str]:
        return []

    # ---- routing ----
    def feed(self, job: Job, ch: Choice, c) -> list[str]:
        """The events of one output delta."""
        piece = answer_piece(job, ch, c)
        if c.finish_reason:
            self.finish = (c.finish_reason, c.stop_reason)
        out: list[str] = []
        if piece.get("reasoning_content"):
            out += self._add("reasoning", piece["reasoning_content"])
        if piece.get("content"):
            out += self._add("text", piece["content"])
        for call in piece.get("tool_calls") or []:
            fn = call.get("function") or {}
            if "id" in call:  # a new call
                self.called = True
                out += self.close()
                self.call = {"id": call["id"], "name": fn.get("name")}
                out += self._open("call")
            self.text += fn.get("arguments") or ""
        return out

    def close(self) -> list[str]:
        """End the open block, if any."""
        if self.kind is None:
            return []
        kind, text = self.kind, self.text
        self.kind = None
        return self.stopped(kind, json_text(text) if kind == "call" else text)

    def _open(self, kind: str) -> list[str]:
        self.index, self.kind, self.text = self.index + 1, kind, ""
        return self.started(kind)

    def _add(self, kind: str, text: str) -> list[str]:
        out = [] if self.kind == kind else [*self.close(), *self._open(kind)]
        self.text += text
        return [*out, *self.delta(kind, text)]
