"""OpenAI's harmony format (gpt-oss), as its published spec writes an assistant turn: messages
`<|start|>assistant<|channel|>CHANNEL[ to=RECIPIENT][ <|constrain|>json]<|message|>BODY` ended by
`<|end|>`, `<|call|>` (a tool call) or `<|return|>` (the answer's end). The channels: `analysis`
(reasoning), `commentary` (tool calls, addressed `to=functions.NAME`, and preambles), `final`
(the answer). Shared by the `gpt_oss` reasoning parser and the `openai` tool-call parser."""

from __future__ import annotations

import re
from dataclasses import dataclass

START, CHANNEL, MESSAGE = "<|start|>", "<|channel|>", "<|message|>"
ENDS = ("<|end|>", "<|call|>", "<|return|>")
MARKERS = (START, CHANNEL)
_CHANNEL = re.compile(r"<\|channel\|>\s*(\w+)")
_RECIPIENT = re.compile(r"\bto=([^\s<]+)")


@dataclass
class Message:
    header: str  # everything before <|message|> ("" body while the header is unfinished)
    body: str
    raw: str  # the message as written, header and end marker included
    opened: bool  # its <|message|> has come: the channel is known
    done: bool  # its end marker has come

    @property
    def channel(self) -> str | None:
        found = _CHANNEL.search(self.header)
        return found.group(1) if found else None

    @property
    def recipient(self) -> str | None:
        found = _RECIPIENT.search(self.header)
        return found.group(1) if found else None


def first_marker(text: str) -> int:
    found = [i for i in (text.find(m) for m in MARKERS) if i >= 0]
    return min(found) if found else -1


def messages(text: str) -> tuple[str, list[Message]]:
    """The text before the first message, and the messages (the last maybe unfinished)."""
    pos = first_marker(text)
    if pos < 0:
        return text, []
    lead, out = text[:pos], []
    while pos < len(text):
        body_at = text.find(MESSAGE, pos)
        if body_at < 0:
            out.append(Message(text[pos:], "", text[pos:], opened=False, done=False))
            break
        body_at += len(MESSAGE)
        ends = [(i, e) for i, e in ((text.find(e, body_at), e) for e in ENDS) if i >= 0]
        end, marker = min(ends) if ends else (len(text), "")
        out.append(
            Message(
                text[pos : body_at - len(MESSAGE)], text[body_at:end], text[pos : end + len(marker)], True, bool(ends)
            )
        )
        pos = end + len(marker)
    return lead, out


def held_end(body: str) -> int:
    """Length of the tail of an unfinished body that may be an end marker arriving."""
    best = 0
    for marker in ENDS:
        for k in range(min(len(marker) - 1, len(body)), best, -1):
            if marker.startswith(body[-k:]):
                best = k
                break
    return best
