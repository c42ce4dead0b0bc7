"""Admission's rules (the package engine/core/admission_rules/): the table is the only place that refuses.

- Every `InvalidRequestError(...)` made in engine/ is made in the table, but for a short
  allow-list (scanned on the source, so a rule written anywhere else fails here).
- Every rule of the table has a case here: a request it refuses, refused by that rule (the
  error is made in the rule's function: recorded as it is made) with its message and param,
  offline (LLM), through the server (the FastAPI app in-process, a 400) and by beam search,
  wherever the request can be made there. Rules on the engine's state that need an odd engine
  (an embedding-only model, a tiny KV pool) run on Admission with a stub vocabulary, tokenizer
  and grammar compiler.
"""

from __future__ import annotations

import ast
import asyncio
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable

import pytest

from engine.core.admission_rules import InvalidRequestError
from engine.core.params import LoRARequest, PoolingParams, SamplingParams, StructuredOutputsParams
from engine.runtime.admission import Admission
from engine.runtime.beam_search import BeamSearchParams
from tests.support.engine import served

ENGINE = Path(__file__).resolve().parents[2] / "engine"
TABLE = ENGINE / "core" / "admission_rules"  # (a package: every module of it is the table)

# (file under engine/, function or "*": all of the file) -> why it may make an InvalidRequestError
# outside the table.
ALLOWED = {
    ("entrypoints/openai/request_body.py", "read_body"): "a malformed body: too many JSON values to parse",
    ("entrypoints/openai/request_body.py", "parse_body"): "a malformed body: a lone UTF-16 surrogate",
    ("entrypoints/openai/request_body.py", "bounded"): "a malformed body: not UTF-8, nested too deeply",
    ("lora/adapters.py", "load_lora"): "the adapter-management API (load), not a request to admit",
    ("lora/adapters.py", "unload_lora"): "the adapter-management API (unload), not a request to admit",
    ("lora/validate.py", "*"): "the adapter-management API: an adapter directory or name to load",
    ("runtime/async_engine.py", "_drain_inbox"): "a request that failed on the step thread, reported as refused",
}


def _refusals(tree: ast.AST) -> list[tuple[str, int]]:
    """(enclosing function, line) of every call of InvalidRequestError (a subclass named *Error
    deriving from it would be listed by the class scan below)."""
    found = []

    def walk(node: ast.AST, fn: str) -> None:
        for child in ast.iter_child_nodes(node):
            name = child.name if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)) else fn
            if isinstance(child, ast.Call):
                f = child.func
                callee = f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else None
                if callee in _REFUSAL_CLASSES:
                    found.append((name, child.lineno))
            walk(child, name)

    walk(tree, "<module>")
    return found


def _subclasses() -> set[str]:
    """InvalidRequestError and every class of engine/ deriving from it (by name, transitively)."""
    bases: dict[str, set[str]] = {}
    for path in ENGINE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                bases[node.name] = {b.id if isinstance(b, ast.Name) else getattr(b, "attr", "") for b in node.bases}
    names = {"InvalidRequestError"}
    while grown := {c for c, bs in bases.items() if bs & names} - names:
        names |= grown
    return names


_REFUSAL_CLASSES = _subclasses()


def test_only_the_table_refuses():
    sites, used = [], set()
    for path in sorted(ENGINE.rglob("*.py")):
        if path.parent == TABLE:
            continue
        rel = path.relative_to(ENGINE).as_posix()
        for fn, line in _refusals(ast.parse(path.read_text())):
            allowed = next((key for key in ((rel, fn), (rel, "*")) if key in ALLOWED), None)
            if allowed is not None:
                used.add(allowed)
            else:
                sites.append(f"engine/{rel}:{line} ({fn})")
    assert not sites, "refusals written outside engine/core/admission_rules/: " + ", ".join(sites)
    assert used == set(ALLOWED), f"allow-list entries with no refusal left: {set(ALLOWED) - used}"


