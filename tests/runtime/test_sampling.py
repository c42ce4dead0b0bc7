"""Sampling parameters, seeds, stops, logprobs and incremental detokenisation."""

from __future__ import annotations

import math

import pytest
import torch

from engine import SamplingParams
from engine.core.admission_rules import InvalidRequestError
from engine.worker.sample.sampler import Sampler, SampleRow
from tests.support.engine import assert_engine_clean


def rows_for(params_list, prompt=(1, 2, 3), outputs=()):
    return [SampleRow(p, list(prompt) + list(outputs), len(prompt), 0) for p in params_list]


def test_invalid_params_are_rejected_with_the_field_named():
    for kwargs, field in [
        (dict(temperature=-1), "temperature"),
        (dict(n=0), "n"),
        (dict(top_p=0), "top_p"),
        (dict(top_k=-5), "top_k"),
        (dict(max_tokens=0), "max_tokens"),
        (dict(min_tokens=5, max_tokens=2), "min_tokens"),
        (dict(logprobs=-1), "logprobs"),
        (dict(stop=[""]), "stop"),
        (dict(repetition_penalty=0), "repetition_penalty"),
    ]:
        with pytest.raises(InvalidRequestError) as info:
            SamplingParams(**kwargs)
        assert info.value.param == field


def test_top_k_and_top_p_and_min_p_restrict_the_support():
    sampler = Sampler(torch.device("cpu"), eos_token_ids=(0,), seed=0)
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]])).repeat(400, 1)
    for params, allowed in [
        (SamplingParams(top_k=2), {0, 1}),
        (SamplingParams(top_p=0.7), {0, 1}),
        (SamplingParams(top_p=0.5), {0}),
        (SamplingParams(min_p=0.5), {0, 1}),
        (SamplingParams(top_k=3, top_p=0.99), {0, 1, 2}),
    ]:
        out = sampler(logits, rows_for([params] * 400))
        assert set(out.token_ids) == allowed, params


def test_temperature_sampling_follows_the_distribution():
    sampler = Sampler(torch.device("cpu"), eos_token_ids=(9,), seed=1)
    probs = torch.tensor([0.6, 0.3, 0.1])
    logits = torch.log(probs)[None].repeat(6000, 1)
    out = sampler(logits, rows_for([SamplingParams(temperature=1.0)] * 6000))
    freq = torch.bincount(torch.tensor(out.token_ids), minlength=3).float() / 6000
    assert torch.allclose(freq, probs, atol=0.03), freq


def test_seeded_rows_do_not_depend_on_the_batch():
    sampler = Sampler(torch.device("cpu"), eos_token_ids=(0,), seed=0)
    torch.manual_seed(0)
    logits = torch.randn(5, 50)
    seeded = SamplingParams(temperature=1.0, seed=1234)
    alone = sampler(logits[2:3], rows_for([seeded])).token_ids[0]
    mixed = sampler(
        logits, rows_for([SamplingParams(temperature=0.7)] * 2 + [seeded] + [SamplingParams(temperature=0)] * 2)
    ).token_ids[2]
    assert alone == mixed


def test_penalties_push_down_seen_tokens():
    sampler = Sampler(torch.device("cpu"), eos_token_ids=(0,), seed=0)
    logits = torch.tensor([[1.0, 2.0, 1.9, 0.5]])
    greedy = SamplingParams(temperature=0)
    assert sampler(logits, rows_for([greedy], prompt=(3,), outputs=(1,))).token_ids == [1]
    for p in (
        SamplingParams(temperature=0, presence_penalty=0.5),
        SamplingParams(temperature=0, frequency_penalty=0.5),
        SamplingParams(temperature=0, repetition_penalty=1.2),
    ):
        assert sampler(logits, rows_for([p], prompt=(3,), outputs=(1,))).token_ids == [2], p
    # repetition penalty also covers prompt tokens
    p = SamplingParams(temperature=0, repetition_penalty=1.2)
    assert sampler(logits, rows_for([p], prompt=(1,))).token_ids == [2]


def test_min_tokens_blocks_eos_and_stop_ids():
    sampler = Sampler(torch.device("cpu"), eos_token_ids=(0,), seed=0)
    logits = torch.tensor([[5.0, 4.0, 1.0]])
    p = SamplingParams(temperature=0, min_tokens=2, stop_token_ids=[1])
    assert sampler(logits, rows_for([p], outputs=(2,))).token_ids == [2]
    assert sampler(logits, rows_for([p], outputs=(2, 2))).token_ids == [0]


