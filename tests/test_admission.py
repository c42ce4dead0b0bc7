"""Admission (engine/runtime/admission.py): each rule once, each request checked once.

The rules on their own (no model: a stub vocabulary, tokenizer and grammar compiler), then the
count of checks one request gets on its way in, offline (LLM.generate) and through the server
(the FastAPI app in-process): SamplingParams and its constraint validated once, the engine's
limits and the length rule checked once (per prompt), the constraint compiled once; the engine
makes its matchers from that compile, it never compiles again.
"""

from __future__ import annotations

import contextlib
from types import SimpleNamespace

import pytest
from conftest import served

from engine.core.request import InvalidRequestError, PoolingParams, SamplingParams, StructuredOutputsParams
from engine.runtime.admission import Admission


class _Grammars:
    def __init__(self) -> None:
        self.compiled: list[StructuredOutputsParams] = []

    def compile(self, spec: StructuredOutputsParams):
        self.compiled.append(spec)
        return ("compiled", spec.cache_key())


class _Tokenizer:
    def encode(self, text: str) -> list[int]:
        return [ord(c) % 100 for c in text]


def _admission(generates: bool = True) -> Admission:
    config = SimpleNamespace(vocab_size=100, generates=generates, hidden_size=16)
    return Admission(config, "m", max_model_len=16, max_num_seqs=4, max_logprobs=5, tokenizer=_Tokenizer(),
                     grammars=_Grammars())


def _refused(match: str, param: str | None = None):
    @contextlib.contextmanager
    def check():
        with pytest.raises(InvalidRequestError, match=match) as info:
            yield
        if param is not None:
            assert info.value.param == param

    return check()


def test_the_length_rule():
    a = _admission()
    with _refused("the prompt is empty", "prompt"):
        a.admit([], SamplingParams())
    with _refused("leaves no room", "prompt"):
        a.admit(list(range(16)), SamplingParams(max_tokens=1))
    with _refused("exceeds max_model_len=16", "max_tokens"):
        a.admit(list(range(10)), SamplingParams(max_tokens=7))
    assert a.admit(list(range(10)), SamplingParams(max_tokens=6)).params.max_tokens == 6  # fits exactly
    text = "abcdefghijklmnopqrst"  # 20 tokens: too long, unless truncated
    with _refused("leaves no room"):
        a.admit(text, SamplingParams(max_tokens=4))
    cut = a.admit(text, SamplingParams(max_tokens=4, truncate_prompt_tokens=8))
    assert cut.prompt_token_ids == _Tokenizer().encode(text)[-8:] and cut.prompt is None  # (the text no longer fits)


def test_token_ids_outside_the_vocabulary():
    a = _admission()
    with _refused(r"prompt: token ids must be integers in \[0, 100\)", "prompt"):
        a.admit([5, 100], SamplingParams(max_tokens=2))
    for field, value in (("stop_token_ids", [100]), ("logit_bias", {100: 1.0}), ("allowed_token_ids", [-1])):
        with _refused(field, field):
            a.admit([5, 6], SamplingParams(max_tokens=2, **{field: value}))
    assert a.admit([0, 99], SamplingParams(max_tokens=2, stop_token_ids=[99])).prompt_token_ids == [0, 99]


def test_the_engines_limits():
    a = _admission()
    with _refused("max_logprobs", "logprobs"):
        a.admit([1], SamplingParams(logprobs=6))
    with _refused("max_logprobs", "prompt_logprobs"):
        a.admit([1], SamplingParams(prompt_logprobs=6))
    with _refused("max_num_seqs", "n"):
        a.admit([1], SamplingParams(n=5, temperature=1.0))
    with _refused("hidden size", "dimensions"):
        a.admit([1], pooling=PoolingParams(dimensions=17))
    with _refused("no language-model head", "model"):
        _admission(generates=False).admit([1], SamplingParams())
    embedding = _admission(generates=False).admit([1, 2], pooling=PoolingParams())
    assert not embedding.task.text_output and embedding.params.max_tokens == 1


def test_each_request_gets_its_own_params():
    a = _admission()
    params = SamplingParams(max_tokens=None, stop=["x"])
    first, second = a.admit(list(range(10)), params), a.admit(list(range(4)), params, output_kind="delta")
    assert (first.params.max_tokens, second.params.max_tokens) == (6, 12)  # up to max_model_len, each its own
    assert second.params.output_kind == "delta" and first.params.output_kind == params.output_kind == "cumulative"
    assert params.max_tokens is None and first.params.stop is not params.stop  # the caller's params untouched


def test_a_constraint_is_compiled_once_and_travels_with_the_request():
    a = _admission()
    spec = StructuredOutputsParams(choice=["yes", "no"])
    admitted = a.admit([1, 2], SamplingParams(max_tokens=4, structured_outputs=spec))
    assert a.grammars.compiled == [spec] and admitted.grammar == ("compiled", spec.cache_key())
    assert a.admit([1, 2], SamplingParams(max_tokens=4)).grammar is None


# ---- how many checks one request gets ----
COUNTED = {
    "SamplingParams.validate": (SamplingParams, "validate"),
    "StructuredOutputsParams.validate": (StructuredOutputsParams, "validate"),
    "Admission.check_params": (Admission, "check_params"),
    "Admission.check_length": (Admission, "check_length"),
}


@pytest.fixture
def counts(monkeypatch):
    """Calls of each validator from here on, and real grammar compiles (each puts its grammar in
    the compiler's cache once; a cache hit puts nothing)."""
    from engine.structured_output.grammars import GrammarCache

    seen = {name: 0 for name in COUNTED} | {"compile": 0}

    def counted(name, fn):
        def wrapper(*args, **kwargs):
            seen[name] += 1
            return fn(*args, **kwargs)
        return wrapper

    for name, (cls, attr) in COUNTED.items():
        monkeypatch.setattr(cls, attr, counted(name, getattr(cls, attr)))
    monkeypatch.setattr(GrammarCache, "put", counted("compile", GrammarCache.put))
    return seen


def test_an_offline_request_is_checked_once(make_llm, counts):
    llm = make_llm(max_model_len=64)
    counts.update(dict.fromkeys(counts, 0))  # (the LLM's start-up made params of its own)
    params = SamplingParams(temperature=0, max_tokens=6,
                            structured_outputs=StructuredOutputsParams(choice=["yes", "no"]))
    out = llm.generate(["Is it?"], params, use_tqdm=False)[0].outputs[0]
    assert out.text in ("yes", "no") and out.finish_reason == "stop"
    assert counts == {"SamplingParams.validate": 1, "StructuredOutputsParams.validate": 1,
                      "Admission.check_params": 1, "Admission.check_length": 1, "compile": 1}


def test_a_server_request_is_checked_once(tiny_llama, counts):
    import asyncio

    with served(tiny_llama, max_model_len=128) as (state, http, client):
        counts.update(dict.fromkeys(counts, 0))  # (start-up made params of its own)
        response = asyncio.run(http.post("/v1/completions", json={
            "model": "m", "prompt": ["Is it?", "Or is it not?"], "max_tokens": 6, "temperature": 0,
            "structured_outputs": {"choice": ["yes", "no"]}}))
        assert response.status_code == 200, response.text
        assert [c["text"] in ("yes", "no") for c in response.json()["choices"]] == [True, True]
    # Two prompts: the params, their constraint and the limits once; the length rule once a prompt.
    assert counts == {"SamplingParams.validate": 1, "StructuredOutputsParams.validate": 1,
                      "Admission.check_params": 1, "Admission.check_length": 2, "compile": 1}