def test_the_scan_finds_a_refusal_and_its_subclasses():
    tree = ast.parse("class E(InvalidRequestError): pass\ndef f():\n    raise errors.InvalidRequestError('x')\n")
    assert _refusals(tree) == [("f", 3)]
    assert {"InvalidRequestError"} <= _REFUSAL_CLASSES


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


# ---- the cases ----
CHAT = "/v1/chat/completions"
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}


def _chat(**fields) -> tuple[str, dict]:
    return CHAT, {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2} | fields


def _completion(**fields) -> tuple[str, dict]:
    return "/v1/completions", {"prompt": "hi", "max_tokens": 2} | fields


@dataclass
class Case:
    rule: str
    match: str  # (a regex)
    param: str | None
    offline: Callable[[Any, Any], Any] | None = None  # (llm, ctx)
    http: Callable[[Any], tuple[str, dict]] | None = None  # (ctx) -> (path, body)
    beam: Callable[[Any, Any], Any] | None = None  # (llm, ctx)
    unit: Callable[[Admission], Any] | None = None  # on the stub Admission

    def __str__(self) -> str:
        return self.rule


def _gen(prompt, **params):
    return lambda llm, ctx: llm.generate([prompt], SamplingParams(**params), use_tqdm=False)


def _beam(prompt, width=2, max_tokens=2):
    return lambda llm, ctx: llm.beam_search([prompt], BeamSearchParams(width, max_tokens))


def _same_id_twice(llm) -> None:
    llm.engine.add_request([1, 2], SamplingParams(max_tokens=1), "dup")
    try:
        llm.engine.add_request([1, 2], SamplingParams(max_tokens=1), "dup")
    finally:
        llm.engine.abort_request("dup")


