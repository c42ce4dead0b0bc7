"""Offline structured outputs get the server's grammar compile time limit (issue 12, item 1)."""

import time

import pytest

from engine.core.admission_rules import InvalidRequestError
from engine.core.params import SamplingParams, StructuredOutputsParams


def _optional_properties(n: int) -> dict:
    # Compile time grows fast with the number of optional properties: 2 s of CPU at 5000, 9 s at 10000.
    return {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(n)}}


def test_pathological_schema_is_refused_in_time_and_the_llm_goes_on(make_llm):
    llm = make_llm(grammar_compile_timeout_s=2, grammar_compile_workers=1)
    params = SamplingParams(max_tokens=4, structured_outputs=StructuredOutputsParams(json=_optional_properties(10000)))
    t0 = time.perf_counter()
    with pytest.raises(InvalidRequestError) as err:
        llm.generate(["Hi"], params, use_tqdm=False)
    elapsed = time.perf_counter() - t0
    assert elapsed < 30, elapsed
    assert err.value.param == "structured_outputs"
    assert "grammar_compile_timeout_s=2.0s" in str(err.value)
    assert not llm.engine.core.has_unfinished_requests()
    # The worker was replaced: a simple constraint compiles and is followed.
    ok = SamplingParams(max_tokens=3, structured_outputs=StructuredOutputsParams(regex="[ab]{3}"))
    text = llm.generate(["Hi"], ok, use_tqdm=False)[0].outputs[0].text
    assert len(text) == 3 and set(text) <= {"a", "b"}, text
    llm.close()


def test_grammar_settings_are_validated(make_llm):
    with pytest.raises(ValueError, match="grammar_compile_timeout_s"):
        make_llm(grammar_compile_timeout_s=0)
