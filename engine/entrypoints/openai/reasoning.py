"""Reasoning parsers (vLLM's --reasoning-parser): split a chat answer into the model's thinking
(`reasoning_content`) and the answer (`content`).

Most families mark the thinking with a pair of tags:

- `deepseek_r1`, `deepseek_v3` (V3.1 with thinking), `step3`: the chat template opens
  `<think>`, so the output starts inside the thinking; everything up to `</think>` is reasoning
  (a leading `<think>` is dropped), the rest is content. Without `</think>` it is all reasoning.
- `qwen3`, `glm45` (GLM-4.5/4.6): thinking only when the output starts with `<think>` (without
  it everything is content); up to `</think>` is reasoning.
- `hunyuan` (Hunyuan-A13B): as qwen3, and the answer's `<answer>…</answer>` wrapper is dropped.
- `mistral` (Magistral): `[THINK]…[/THINK]` at the start (special tokens, kept in the text).
- `granite` (Granite 3.2+): "Here is my thought process:" … "Here is my response:".

- `gpt_oss`: harmony (harmony.py): the analysis channel is reasoning, the final channel's text
  (and commentary preambles) is content, and a message addressed to a tool stays as written,
  for the `openai` tool-call parser.

`split(text, final)` is used both for whole answers and, on the growing text, for streams:
with final=False it holds back a tail that may be the start of a tag, so nothing streamed
as reasoning turns out to be a tag, and content starts only once the block is closed.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.entrypoints.openai import harmony


@dataclass(frozen=True)
class _Tags:
    open: str
    close: str
    implicit: bool  # the template opened the block: the output starts inside it
    answer: tuple[str, str] | None = None  # a wrapper around the content, dropped


_THINK = ("<think>", "</think>")
_TAGS = {
    "deepseek_r1": _Tags(*_THINK, implicit=True),
    "deepseek_v3": _Tags(*_THINK, implicit=True),
    "step3": _Tags(*_THINK, implicit=True),
    "qwen3": _Tags(*_THINK, implicit=False),
    "glm45": _Tags(*_THINK, implicit=False),
    "hunyuan": _Tags(*_THINK, implicit=False, answer=("<answer>", "</answer>")),
    "mistral": _Tags("[THINK]", "[/THINK]", implicit=False),
    "granite": _Tags("Here is my thought process:", "Here is my response:", implicit=False),
}
REASONING_PARSERS = (*_TAGS, "gpt_oss")
KEEP_SPECIAL_TOKENS = frozenset({"mistral", "gpt_oss"})  # their markers are special tokens


def _held(text: str, tag: str) -> int:
    """Length of the longest tail of text that is a proper prefix of tag."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-k:]):
            return k
    return 0


class ReasoningParser:
    def __init__(self, kind: str) -> None:
        if kind not in REASONING_PARSERS:
            raise ValueError(f"reasoning parser must be one of {', '.join(REASONING_PARSERS)}, got {kind!r}")
        self.kind = kind

    @property
    def markers(self) -> tuple[str, str]:
        """The texts that open and close the thinking (structured outputs start after it)."""
        if self.kind == "gpt_oss":
            return "<|channel|>analysis", "<|channel|>final<|message|>"
        tags = _TAGS[self.kind]
        return tags.open, tags.close

    def split(self, text: str, final: bool = True) -> tuple[str | None, str | None]:
        """(reasoning, content) of the answer so far; None where there is none (yet)."""
        if self.kind == "gpt_oss":
            return _split_harmony(text, final)
        tags = _TAGS[self.kind]
        body = text.lstrip()
        if not tags.implicit and not body.startswith(tags.open):
            if not final and tags.open.startswith(body):
                return None, None  # "<thi": may be the block starting
            return None, _unwrap(tags, text, final)
        if body.startswith(tags.open):
            body = body[len(tags.open) :]
        elif not final and body and tags.open.startswith(body):
            return None, None
        end = body.find(tags.close)
        if end < 0:
            reasoning = body if final else body[: len(body) - _held(body, tags.close)]
            return reasoning or None, None
        content = _unwrap(tags, body[end + len(tags.close) :].lstrip("\n"), final)
        return body[:end] or None, content or None


def _unwrap(tags: _Tags, content: str, final: bool) -> str | None:
    """The content less the answer wrapper of formats that have one (held back while a tag of
    it may be arriving)."""
    if tags.answer is None:
        return content
    open_, close = tags.answer
    body = content.lstrip()
    if not body.startswith(open_):
        return None if not final and open_.startswith(body) else content  # ("" too: may be coming)
    body = body[len(open_) :].lstrip("\n")
    end = body.find(close)
    if end >= 0:
        return body[:end].rstrip("\n") or None
    if final:
        return body or None
    # (newlines held back too: the closing tag, should it come, drops those before it)
    return body[: len(body) - _held(body, close)].rstrip("\n") or None


def _split_harmony(text: str, final: bool) -> tuple[str | None, str | None]:
    lead, msgs = harmony.messages(text)
    if not msgs:
        held = 0 if final else max(_held(text, m) for m in harmony.MARKERS)
        return None, text[: len(text) - held] or None
    reasoning, content = [], [lead]
    for msg in msgs:
        if not msg.opened:  # the header is still arriving: its channel is not known yet
            if final:
                content.append(msg.raw)
            continue
        body = msg.body if msg.done or final else msg.body[: len(msg.body) - harmony.held_end(msg.body)]
        if msg.channel == "analysis":
            reasoning.append(body)
        elif msg.recipient is None:  # the answer, or a commentary preamble to tool calls
            content.append(body)
        else:  # a tool call: as written, for the tool-call parser
            content.append(msg.raw)
    return "".join(reasoning) or None, "".join(content) or None