_SLOTS_FULL = "all max_loras=1 LoRA slots hold adapters (x); unload one first"  # (LoRAManager.why_not's)
LONG = list(range(1, 65))  # max_model_len tokens: no room left
CASES = [
    # SamplingParams (as made: offline, by the server from a body, by beam search from its params)
    Case(
        "sampling",
        "n must be at least 1, got 0",
        "n",
        _gen("hi", n=0),
        lambda c: _completion(n=0),
        lambda llm, ctx: BeamSearchParams(0, 3),
    ),
    Case(
        "sampling",
        "max_tokens must be at least 1, got 0",
        "max_tokens",
        _gen("hi", max_tokens=0),
        lambda c: _chat(max_tokens=0),
        lambda llm, ctx: BeamSearchParams(2, 0),
    ),
    Case(
        "sampling",
        "at most 1024 stop strings, got 1025",
        "stop",
        _gen("hi", stop=[f"s{i}" for i in range(1025)]),
        None,  # (the server refuses it before validating the strings: stop_string_count)
    ),
    Case(
        "sampling",
        "the stop strings hold 70000 characters, more than 65536",
        "stop",
        _gen("hi", stop=["x" * 35000, "y" * 35000]),
        None,
    ),
    Case(
        "stop_string_count",
        "at most 1024 stop strings, got 1025",
        "stop",
        None,
        lambda c: _completion(stop=[f"s{i}" for i in range(1025)]),
    ),
    Case(
        "stop_string_count",
        "the stop strings hold 70000 characters, more than 65536",
        "stop",
        None,
        lambda c: _chat(stop=["x" * 35000, "y" * 35000]),
    ),
    Case(
        "logit_bias_map",
        "logit_bias must map token ids to numbers",
        "logit_bias",
        _gen("hi", logit_bias={"x": 1}),
        lambda c: _completion(logit_bias={"x": 1}),
    ),
    Case(
        "constraint_from_fields",
        "structured_outputs: .*bogus",
        "structured_outputs",
        _gen("hi", structured_outputs={"bogus": 1}),
        lambda c: _completion(structured_outputs={"bogus": 1}),
    ),
    Case(
        "stop_tokens_leave_a_choice",
        "every allowed token is a stop token",
        "allowed_token_ids",
        lambda llm, c: _gen("hi", allowed_token_ids=[c.eos], min_tokens=1)(llm, c),
        lambda c: _completion(allowed_token_ids=[c.eos], min_tokens=1),
    ),
    # constraints
    Case(
        "schema_from_text",
        "the JSON schema is not valid JSON",
        "structured_outputs",
        lambda llm, c: StructuredOutputsParams(json="{bad"),
        lambda c: _completion(structured_outputs={"json": "{bad"}),
    ),
    Case(
        "constraint_kind",
        r"give exactly one of .* \(got none\)",
        "structured_outputs",
        lambda llm, c: StructuredOutputsParams(),
        lambda c: _completion(structured_outputs={}),
    ),
    Case(
        "constraint",
        "choice must be a non-empty list",
        "structured_outputs",
        lambda llm, c: StructuredOutputsParams(choice=[]),
        lambda c: _completion(structured_outputs={"choice": []}),
    ),
    Case(
        "constraint_does_not_compile",
        "the regex constraint does not compile",
        "structured_outputs",
        _gen("hi", structured_outputs=StructuredOutputsParams(regex="(")),
        lambda c: _completion(structured_outputs={"regex": "("}),
    ),
    Case(
        "constraint_in_field",
        "^guided_regex: structured output: the regex constraint does not compile",
        "guided_regex",
        http=lambda c: _completion(guided_regex="("),
    ),
    # embeddings and the task
    Case(
        "pooling",
        "pooling_type must be one of last, mean",
        "pooling_type",
        lambda llm, c: llm.embed("hi", PoolingParams("max"), use_tqdm=False),
    ),
    Case(
        "dimensions_fit",
        "exceeds the model's hidden size",
        "dimensions",
        lambda llm, c: llm.embed("hi", PoolingParams(dimensions=10**6), use_tqdm=False),
        lambda c: ("/v1/embeddings", {"input": "hi", "dimensions": 10**6}),
    ),
    Case(
        "model_generates",
        "no language-model head",
        "model",
        unit=lambda a: _with(a, model_config=SimpleNamespace(vocab_size=100, generates=False, hidden_size=16)).admit(
            [1], SamplingParams()
        ),
    ),
    # the engine's limits
    Case(
        "logprobs_limit",
        "logprobs must be at most 5",
        "logprobs",
        _gen("hi", logprobs=6),
        lambda c: _completion(logprobs=6),
    ),
    Case(
        "logprobs_limit", "logprobs must be at most 5", "logprobs", None, lambda c: _chat(logprobs=True, top_logprobs=6)
    ),
    Case(
        "logprobs_limit",
        "prompt_logprobs must be at most 5",
        "prompt_logprobs",
        _gen("hi", prompt_logprobs=6),
        lambda c: _completion(prompt_logprobs=6),
    ),
    Case(
        "samples_limit",
        "exceeds this server's max_num_seqs",
        "n",
        _gen("hi", n=5, temperature=1.0),
        lambda c: _completion(n=5),
    ),
    Case(
        "token_ids",
        r"prompt: token ids must be integers in \[0, ",
        "prompt",
        _gen([5, 10**6]),
        lambda c: _completion(prompt=[5, 10**6]),
        _beam([5, 10**6]),
    ),
    Case(
        "token_ids",
        "stop_token_ids: token ids must be",
        "stop_token_ids",
        _gen("hi", stop_token_ids=[10**6]),
        lambda c: _completion(stop_token_ids=[10**6]),
    ),
    Case(
        "token_id_count",
        "token ids, more than the vocabulary",
        "allowed_token_ids",
        None,
        lambda c: _completion(allowed_token_ids=list(range(c.vocab + 1))),
    ),
    Case(
        "prompt_length",
        "prompt: the prompt is empty",
        "prompt",
        _gen([]),
        lambda c: _completion(prompt=[[]]),
        _beam([]),
    ),
    Case(
        "prompt_length",
        "prompt: the prompt has 64 token ids, which leaves no room",
        "prompt",
        _gen(LONG),
        lambda c: _completion(prompt=LONG),
        _beam(LONG),
    ),
    Case(
        "prompt_length",
        r"prompt \(60 tokens\) \+ max_tokens \(10\) = 70 exceeds max_model_len=64",
        "max_tokens",
        _gen(LONG[:60], max_tokens=10),
        lambda c: _completion(prompt=LONG[:60], max_tokens=10),
        _beam(LONG[:60], max_tokens=10),
    ),
    Case("text_length", "far longer than max_model_len", "prompt", None, lambda c: _completion(prompt="x" * 10**5)),
    Case(
        "message_count",
        "65 messages cannot fit",
        "messages",
        None,
        lambda c: _chat(messages=[{"role": "user", "content": "hi"}] * 65),
    ),
    Case("tool_count", "tools: 1025 tools, more than 1024", "tools", None, lambda c: _chat(tools=[TOOL] * 1025)),
    Case(
        "tool_definition_size",
        r"tools\[1\]: the definition holds more than 10000 JSON values",
        "tools[1]",
        None,
        lambda c: _chat(tools=[TOOL, {"type": "function", "function": {"name": "g", "enum": [0] * 10_000}}]),
    ),
    Case(
        "content_part_count",
        "65 content parts cannot fit",
        "messages",
        None,
        lambda c: _chat(messages=[{"role": "user", "content": [{"type": "text", "text": "a"}] * 65}]),
    ),
    Case(
        "logit_bias_count",
        "logit_bias: .* entries, more than the vocabulary",
        "logit_bias",
        None,
        lambda c: _completion(logit_bias={str(i): 1 for i in range(c.vocab + 1)}),
    ),
    Case(
        "prompt_count",
        "too many prompts or samples in one request",
        "prompt",
        None,
        lambda c: _completion(prompt=["hi"] * 65),
    ),
    Case(
        "prompt_count",
        r"too many prompts or samples in one request \(68; at most 64\)",
        "prompt",
        None,
        lambda c: _completion(prompt=["hi"] * 17, n=4),
    ),
    Case(
        "kv_capacity",
        "needs up to 4 KV blocks but the cache holds only 2",
        "max_tokens",
        unit=lambda a: _with(a, kv=SimpleNamespace(block_size=4, usable_blocks=lambda priority: 2)).admit(
            [1] * 8, SamplingParams(max_tokens=6)
        ),
    ),
    Case("request_id_free", "request id 'dup' is already in use", "request_id", lambda llm, c: _same_id_twice(llm)),
    Case(
        "lora_adapter",
        "enable_lora",
        "model",
        lambda llm, c: llm.generate("hi", use_tqdm=False, lora_request=LoRARequest("a", 1, "/nowhere")),
    ),
    Case(
        "lora_adapter",
        r"all max_loras=1 LoRA slots hold adapters \(x\); unload one first",
        "model",
        unit=lambda a: _with(a, lora=SimpleNamespace(why_not=lambda r: _SLOTS_FULL)).admit(
            [1], SamplingParams(max_tokens=1), lora_request=LoRARequest("y", 2, "/y")
        ),
    ),
    # the HTTP API's own fields
    Case("prompt_given", "the prompt must not be empty", "prompt", None, lambda c: _completion(prompt=[])),
    Case("prompt_given", "input must not be empty", "input", None, lambda c: ("/v1/embeddings", {"input": []})),
    Case("suffix_unsupported", "suffix is not supported", "suffix", None, lambda c: _completion(suffix="end")),
    Case("best_of", "best_of is not supported", "best_of", None, lambda c: _completion(best_of=3)),
    Case("zero_max_tokens", r"0 only with echo=true", "max_tokens", None, lambda c: _completion(max_tokens=0)),
    Case("top_logprobs", "top_logprobs requires logprobs=true", "top_logprobs", None, lambda c: _chat(top_logprobs=3)),
    Case(
        "top_logprobs",
        "top_logprobs must be non-negative",
        "top_logprobs",
        None,
        lambda c: _chat(logprobs=True, top_logprobs=-1),
    ),
    Case(
        "json_schema_given",
        "type json_schema needs json_schema.schema",
        "response_format",
        None,
        lambda c: _chat(response_format={"type": "json_schema", "json_schema": {"name": "x"}}),
    ),
    Case(
        "one_constraint_field",
        "give one structured-output constraint, not several",
        "guided_choice",
        None,
        lambda c: _completion(guided_regex="a", guided_choice=["a"]),
    ),
    Case(
        "forced_tool_alone",
        "constrains the output itself",
        "tool_choice",
        None,
        lambda c: _chat(tools=[TOOL], tool_choice="required", guided_regex="a"),
    ),
    Case("messages_given", "messages must not be empty", "messages", None, lambda c: _chat(messages=[])),
    Case(
        "message_role",
        "unknown role 'wizard'",
        "messages[0].role",
        None,
        lambda c: _chat(messages=[{"role": "wizard", "content": "hi"}]),
    ),
    Case(
        "text_part",
        "only text parts are supported",
        "messages[0].content",
        None,
        lambda c: _chat(messages=[{"role": "user", "content": [{"type": "image_url"}]}]),
    ),
    Case(
        "one_of_prompt_messages", "give exactly one of prompt or messages", "prompt", None, lambda c: ("/tokenize", {})
    ),
    Case(
        "beam_search_alone",
        "use_beam_search cannot stream",
        "stream",
        None,
        lambda c: _completion(use_beam_search=True, stream=True),
    ),
    Case(
        "continue_final_message",
        "needs add_generation_prompt=false",
        "continue_final_message",
        None,
        lambda c: _chat(continue_final_message=True),
    ),
    Case(
        "template_kwargs",
        "chat_template_kwargs may not set tools",
        "chat_template_kwargs",
        None,
        lambda c: _chat(chat_template_kwargs={"tools": 1}),
    ),
    Case(
        "tool_name_unused",
        "the function name 'f' is used twice",
        "tools",
        None,
        lambda c: _chat(tools=[TOOL, TOOL], tool_choice="required"),
    ),
    Case(
        "named_tool_given",
        "names the function 'g', which is not in tools",
        "tool_choice",
        None,
        lambda c: _chat(tools=[TOOL], tool_choice={"type": "function", "function": {"name": "g"}}),
    ),
    Case(
        "tool_choice_needs_tools",
        "tool_choice 'required' needs tools",
        "tool_choice",
        None,
        lambda c: _chat(tool_choice="required"),
    ),
    Case(
        "auto_tool_parser",
        "needs the server started with --enable-auto-tool-choice",
        "tool_choice",
        None,
        lambda c: _chat(tools=[TOOL]),
    ),
]
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
class _Grammars:
    def __init__(self) -> None:
        self.compiled: list[StructuredOutputsParams] = []

    def compile(self, spec: StructuredOutputsParams):
        self.compiled.append(spec)
        return ("compiled", spec.cache_key())


