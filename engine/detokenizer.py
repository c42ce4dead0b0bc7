"""Incremental detokenisation and stop conditions.

Fast tokenizers (`tokenizers` backed) decode with `tokenizers`' DecodeStream: one decode per
new token. Other tokenizers decode a short window of ids twice (with and without the newest
ones) and emit the difference. Either way text appears only once it no longer ends in U+FFFD:
a character split across tokens (UTF-8 bytes in byte-level BPE) appears whole, once.
"""

from __future__ import annotations

from engine.request import FinishReason, Sequence

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


def stream_step(backend, seq: Sequence, upto: int | None = None) -> str:
    """detokenize_step with a DecodeStream kept on seq: each id not yet read is decoded once
    (`backend` is the fast tokenizer's `tokenizers.Tokenizer`)."""
    from tokenizers.decoders import DecodeStream

    ids = seq.token_ids
    end = len(ids) if upto is None else upto
    stream = seq.decode_stream
    if stream is None:
        stream = seq.decode_stream = DecodeStream(ids=ids[seq.prefix_offset:seq.read_offset],
                                                  skip_special_tokens=seq.request.params.skip_special_tokens)
    delta = ""
    for i in range(seq.read_offset, end):
        piece = stream.step(backend, ids[i])
        seq.read_offset = i + 1
        if piece:
            delta += piece
    seq.text += delta
    return delta


class Detokenizer:
    """Text and stop checks for sequences, with the tokenizer's fastest incremental method."""

    def __init__(self, tokenizer, eos_token_ids: tuple[int, ...], max_model_len: int,
                 use_stream: bool | None = None) -> None:
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len
        backend = getattr(tokenizer, "_tokenizer", None) if getattr(tokenizer, "is_fast", False) else None
        if use_stream is False:
            backend = None
        self.backend = backend

    def step(self, seq: Sequence, upto: int | None = None) -> str:
        if self.backend is not None and seq.request.params.detokenize:
            return stream_step(self.backend, seq, upto)
        return detokenize_step(self.tokenizer, seq, upto)

    def check_stop(self, seq: Sequence) -> None:
        """Detokenize the newest token and decide whether the sequence is done (sets
        seq.finish_reason / stop_reason; the scheduler then releases its blocks)."""
        if seq.read_offset == 0:  # a sample forked by the scheduler: its text starts after the prompt
            init_offsets(seq)
        check_stop(self, seq, self.eos_token_ids, self.max_model_len)


def check_stop(tokenizer, seq: Sequence, eos_token_ids: tuple[int, ...], max_model_len: int) -> None:
    """Detokenize the newest token and decide whether the sequence is done.

    `tokenizer` is a Detokenizer or a plain tokenizer (window method). Sets
    seq.finish_reason / stop_reason (the scheduler then releases its blocks).
    """
    step = tokenizer.step if isinstance(tokenizer, Detokenizer) else (
        lambda s, upto=None: detokenize_step(tokenizer, s, upto))
    params = seq.request.params
    last = seq.token_ids[-1]
    num_out = seq.num_output_tokens
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
    if num_out >= params.max_tokens or seq.num_tokens >= max_model_len:
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