def test_logit_bias_and_allowed_token_ids():
    sampler = Sampler(torch.device("cpu"), eos_token_ids=(0,), seed=0)
    logits = torch.tensor([[1.0, 3.0, 2.0, 0.0]]).repeat(3, 1)
    greedy = SamplingParams(temperature=0)
    rows = rows_for(
        [
            SamplingParams(temperature=0, logit_bias={"3": 5}),
            greedy,
            SamplingParams(temperature=0, logit_bias={1: -100}, logprobs=1),
        ]
    )
    out = sampler(logits, rows)
    assert out.token_ids == [3, 1, 2]  # the unbiased row in the same batch is untouched
    assert out.logprobs[2][0] == pytest.approx(torch.log_softmax(logits[0], 0)[2].item())  # logprobs: raw logits
    allowed = SamplingParams(temperature=1.0, allowed_token_ids=[0, 3], seed=3)
    picks = sampler(logits, rows_for([allowed] * 3)).token_ids
    assert set(picks) <= {0, 3}
    for kwargs, field in [
        (dict(logit_bias={1: 101}), "logit_bias"),
        (dict(logit_bias={"x": 1}), "logit_bias"),
        (dict(allowed_token_ids=[]), "allowed_token_ids"),
    ]:
        with pytest.raises(InvalidRequestError) as info:
            SamplingParams(**kwargs)
        assert info.value.param == field


def test_logprobs_are_normalised_and_include_the_chosen_token():
    sampler = Sampler(torch.device("cpu"), eos_token_ids=(0,), seed=0)
    logits = torch.tensor([[1.0, 3.0, 2.0, 0.0]])
    out = sampler(logits, rows_for([SamplingParams(temperature=0, logprobs=2)]))
    chosen, top = out.logprobs[0]
    assert out.token_ids == [1]
    assert list(top) == [1, 2]
    assert chosen == pytest.approx(math.log(math.exp(3) / sum(math.exp(x) for x in (1, 3, 2, 0))), rel=1e-5)


# ---- end to end through the engine ----


def test_same_seed_same_output_whatever_the_batch(make_llm):
    llm = make_llm()
    p = SamplingParams(temperature=0.9, top_p=0.95, seed=42, max_tokens=10, ignore_eos=True)
    alone = llm.generate(["A kiln is"], p, use_tqdm=False)[0].outputs[0].token_ids
    noise = SamplingParams(temperature=1.0, max_tokens=10, ignore_eos=True)
    batch = llm.generate(["Hello", "A kiln is", "The quick"], [noise, p, noise], use_tqdm=False)
    assert batch[1].outputs[0].token_ids == alone
    other = llm.generate(
        ["A kiln is"],
        SamplingParams(temperature=0.9, top_p=0.95, seed=43, max_tokens=10, ignore_eos=True),
        use_tqdm=False,
    )
    assert other[0].outputs[0].token_ids != alone


def test_stop_strings_and_stop_token_ids(make_llm):
    llm = make_llm()
    base = llm.generate(["Hello"], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True), use_tqdm=False)[
        0
    ].outputs[0]
    text = base.text
    stop = text[5:8]
    assert stop and stop in text
    out = llm.generate(
        ["Hello"], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, stop=[stop]), use_tqdm=False
    )[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == text[: text.index(stop)]
    kept = llm.generate(
        ["Hello"],
        SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, stop=[stop], include_stop_str_in_output=True),
        use_tqdm=False,
    )[0].outputs[0]
    assert kept.text == text[: text.index(stop) + len(stop)]
    stop_id = base.token_ids[3]
    out = llm.generate(
        ["Hello"],
        SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, stop_token_ids=[stop_id]),
        use_tqdm=False,
    )[0].outputs[0]
    assert out.token_ids == base.token_ids[: base.token_ids.index(stop_id) + 1]
    assert out.finish_reason == "stop" and out.stop_reason == stop_id


def test_eos_stops_unless_ignored(make_llm):
    llm = make_llm()
    tok, eos = llm.tokenizer, llm.engine.eos_token_ids[0]
    # min_tokens keeps EOS out of the first two tokens; the bias makes it the third.
    forced = dict(temperature=0, max_tokens=10, min_tokens=2, logit_bias={eos: 100.0})
    stopped = llm.generate(["Hello"], SamplingParams(**forced), use_tqdm=False)[0].outputs[0]
    assert stopped.finish_reason == "stop" and stopped.stop_reason is None
    assert len(stopped.token_ids) == 3 and stopped.token_ids[-1] == eos and eos not in stopped.token_ids[:2]
    assert stopped.text == tok.decode(stopped.token_ids[:2], skip_special_tokens=True)  # (EOS's text is not shown)
    kept = llm.generate(["Hello"], SamplingParams(ignore_eos=True, **forced), use_tqdm=False)[0].outputs[0]
    assert kept.finish_reason == "length" and len(kept.token_ids) == 10 and kept.token_ids[:3] == stopped.token_ids


