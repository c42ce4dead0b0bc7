"""Incremental detokenisation and stop conditions.

Fast tokenizers (`tokenizers` backed) decode with `tokenizers`' DecodeStream: one decode per
new token. Other tokenizers decode a short window of ids twice (with and without the newest
ones) and emit the difference. Either way text appears only once it no longer ends in U+FFFD:
a character split across tokens (UTF-8 bytes in byte-level BPE) appears whole, once.
"""

from __future__ import annotations

from engine.core.request import FinishReason, Sequence

_WINDOW = 6  # ids of context decoded before the new ones (spacing rules need a little)


def init_offsets(seq: Sequence) -> None:
    seq.read_offset = seq.num_prompt_tokens
    seq.prefix_offset = max(seq.num_prompt_tokens - _WINDOW, 0)
    seq.decode_stream = None


def detokenize_step(tokenizer, seq: Sequence, upto: int | None = None) -> str:
    """Append the text of ids up to `upto` (default: all) to seq.text; returns the new text.
    The window method: two decodes per call (works with every tokenizer)."""
    ids = seq.token_ids if upto is None else seq.token_ids[:upto]
    skip = seq.request.params.skip_special_tokens
    if seq.read_offset >= len(ids):
        return ""
    prefix = tokenizer.decode(ids[seq.prefix_offset:seq.read_offset], skip_special_tokens=skip)
    full = tokenizer.decode(ids[seq.prefix_offset:], skip_special_tokens=skip)
    if len(full) <= len(prefix) or full.endswith("\ufffd"):
        return ""  # wait for the rest of a split character
    delta = full[len(prefix):]
    seq.prefix_offset = max(seq.read_offset, len(ids) - _WINDOW)
    seq.read_offset = len(ids)
    seq.text += delta
    return delta


class _Stream:
    """A sequence's DecodeStream and how many of its ids it has been given."""

    __slots__ = ("stream", "pos")

    def __init__(self, stream, pos: int) -> None:
        self.stream, self.pos = stream, pos


def stream_step(backend, seq: Sequence, upto: int | None = None) -> tuple[str, bool]:
    """detokenize_step with a DecodeStream kept on seq: each id is decoded once (`backend` is
    the fast tokenizer's `tokenizers.Tokenizer`). Returns (new text, done); not done where the
    stream cannot match the window method (its context ends inside a character, or it refuses
    a prefix): the caller then finishes with detokenize_step, as for this sequence from now on."""
    ids = seq.token_ids
    end = len(ids) if upto is None else upto
    state = seq.decode_stream
    skip = seq.request.params.skip_special_tokens
    if state is None:
        context = ids[seq.prefix_offset:seq.read_offset]
        if context and backend.decode(context, skip_special_tokens=skip).endswith("\ufffd"):
            seq.decode_stream = False
            return "", False
        from tokenizers.decoders import DecodeStream

        state = seq.decode_stream = _Stream(DecodeStream(ids=context, skip_special_tokens=skip), seq.read_offset)
    delta = ""
    for i in range(state.pos, end):
        try:
            piece = state.stream.step(backend, ids[i])
        except Exception:  # noqa: BLE001 - DecodeStream's InvalidPrefix: the window method takes over
            seq.decode_stream = False
            seq.text += delta
            return delta, False
        state.pos = i + 1
        if piece:
            delta += piece
            # as the window method leaves them: the next decode starts from here
            seq.prefix_offset = max(seq.read_offset, i + 1 - _WINDOW)
            seq.read_offset = i + 1
    seq.text += delta
    return delta, True


