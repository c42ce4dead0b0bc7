"""A streamed chat answer as a sequence of blocks, for the APIs whose streams open and close one
block (Anthropic's content blocks, the Responses API's output items) per piece of the answer:
its reasoning, its text, each tool call. The split itself is chat.py's (chat_stream_delta), so
every API finds reasoning and calls the same way.

A subclass says what starting a block, a piece of its text and its end look like. A call's
arguments stream as they are written, in the form the whole answer carries them (strict JSON,
json.dumps's spacing: streaming.CanonicalJSON of what came so far), so the pieces add up to
the arguments `stopped` gets: the non-streamed answer's (json_text). Each API sends them strict,
which a named call's constrained text (compact, maybe raw control characters) is not as written."""

from __future__ import annotations

import json
from typing import Any

from engine.entrypoints.openai.chat import chat_stream_delta
from engine.entrypoints.openai.jobs import Choice, Job
from engine.entrypoints.openai.tool_parsers.streaming import CanonicalJSON


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
        self.text = ""  # the open block's text (a call: its arguments as the chat deltas gave them) so far
        self.args_sent = ""  # the open call's arguments as streamed (canonical JSON of self.text)
        self.canonical = CanonicalJSON()  # the open call's arguments made canonical as they come
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
            if arguments := fn.get("arguments"):
                self.text += arguments
                if more := self.canonical.feed(arguments):
                    self.args_sent += more
                    out += self.delta("call", more)
        return out

    def close(self) -> list[str]:
        """End the open block, if any."""
        if self.kind is None:
            return []
        kind, text = self.kind, self.text
        self.kind = None
        if kind != "call":
            return self.stopped(kind, text)
        whole, sent = json_text(text), self.args_sent
        if not whole.startswith(sent):
            # (not JSON as a whole: cut short by max_tokens, or keys written twice): the call's
            # arguments are what its pieces added up to
            return self.stopped(kind, sent)
        rest = self.delta(kind, whole[len(sent) :]) if len(whole) > len(sent) else []
        return [*rest, *self.stopped(kind, whole)]

    def _open(self, kind: str) -> list[str]:
        self.index, self.kind, self.text, self.args_sent = self.index + 1, kind, "", ""
        self.canonical = CanonicalJSON()
        return self.started(kind)

    def _add(self, kind: str, text: str) -> list[str]:
        out = [] if self.kind == kind else [*self.close(), *self._open(kind)]
        self.text += text
        return [*out, *self.delta(kind, text)]