def test_incremental_detokenisation_of_split_multibyte_characters(make_llm):
    llm = make_llm()
    tok = llm.tokenizer
    text = "日本語のテキスト 🙂🚀 café"
    ids = tok.encode(text, add_special_tokens=False)
    assert len(ids) > len(text.split()), "expected byte-level pieces"
    from engine.runtime.detokenizer import TextState, detokenize_step

    state = TextState(tok.encode("Hello", add_special_tokens=False))
    deltas = []
    for t in ids:
        state.ids.append(t)
        deltas.append(detokenize_step(tok, state))
    assert "".join(deltas) == text == state.text
    assert all("\ufffd" not in d for d in deltas)


def test_logprobs_and_n_through_generate(make_llm):
    llm = make_llm()
    out = llm.generate(
        ["Hello"],
        SamplingParams(n=3, temperature=0.8, seed=1, max_tokens=4, logprobs=3, ignore_eos=True),
        use_tqdm=False,
    )[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    for c in out.outputs:
        assert len(c.logprobs) == 4
        for tok, entry in zip(c.token_ids, c.logprobs):
            assert tok in entry and all(v <= 0 for v in entry.values())
        assert c.cumulative_logprob == pytest.approx(sum(e[t] for t, e in zip(c.token_ids, c.logprobs)))


def test_chat_uses_the_template(make_llm):
    llm = make_llm()
    out = llm.chat([{"role": "user", "content": "hi"}], SamplingParams(temperature=0, max_tokens=3), use_tqdm=False)[0]
    text = llm.tokenizer.decode(out.prompt_token_ids)
    assert text.startswith("<|im_start|>user\nhi<|im_end|>") and text.endswith("<|im_start|>assistant\n")


def test_output_kinds_delta_and_final_only_agree_with_cumulative(make_llm):
    """Deltas concatenated give the cumulative output (text held back for a stop string, n=2,
    logprobs); final_only gives one output per request; the per-step work of delta is the new part."""
    engine = make_llm().engine
    first = SamplingParams(temperature=0.8, seed=5, max_tokens=24, ignore_eos=True)  # = sample 0 below
    engine.add_request("Hello", first, request_id="probe")
    text = ""
    while engine.core.has_unfinished_requests():
        for o in engine.step():
            text = o.outputs[0].text
    stop = text[10:13]
    results: dict[str, dict] = {}
    for kind in ("cumulative", "delta", "final_only"):
        params = SamplingParams(
            temperature=0.8, seed=5, n=2, max_tokens=24, ignore_eos=True, logprobs=1, stop=[stop], output_kind=kind
        )
        engine.add_request("Hello", params, request_id=kind)
        got = {"count": 0, "choices": {}}
        while engine.core.has_unfinished_requests():
            for o in engine.step():
                got["count"] += 1
                for c in o.outputs:
                    acc = got["choices"].setdefault(c.index, {"text": "", "ids": [], "lps": [], "finish": None})
                    if kind == "delta":
                        acc["text"] += c.text
                        acc["ids"] += c.token_ids
                        acc["lps"] += c.logprobs
                        assert acc["finish"] is None, "a choice went on after its final delta"
                    else:
                        acc.update(text=c.text, ids=list(c.token_ids), lps=list(c.logprobs))
                    acc["finish"] = c.finish_reason
        results[kind] = got
    cumulative = results["cumulative"]["choices"]
    assert results["delta"]["choices"] == cumulative
    assert results["final_only"]["choices"] == cumulative and results["final_only"]["count"] == 1
    assert any(c["finish"] == "stop" for c in cumulative.values())
    assert results["delta"]["count"] <= results["cumulative"]["count"]
    assert_engine_clean(engine)


def test_vllm_offline_prompt_forms(make_llm):
    """vLLM's offline shapes: TextPrompt / TokensPrompt dicts (alone or in lists) give what plain
    text and token ids give; multi-modal input is a clear error; get_tokenizer() is the tokenizer."""
    llm = make_llm()
    assert llm.get_tokenizer() is llm.tokenizer
    ids = llm.get_tokenizer().encode("Hello there")
    params = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
    plain = llm.generate(["Hello there", ids], params, use_tqdm=False)
    dicts = llm.generate([{"prompt": "Hello there"}, {"prompt_token_ids": ids}], params, use_tqdm=False)
    one = llm.generate({"prompt_token_ids": ids}, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in dicts] == [o.outputs[0].token_ids for o in plain]
    assert one[0].outputs[0].token_ids == plain[1].outputs[0].token_ids
    with pytest.raises(ValueError, match="multi_modal_data"):
        llm.generate({"prompt": "hi", "multi_modal_data": {"image": None}}, params, use_tqdm=False)
    with pytest.raises(ValueError, match="exactly one of 'prompt'"):
        llm.generate({"prompt": "hi", "prompt_token_ids": ids}, params, use_tqdm=False)
