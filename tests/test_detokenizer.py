"""Incremental detokenisation: DecodeStream (fast tokenizers, one decode per token) gives the
same text as the two-decode window method, after every token, on random token streams and on
characters split across byte-level tokens; an incomplete UTF-8 character stays held back."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from engine.core.request import Request, SamplingParams, Sequence
from engine.runtime.detokenizer import Detokenizer, detokenize_step, init_offsets


@pytest.fixture(scope="module")
def tokenizer(tiny_llama):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_llama))


def _seq(prompt: list[int], skip: bool) -> Sequence:
    request = Request("r", None, prompt, SamplingParams(skip_special_tokens=skip))
    seq = Sequence(0, request, 0, list(prompt), len(prompt))
    init_offsets(seq)
    return seq


def _texts(tokenizer, prompt: list[int], stream: list[int], skip: bool) -> tuple[list[str], list[str], Sequence]:
    window, fast = _seq(prompt, skip), _seq(prompt, skip)
    detok = Detokenizer(tokenizer, (), 1 << 20)
    a, b = [], []
    for token in stream:
        window.token_ids.append(token)
        fast.token_ids.append(token)
        detokenize_step(tokenizer, window)
        detok.step(fast)
        a.append(window.text)
        b.append(fast.text)
    return a, b, fast


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_decode_stream_equals_window_method(tokenizer, data):
    vocab = len(tokenizer)
    ids = st.integers(0, vocab - 1)
    prompt = data.draw(st.lists(ids, min_size=1, max_size=12))
    stream = data.draw(st.lists(ids, min_size=1, max_size=40))
    skip = data.draw(st.booleans())
    window, fast, _ = _texts(tokenizer, prompt, stream, skip)
    assert fast == window


# (A literal U+FFFD is held back by both methods: it looks like a split character.)
@given(text=st.text(alphabet=st.characters(codec="utf-8", exclude_categories=["Cs"], exclude_characters="\ufffd"), min_size=1, max_size=30))
@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@example(text="<|bos|>")  # a special token's spelling (found by hypothesis)
def test_split_characters_appear_whole_once(tokenizer, text):
    ids = tokenizer.encode(text, add_special_tokens=False)
    prompt = tokenizer.encode("Hello", add_special_tokens=False)
    window, fast, seq = _texts(tokenizer, prompt, ids, True)
    assert fast == window
    assert seq.decode_stream, "the stream gave up on text encoded by the tokenizer itself"
    # skip=True above: a text that spells a special token ("<|bos|>") decodes to nothing
    whole = tokenizer.decode(prompt + ids, skip_special_tokens=True)
    assert fast[-1] == whole[len(tokenizer.decode(prompt, skip_special_tokens=True)):]
    assert not any(t.endswith("\ufffd") for t in fast)


def test_incomplete_character_is_held_back(tokenizer):
    ids = tokenizer.encode("日", add_special_tokens=False)
    assert len(ids) > 1, "the tiny tokenizer splits this character into byte tokens"
    prompt = tokenizer.encode("a", add_special_tokens=False)
    window, fast, seq = _texts(tokenizer, prompt, ids, True)
    assert seq.decode_stream
    assert fast[:-1] == window[:-1] == [""] * (len(ids) - 1)
    assert fast[-1] == window[-1] == "日"


def test_detokenizer_picks_the_stream_for_fast_tokenizers(tokenizer):
    assert Detokenizer(tokenizer, (), 100).backend is not None
    assert Detokenizer(tokenizer, (), 100, use_stream=False).backend is None
