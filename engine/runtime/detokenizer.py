"""Incremental detokenisation, over one sample's own `TextState`.

Fast tokenizers (`tokenizers` backed) decode with `tokenizers`' DecodeStream: one decode per
new token. Other tokenizers decode a short window of ids twice (with and without the newest
ones) and emit the difference. Either way text appears only once it no longer ends in U+FFFD:
a character split across tokens (UTF-8 bytes in byte-level BPE) appears whole, once.
"""

from __future__ import annotations

from typing import Literal

_WINDOW = 6  # ids of context decoded before the new ones (spacing rules need a little)


class TextState:
    """One sample's text so far and where its decoding stands. `ids` holds the prompt's last
    _WINDOW ids (all the context either method reads), then the output's."""

    __slots__ = ("ids", "prefix_offset", "read_offset", "stream", "text", "skip_special_tokens")

    def __init__(self, prompt_token_ids: list[int], skip_special_tokens: bool = True) -> None:
        self.ids = list(prompt_token_ids[-_WINDOW:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.stream: _Stream | Literal[False] | None = (
            None  # the fast tokenizer's DecodeStream (_Stream); False: gave up, the window method
        )
        self.text = ""
        self.skip_special_tokens = skip_special_tokens


def detokenize_step(tokenizer, state: TextState) -> str:
    """Append the text of the ids not decoded yet to state.text; returns the new text.
    The window method: two decodes per call (works with every tokenizer)."""
    ids = state.ids
    skip = state.skip_special_tokens
    if state.read_offset >= len(ids):
        return ""
    prefix = tokenizer.decode(ids[state.prefix_offset : state.read_offset], skip_special_tokens=skip)
    full = tokenizer.decode(ids[state.prefix_offset :], skip_special_tokens=skip)
    if len(full) <= len(prefix) or full.endswith("\ufffd"):
        return ""  # wait for the rest of a split character
    delta = full[len(prefix) :]
    state.prefix_offset = max(state.read_offset, len(ids) - _WINDOW)
    state.read_offset = len(ids)
    state.text += delta
    return delta


class _Stream:
    """A sample's DecodeStream and how many of its ids it has been given."""

    __slots__ = ("stream", "pos")

    def __init__(self, stream, pos: int) -> None:
        self.stream, self.pos = stream, pos


def stream_step(backend, state: TextState) -> tuple[str, bool]:
    """detokenize_step with a DecodeStream kept on the state: each id is decoded once (`backend`
    is the fast tokenizer's `tokenizers.Tokenizer`). Returns (new text, done); not done where the
    stream cannot match the window method (its context ends inside a character, or it refuses
    a prefix): the caller then finishes with detokenize_step, as for this sample from now on."""
    ids = state.ids
    end = len(ids)
    stream = state.stream
    skip = state.skip_special_tokens
    if stream is None:
        context = ids[state.prefix_offset : state.read_offset]
        if context and backend.decode(context, skip_special_tokens=skip).endswith("\ufffd"):
            state.stream = False
            return "", False
        from tokenizers.decoders import DecodeStream

        stream = state.stream = _Stream(DecodeStream(ids=context, skip_special_tokens=skip), state.read_offset)
    assert stream is not False  # (the caller takes the window method once the stream gave up)
    delta = ""
    for i in range(stream.pos, end):
        try:
            piece = stream.stream.step(backend, ids[i])
        except Exception:  # noqa: BLE001 - DecodeStream's InvalidPrefix: the window method takes over
            state.stream = False
            state.text += delta
            return delta, False
        stream.pos = i + 1
        if piece:
            delta += piece
            # as the window method leaves them: the next decode starts from here
            state.prefix_offset = max(state.read_offset, i + 1 - _WINDOW)
            state.read_offset = i + 1
    state.text += delta
    return delta, True


class Detokenizer:
    """Text for TextStates, with the tokenizer's fastest incremental method."""

    def __init__(self, tokenizer, use_stream: bool | None = None) -> None:
        self.tokenizer = tokenizer
        from tokenizers import Tokenizer

        # A fast tokenizer's `tokenizers.Tokenizer` (transformers' or kiln's own form: asked by
        # attribute, so this imports no transformers).
        backend = getattr(tokenizer, "backend_tokenizer", None) if use_stream is not False else None
        self.backend = backend if isinstance(backend, Tokenizer) else None

    def step(self, state: TextState) -> str:
        """Decode the state's ids not decoded yet; returns the new text."""
        if self.backend is not None and state.stream is not False:
            delta, done = stream_step(self.backend, state)
            if done:
                return delta
            return delta + detokenize_step(self.tokenizer, state)  # the stream gave up: the window method
        return detokenize_step(self.tokenizer, state)


def visible_len(text: str, longest_stop: int, finished: bool) -> int:
    """How many characters of `text` are safe to show now: a tail that could still become a stop
    string (of at most `longest_stop` characters) is held back until the sample ends."""
    if finished or longest_stop == 0:
        return len(text)
    return max(0, len(text) - (longest_stop - 1))
