"""Reasoning parsers (vLLM's --reasoning-parser): split a chat answer into the model's thinking
(`reasoning_content`) and the answer (`content`).

- `deepseek_r1`: the chat template opens `<think>`, so the output starts inside the thinking;
  everything up to `</think>` is reasoning (a leading `<think>` is dropped), the rest is content.
  Without `</think>` it is all reasoning.
- `qwen3`: thinking only when the output starts with `<think>` (Qwen3 with enable_thinking;
  without it there is no block and everything is content); up to `</think>` is reasoning.

`split(text, final)` is used both for whole answers and, on the growing text, for streams:
with final=False it holds back a tail that may be the start of a tag, so nothing streamed
as reasoning turns out to be a tag, and content starts only once the block is closed.
"""

from __future__ import annotations

REASONING_PARSERS = ("deepseek_r1", "qwen3")
_OPEN, _CLOSE = "<think>", "</think>"


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

    def split(self, text: str, final: bool = True) -> tuple[str | None, str | None]:
        """(reasoning, content) of the answer so far; None where there is none (yet)."""
        body = text.lstrip()
        if self.kind == "qwen3":
            if not body.startswith(_OPEN):
                if not final and _OPEN.startswith(body):
                    return None, None  # "<thi": may be the block starting
                return None, text
        if body.startswith(_OPEN):
            body = body[len(_OPEN) :]
        elif not final and body and _OPEN.startswith(body):
            return None, None
        end = body.find(_CLOSE)
        if end < 0:
            reasoning = body if final else body[: len(body) - _held(body, _CLOSE)]
            return reasoning or None, None
        content = body[end + len(_CLOSE) :].lstrip("\n")
        return body[:end] or None, content or None