class Detokenizer:
    """Text and stop checks for sequences, with the tokenizer's fastest incremental method."""

    def __init__(self, tokenizer, eos_token_ids: tuple[int, ...], max_model_len: int,
                 use_stream: bool | None = None, text: bool = True) -> None:
        """text=False: token-level stop checks only (no text, no stop strings: another thread
        does those, engine/runtime/output_processor.py TextProcessor)."""
        self.tokenizer = tokenizer
        self.text = text
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len
        from transformers import PreTrainedTokenizerFast

        fast = isinstance(tokenizer, PreTrainedTokenizerFast) and use_stream is not False
        self.backend = tokenizer.backend_tokenizer if fast else None  # a `tokenizers.Tokenizer`

    def step(self, seq: Sequence, upto: int | None = None) -> str:
        if not self.text:
            return ""
        if self.backend is not None and seq.request.params.detokenize and seq.decode_stream is not False:
            delta, done = stream_step(self.backend, seq, upto)
            if done:
                return delta
            return delta + detokenize_step(self.tokenizer, seq, upto)  # the stream gave up: the window method
        return detokenize_step(self.tokenizer, seq, upto)

    def check_stop(self, seq: Sequence) -> None:
        """Detokenize the newest token and decide whether the sequence is done (sets
        seq.finish_reason / stop_reason; the scheduler then releases its blocks)."""
        if seq.read_offset == 0:  # a sample forked by the scheduler: its text starts after the prompt
            init_offsets(seq)
        _check_stop(self.step, seq, self.eos_token_ids, self.max_model_len)


def check_stop(tokenizer, seq: Sequence, eos_token_ids: tuple[int, ...], max_model_len: int) -> None:
    """Detokenize the newest token and decide whether the sequence is done.

    `tokenizer` is a Detokenizer or a plain tokenizer (window method). Sets
    seq.finish_reason / stop_reason (the scheduler then releases its blocks).
    """
    step = tokenizer.step if isinstance(tokenizer, Detokenizer) else (
        lambda s, upto=None: detokenize_step(tokenizer, s, upto))
    _check_stop(step, seq, eos_token_ids, max_model_len)


def _check_stop(step, seq: Sequence, eos_token_ids: tuple[int, ...], max_model_len: int) -> None:
    """check_stop with `step` the detokenising function: step(seq, upto=None) -> new text."""
    params = seq.request.params
    num_tokens = len(seq.token_ids)
    last = seq.token_ids[-1]
    num_out = num_tokens - seq.num_prompt_tokens
    may_stop = num_out >= params.min_tokens
    if may_stop and not params.ignore_eos and last in eos_token_ids:
        step(seq, upto=len(seq.token_ids) - 1)
        seq.finish_reason = FinishReason.STOP
        return
    if may_stop and last in params.stop_token_ids:
        step(seq, upto=None if params.include_stop_str_in_output else len(seq.token_ids) - 1)
        seq.finish_reason, seq.stop_reason = FinishReason.STOP, last
        return
    if params.detokenize:
        before = len(seq.text)
        delta = step(seq)
        if delta and params.stop and may_stop:
            longest = max(len(s) for s in params.stop)
            search_from = max(0, before - longest + 1)
            hit = _find_stop(seq.text, params.stop, search_from)
            if hit is not None:
                idx, stop = hit
                seq.text = seq.text[:idx + len(stop)] if params.include_stop_str_in_output else seq.text[:idx]
                seq.finish_reason, seq.stop_reason = FinishReason.STOP, stop
                return
    if num_out >= params.max_tokens or num_tokens >= max_model_len:
        seq.finish_reason = FinishReason.LENGTH


def _find_stop(text: str, stops: list[str], start: int) -> tuple[int, str] | None:
    best: tuple[int, str] | None = None
    for stop in stops:
        idx = text.find(stop, start)
        if idx != -1 and (best is None or idx < best[0]):
            best = (idx, stop)
    return best


def visible_text(seq: Sequence) -> str:
    """Text safe to show now: hold back a tail that could still become a stop string."""
    return seq.text[:visible_len(seq)]


def visible_len(seq: Sequence) -> int:
    """How many characters of seq.text are safe to show now (see visible_text)."""
    stops = seq.request.params.stop
    if seq.finish_reason is not None or not stops:
        return len(seq.text)
    return max(0, len(seq.text) - (max(len(s) for s in stops) - 1))
