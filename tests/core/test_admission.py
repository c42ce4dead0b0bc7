"""Admission's rules (the package engine/core/admission_rules/), each with its cases:

- Every rule of the table has a case (tests/support/admission_cases.py): a request it refuses,
  refused by that rule (the error is made in the rule's function: recorded as it is made) with its
  message and param, offline (LLM), through the server (the FastAPI app in-process, a 400) and by
  beam search, wherever the request can be made there. Rules on the engine's state that need an odd
  engine (an embedding-only model, a tiny KV pool) run on Admission with a stub vocabulary,
  tokenizer and grammar compiler.
- What admission does besides refusing (truncation, each request's own params, one compile).
(That nothing outside the table refuses: test_admission_sites.py.)
"""

from __future__ import annotations

import ast
import asyncio
import re
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable

import pytest

from engine.core.admission_rules import InvalidRequestError
from engine.core.params import PoolingParams, SamplingParams, StructuredOutputsParams
from tests.support.admission_cases import CASES, TABLE, Case, StubTokenizer, stub_admission, with_state
from tests.support.engine import served


# ---- which rule made a refusal ----
@pytest.fixture
def made(monkeypatch):
    """The table functions that made each InvalidRequestError from here on (a row's table for rows)."""
    seen: list[str] = []
    init = InvalidRequestError.__init__

    def recording(self, *args, **kwargs):
        frame = sys._getframe(1)
        if frame.f_code.co_name == "_check":  # (a row: the table that holds it)
            frame = frame.f_back
        in_table = Path(frame.f_code.co_filename).parent == TABLE
        seen.append(frame.f_code.co_name if in_table else "?" + frame.f_code.co_name)
        init(self, *args, **kwargs)

    monkeypatch.setattr(InvalidRequestError, "__init__", recording)
    return seen


# Rules whose refusals need what a unit case cannot make, each tested where named.
ELSEWHERE = {
    "adapter_unreadable": "tests/entrypoints/test_lora.py (an adapter's files refused by the loader)",
    "constraint_compile_timeout": "tests/runtime/test_offline_grammar_timeout.py",
    "constraint_compile_cancelled": "a compile stopped under a request (the compile pool's tests)",
    "constraints_unavailable": "xgrammar not installed (a declared dependency)",
    "template_failed": "a chat template that raises",
}


def _table_rules() -> set[str]:
    """The table's public functions that refuse (make an InvalidRequestError or check rows)."""
    out = set()
    modules = sorted(TABLE.glob("*.py"))
    assert len(modules) > 1, f"the table's modules not found under {TABLE}"
    for node in (n for path in modules for n in ast.parse(path.read_text()).body):
        if isinstance(node, ast.FunctionDef) and not node.name.startswith("_"):
            calls = {c.func.id for c in ast.walk(node) if isinstance(c, ast.Call) and isinstance(c.func, ast.Name)}
            if calls & {"InvalidRequestError", "_check"}:
                out.add(node.name)
    return out


def test_every_rule_has_a_case():
    rules_ = _table_rules()
    cased = {c.rule for c in CASES} | set(ELSEWHERE)
    assert rules_ - cased == set(), "rules without a case"
    assert cased - rules_ == set(), "cases of no rule"


# ---- offline, beam search and the stub ----
def _check_refusal(case: Case, made: list[str], call: Callable[..., Any], *args: Any) -> None:
    made.clear()
    with pytest.raises(InvalidRequestError, match=case.match) as info:
        call(*args)
    assert info.value.param == case.param, case
    assert case.rule in made, (case, made)


def test_refused_offline_and_by_beam_search(make_llm, made):
    llm = make_llm(max_model_len=64, max_logprobs=5, max_num_seqs=4)
    ctx = SimpleNamespace(eos=llm.engine.eos_token_ids[0], vocab=llm.engine.model_config.vocab_size)
    for case in CASES:
        for how in (case.offline, case.beam):
            if how is not None:
                _check_refusal(case, made, how, llm, ctx)
    assert not llm.engine.core.has_unfinished_requests()


def test_refused_at_admission_on_the_stub(made):
    for case in CASES:
        if case.unit is not None:
            _check_refusal(case, made, case.unit, stub_admission())


def test_refused_by_the_server(tiny_llama, made):
    async def main(state, http) -> None:
        ctx = SimpleNamespace(eos=state.info.eos_token_ids[0], vocab=state.info.vocab_size)
        for case in CASES:
            if case.http is None:
                continue
            path, body = case.http(ctx)
            made.clear()
            response = await http.post(path, json={"model": "m"} | body)
            assert response.status_code == 400, (case, response.text)
            error = response.json()["error"]
            assert error["param"] == case.param and re.search(case.match, error["message"]), (case, error)
            assert case.rule in made, (case, made)

    with served(tiny_llama, max_model_len=64, max_logprobs=5, max_num_seqs=4) as (state, http, client):
        asyncio.run(main(state, http))


# ---- admission's own work (no refusal) ----
def test_truncation_and_an_exact_fit():
    a = stub_admission()
    assert a.admit(list(range(10)), SamplingParams(max_tokens=6)).params.max_tokens == 6  # fits exactly
    text = "abcdefghijklmnopqrst"  # 20 tokens: too long, unless truncated
    cut = a.admit(text, SamplingParams(max_tokens=4, truncate_prompt_tokens=8))
    assert cut.prompt_token_ids == StubTokenizer().encode(text)[-8:] and cut.prompt is None  # (the text no longer fits)
    embedding = with_state(
        stub_admission(), model_config=SimpleNamespace(vocab_size=100, generates=False, hidden_size=16)
    ).admit([1, 2], pooling=PoolingParams())
    assert not embedding.task.text_output and embedding.params.max_tokens == 1


def test_each_request_gets_its_own_params():
    a = stub_admission()
    params = SamplingParams(max_tokens=None, stop=["x"])
    first, second = a.admit(list(range(10)), params), a.admit(list(range(4)), params, output_kind="delta")
    assert (first.params.max_tokens, second.params.max_tokens) == (6, 12)  # up to max_model_len, each its own
    assert second.params.output_kind == "delta" and first.params.output_kind == params.output_kind == "cumulative"
    assert params.max_tokens is None and first.params.stop is not params.stop  # the caller's params untouched


def test_a_constraint_is_compiled_once_and_travels_with_the_request():
    a = stub_admission()
    spec = StructuredOutputsParams(choice=["yes", "no"])
    admitted = a.admit([1, 2], SamplingParams(max_tokens=4, structured_outputs=spec))
    assert a.grammars.compiled == [spec] and admitted.grammar == ("compiled", spec.cache_key())
    assert a.admit([1, 2], SamplingParams(max_tokens=4)).grammar is None