class _Tokenizer:
    def encode(self, text: str) -> list[int]:
        return [ord(c) % 100 for c in text]


def _admission(**state) -> Admission:
    config = SimpleNamespace(vocab_size=100, generates=True, hidden_size=16)
    return Admission(
        config,
        "m",
        max_model_len=16,
        max_num_seqs=4,
        max_logprobs=5,
        tokenizer=_Tokenizer(),
        grammars=_Grammars(),
        **state,
    )


def _with(a: Admission, **state) -> Admission:
    for name, value in state.items():
        setattr(a, name, value)
    return a


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
            _check_refusal(case, made, case.unit, _admission())


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
    a = _admission()
    assert a.admit(list(range(10)), SamplingParams(max_tokens=6)).params.max_tokens == 6  # fits exactly
    text = "abcdefghijklmnopqrst"  # 20 tokens: too long, unless truncated
    cut = a.admit(text, SamplingParams(max_tokens=4, truncate_prompt_tokens=8))
    assert cut.prompt_token_ids == _Tokenizer().encode(text)[-8:] and cut.prompt is None  # (the text no longer fits)
    embedding = _with(
        _admission(), model_config=SimpleNamespace(vocab_size=100, generates=False, hidden_size=16)
    ).admit([1, 2], pooling=PoolingParams())
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
