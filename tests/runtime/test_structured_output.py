"""Structured outputs: every finished output is in its constraint's language, greedy
constrained decoding equals transformers + the same grammar token for token, and bad
constraints are clear errors."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import jsonschema
import pytest
import torch

from engine import SamplingParams
from engine.core.admission_rules import InvalidRequestError
from engine.core.params import StructuredOutputsParams
from tests.support.engine import assert_engine_clean, run_checked

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "ok": {"type": "boolean"},
        "color": {"enum": ["red", "green", "blue"]},
        "tags": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 99}, "maxItems": 3},
    },
    "required": ["name", "ok", "color", "tags"],
    "additionalProperties": False,
}
PROMPTS = ["Give me JSON:", "the quick brown fox", "x", "Once upon a time there was a"]


def _constrained(spec: StructuredOutputsParams, **kw) -> SamplingParams:
    kw.setdefault("max_tokens", 120)
    return SamplingParams(structured_outputs=spec, **kw)


def _check_in_language(spec: StructuredOutputsParams, text: str) -> None:
    # strict=False: xgrammar's rule for strings with a maxLength lets raw control characters
    # (U+0000-U+001F) through, which strict JSON wants escaped (its plain string rule does not).
    if spec.json is not None:
        jsonschema.validate(json.loads(text, strict=False), spec.json)
    elif spec.json_object:
        assert isinstance(json.loads(text, strict=False), dict)
    elif spec.regex is not None:
        assert re.fullmatch(spec.regex, text), text
    elif spec.choice is not None:
        assert text in spec.choice
    else:
        assert re.fullmatch(r"\((\d+,)*\d+\)", text), text


SPECS = {
    "json": StructuredOutputsParams(json=SCHEMA),
    "json_compact": StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True),
    "json_object": StructuredOutputsParams(json_object=True, disable_any_whitespace=True),
    "regex": StructuredOutputsParams(regex=r"[a-c]{2,4}-\d{2}"),
    "choice": StructuredOutputsParams(choice=["yes", "no", 'it depends, "really"\n']),
    "grammar": StructuredOutputsParams(grammar='root ::= "(" num ("," num)* ")"\nnum ::= [0-9] | [1-9] [0-9]'),
}


@pytest.mark.parametrize("kind", sorted(SPECS))
def test_outputs_are_in_the_language(kind, make_llm):
    """Random sampling (n=3, several prompts): every output that stopped is in the language,
    and stopped is how nearly all of them end."""
    spec = SPECS[kind]
    llm = make_llm(max_num_seqs=8)
    # max_tokens 400: at 120 a JSON answer of the random model ran out of tokens in 7-12 of the 12
    # (by the seed); at 400 all 12 finish for every seed tried, so the count below checks the grammar
    # and not the sampler's luck.
    outs = llm.generate(PROMPTS, _constrained(spec, temperature=1.0, n=3, seed=7, max_tokens=400), use_tqdm=False)
    stopped = 0
    for out in outs:
        assert out.error is None
        for choice in out.outputs:
            if choice.finish_reason == "stop":
                stopped += 1
                _check_in_language(spec, choice.text)
    # JSON may run to max_tokens through long strings or whitespace; the finite ones never do.
    assert stopped >= (len(PROMPTS) * 3 if kind in ("regex", "choice") else len(PROMPTS))


def _hf_constrained_greedy(model_dir, tokenizer, eos_ids, prompt_ids: list[int], spec, max_tokens: int) -> list[int]:
    """transformers' forward + the same xgrammar constraint, greedy, one token at a time."""
    import xgrammar
    from transformers import AutoModelForCausalLM

    from engine.structured_output.grammars import unpack_bitmask

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    vocab = model.config.vocab_size
    info = xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab, stop_token_ids=list(eos_ids))
    matcher = xgrammar.GrammarMatcher(xgrammar.GrammarCompiler(info).compile_json_schema(json.dumps(spec.json)))
    mask = torch.zeros((1, -(-vocab // 32)), dtype=torch.int32)
    ids = list(prompt_ids)
    out: list[int] = []
    with torch.no_grad():
        while len(out) < max_tokens and not matcher.is_terminated():
            logits = model(torch.tensor([ids])).logits[0, -1]
            matcher.fill_next_token_bitmask(mask, 0)
            logits = logits.masked_fill(~unpack_bitmask(mask, vocab)[0], -float("inf"))
            token = int(logits.argmax())
            assert matcher.accept_token(token)
            out.append(token)
            ids.append(token)
    return out


def test_greedy_equals_transformers_with_the_same_grammar(make_llm, tiny_llama):
    """The engine on kiln's fast form of the tokenizer (as every warm start: the grammar compiler
    gets transformers' tokenizer behind it), the reference on transformers' own."""
    from transformers import AutoTokenizer

    from engine.models.loader.fast_tokenizer import KilnTokenizer
    from engine.models.loader.model_loader import load_tokenizer

    load_tokenizer(tiny_llama, Path(os.environ["KILN_CACHE_DIR"]))  # (the first start's: it writes the form)
    spec = SPECS["json"]
    llm = make_llm(max_num_seqs=4)
    engine = llm.engine
    assert isinstance(engine.tokenizer, KilnTokenizer)
    params = _constrained(spec, temperature=0.0, max_tokens=40)
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    reference = AutoTokenizer.from_pretrained(str(tiny_llama))
    for prompt, out in zip(PROMPTS, outs):
        want = _hf_constrained_greedy(str(tiny_llama), reference, engine.eos_token_ids, out.prompt_token_ids, spec, 40)
        assert out.outputs[0].token_ids == want, prompt


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_preemption_keeps_the_matchers_in_step(mode, make_llm):
    """A pool so small that constrained requests are preempted: outputs equal those of a roomy pool."""
    spec = SPECS["grammar"]
    prompts = [f"{p} {i} " * (1 + i % 3) for i, p in enumerate(PROMPTS * 3)]
    params = _constrained(spec, temperature=0.0, max_tokens=48, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in make_llm(max_num_seqs=12).generate(prompts, params, use_tqdm=False)]
    small = make_llm(
        max_num_seqs=12, num_gpu_blocks=24, block_size=8, preemption_mode=mode, swap_space_gb=0.01, max_model_len=128
    )
    outs = small.generate(prompts, params, use_tqdm=False)
    assert sum(c.num_preemptions for o in outs for c in o.outputs) > 0, "the pool never ran short"
    assert [o.outputs[0].token_ids for o in outs] == want
    for o in outs:
        _check_in_language(spec, o.outputs[0].text)


def test_ignore_eos_still_ends_a_complete_output(make_llm):
    """The grammar's stop token ends the output even with ignore_eos (there is nothing else to sample)."""
    spec = SPECS["choice"]
    out = (
        make_llm()
        .generate(["hi"], _constrained(spec, temperature=0.0, ignore_eos=True, max_tokens=50), use_tqdm=False)[0]
        .outputs[0]
    )
    assert out.finish_reason == "stop"
    assert out.text in spec.choice
    assert len(out.token_ids) < 50


def test_min_tokens_gives_way_to_a_grammar_that_can_only_stop(make_llm):
    spec = StructuredOutputsParams(choice=["a"])
    out = make_llm().generate(
        ["hi"], _constrained(spec, temperature=0.0, min_tokens=10, max_tokens=20), use_tqdm=False
    )[0]
    assert out.error is None
    assert out.outputs[0].text == "a" and out.outputs[0].finish_reason == "stop"


def test_constrained_and_free_requests_share_a_batch(make_llm):
    """A free request next to constrained ones samples exactly what it samples alone."""
    llm = make_llm(max_num_seqs=8)
    free = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    alone = llm.generate(["the quick brown fox"], free, use_tqdm=False)[0].outputs[0].token_ids
    engine = llm.engine
    engine.add_request("Give me JSON:", _constrained(SPECS["json"], temperature=0.0), "c1")
    engine.add_request("the quick brown fox", free, "free")
    engine.add_request("x", _constrained(SPECS["regex"], temperature=0.7, seed=3), "c2")
    done = run_checked(engine)
    assert done["free"].outputs[0].token_ids == alone
    _check_in_language(SPECS["regex"], done["c2"].outputs[0].text)
    assert_engine_clean(engine)


@pytest.mark.parametrize(
    "spec, message",
    [
        (dict(json={"type": "object", "properties": {"a": {"$ref": "#/nowhere"}}}), "does not compile"),
        (dict(regex="(unclosed"), "regex constraint does not compile"),
        (dict(grammar="root ::= undefined_rule"), "grammar constraint does not compile"),
    ],
)
def test_a_constraint_that_does_not_compile_is_a_clear_error(spec, message, make_llm):
    llm = make_llm()
    with pytest.raises(InvalidRequestError, match=message) as info:
        llm.engine.add_request("hi", SamplingParams(structured_outputs=StructuredOutputsParams(**spec)))
    assert info.value.param == "structured_outputs"
    assert "/project/" not in str(info.value)  # the native file:line prefix is dropped
    assert not llm.engine.core.has_unfinished_requests()


@pytest.mark.parametrize(
    "spec, message",
    [
        (dict(), "exactly one"),
        (dict(regex="a", choice=["a"]), "exactly one"),
        (dict(choice=[]), "non-empty list"),
        (dict(json="{not json"), "not valid JSON"),
        (dict(json=[1, 2]), "JSON schema object"),
    ],
)
def test_malformed_constraints_are_refused(spec, message):
    with pytest.raises(InvalidRequestError, match=message):
        SamplingParams(structured_outputs=StructuredOutputsParams(**spec))


def test_structured_outputs_given_as_a_dict():
    params = SamplingParams(structured_outputs={"choice": ["a", "b"]})
    assert params.structured_outputs.choice == ["a", "b"]
    with pytest.raises(InvalidRequestError, match="structured_outputs"):
        SamplingParams(structured_outputs={"colour": "red"})


def test_unpack_bitmask_reads_bit_t_mod_32_of_word_t_div_32():
    from engine.structured_output.grammars import bitmask_words, unpack_bitmask

    vocab = 100
    gen = torch.Generator().manual_seed(0)
    mask = torch.randint(-(2**31), 2**31 - 1, (3, bitmask_words(vocab)), dtype=torch.int32, generator=gen)
    mask[0, 0] = -(2**31)  # only bit 31 set: the sign bit
    got = unpack_bitmask(mask, vocab)
    assert got.shape == (3, vocab)
    for r in range(3):
        for t in range(vocab):
            assert bool(got[r, t]) == bool((int(mask[r, t // 32]) >> (t % 32)) & 1), (r, t)
    assert got[0, :32].tolist() == [False] * 31 + [True]


def test_constraint_starts_after_the_reasoning_block(make_llm):
    """With reasoning markers, tokens are free until the output closes the thinking block, and
    constrained from there; a prompt that already closed its block is constrained at once."""
    llm = make_llm()
    tok = llm.engine.tokenizer
    start = tuple(tok.encode("<think>", add_special_tokens=False))
    end = tuple(tok.encode("</think>", add_special_tokens=False))
    thought = tok.encode("hmm, well", add_special_tokens=False) + list(end)

    def think_first(out_ids, row):  # forces the thinking, then leaves the row alone
        if len(out_ids) < len(thought):
            row = torch.full_like(row, -1e9)
            row[thought[len(out_ids)]] = 0.0
        return row

    spec = StructuredOutputsParams(choice=["yes", "no way"], reasoning_markers=(start, end))
    out = llm.generate(
        ["Question?"],
        SamplingParams(temperature=0.0, max_tokens=40, logits_processors=[think_first], structured_outputs=spec),
        use_tqdm=False,
    )[0].outputs[0]
    answer = out.text.split("</think>", 1)[1]
    assert out.text.startswith("hmm, well</think>") and answer in ("yes", "no way") and out.finish_reason == "stop"
    closed = tok.encode("Question?<think></think>", add_special_tokens=False)
    out = llm.generate(
        [closed], SamplingParams(temperature=0.0, max_tokens=40, structured_outputs=spec), use_tqdm=False
    )[0].outputs[0]
    assert out.text in ("yes", "no way")


def test_compile_pool_zygote_runs_one_thread(tiny_llama):
    """The compile pool's zygote forks its workers, so it must run one thread (a lock held by
    another thread at the fork would stay held in the child): its environment, made by
    engine/config, limits OpenBLAS and OpenMP to one thread before they load, and the pool works."""
    import transformers

    from engine.structured_output.compile_pool import ZYGOTE_THREAD_LIMITS
    from engine.structured_output.grammars import StructuredOutputCompiler

    tok = transformers.AutoTokenizer.from_pretrained(tiny_llama)
    compiler = StructuredOutputCompiler(tok, len(tok), (tok.eos_token_id,))
    compiler.configure(timeout_s=60.0, workers=1)
    try:
        assert compiler.compile(StructuredOutputsParams(regex="ab[0-9]+")) is not None  # (through the pool)
        zygote = compiler._pool._zygote.proc
        environ = dict(
            item.split("=", 1)
            for item in open(f"/proc/{zygote.pid}/environ", "rb").read().decode(errors="replace").split("\0")
            if "=" in item
        )
        assert {k: environ.get(k) for k in ZYGOTE_THREAD_LIMITS} == ZYGOTE_THREAD_LIMITS
        threads = [
            line for line in open(f"/proc/{zygote.pid}/status").read().splitlines() if line.startswith("Threads:")
        ]
        assert threads == ["Threads:\t1"]
    finally:
        compiler.close()
