"""Speculative decoding (n-gram prompt lookup): outputs equal plain decoding token for token
(greedy, and seeded sampling with penalties and logprobs), stops inside an accepted run of
drafts land where plain decoding stops, and block accounting holds through preemption."""

from __future__ import annotations

import array

import pytest

from engine import SamplingParams
from engine.spec_decode.sched import NgramProposer, SpecDecodeConfig, find_draft
from tests.support.engine import run_checked
from tests.support.hf_reference import hf_greedy

SPEC = dict(speculative_method="ngram", num_speculative_tokens=4)


def _find(tokens, k, lo=1, hi=4):
    return find_draft(array.array("i", tokens).tobytes(), len(tokens), k, lo, hi)


def test_find_draft_takes_the_latest_longest_match():
    assert _find([1, 2, 3, 4, 1, 2, 3], 3) == [4, 1, 2]
    assert _find([9, 1, 2, 7, 5, 1, 2, 8, 2], 2) == [8, 2]  # only [2] matches: its latest earlier place
    assert _find([1, 2, 7, 5, 3, 2, 9, 1, 2], 2) == [7, 5]  # [1, 2] beats the later match of [2]
    assert _find([1, 2, 3], 2) == []
    assert _find([5, 5, 5, 5], 3) == [5]  # the suffix itself never counts as a match
    assert _find([7, 8, 9, 7, 8], 5, lo=2, hi=2) == [9, 7, 8]
    assert _find([7, 8, 9, 7, 8], 5, lo=3, hi=4) == []
    # byte patterns that straddle token boundaries are not matches (256 = 00 01 00 00 in bytes)
    assert _find([256, 1, 0, 0, 1], 2, lo=2) == []


@pytest.fixture(scope="module")
def periodic_model(tmp_path_factory):
    from engine.models.tiny_model import make_periodic_model

    return make_periodic_model(tmp_path_factory.mktemp("periodic") / "m")


PROMPTS = [[10 + i, 200 + 3 * i, 30 + 2 * i] for i in range(10)] + [[5, 6, 7, 8, 9, 10, 11, 12] * 3]


def _run(llm, prompts, params):
    return [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]


def test_greedy_equals_plain_decoding_and_transformers(periodic_model, make_llm):
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    plain = _run(make_llm(periodic_model, max_num_seqs=8), PROMPTS, params)
    spec_llm = make_llm(periodic_model, max_num_seqs=8, **SPEC)
    spec = _run(spec_llm, PROMPTS, params)
    assert [c.token_ids for c in spec] == [c.token_ids for c in plain]
    assert [c.token_ids for c in spec[:3]] == hf_greedy(str(periodic_model), PROMPTS[:3], 40)
    sched = spec_llm.engine.core.scheduler
    assert sched.num_accepted_tokens > 0.8 * sched.num_draft_tokens > 0  # the model repeats: drafts hold


def test_seeded_sampling_with_penalties_and_logprobs_is_unchanged(periodic_model, make_llm):
    """Hot sampling rejects many drafts; every sampled token, logprob and cumulative logprob
    equals plain decoding's (each position is a row with its own seed and history)."""
    params = SamplingParams(
        temperature=2.5,
        seed=11,
        max_tokens=48,
        ignore_eos=True,
        logprobs=2,
        repetition_penalty=1.2,
        frequency_penalty=0.3,
    )
    plain = _run(make_llm(periodic_model, max_num_seqs=8), PROMPTS, params)
    spec_llm = make_llm(periodic_model, max_num_seqs=8, **SPEC)
    spec = _run(spec_llm, PROMPTS, params)
    for a, b in zip(plain, spec):
        assert b.token_ids == a.token_ids
        assert b.cumulative_logprob == pytest.approx(a.cumulative_logprob, abs=1e-3)
        assert [sorted(e) for e in b.logprobs] == [sorted(e) for e in a.logprobs]
    sched = spec_llm.engine.core.scheduler
    assert 0 < sched.num_accepted_tokens < sched.num_draft_tokens, "want both accepted and rejected drafts"


def test_stops_inside_accepted_drafts(periodic_model, make_llm):
    """A stop token, a stop string or max_tokens reached in the middle of an accepted run ends
    the output exactly where plain decoding ends it."""
    cases = [
        SamplingParams(temperature=0, max_tokens=37, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=60, stop_token_ids=[13]),
        SamplingParams(temperature=0, max_tokens=60, stop_token_ids=[12], include_stop_str_in_output=True),
    ]
    plain_llm = make_llm(periodic_model, max_num_seqs=8)
    spec_llm = make_llm(periodic_model, max_num_seqs=8, **SPEC)
    # The prompts already hold a cycle: drafts from the first step, accepted 4 at a time.
    prompts = [[8, 9, 10, 11, 12, 13, 14, 15, 8, 9], [100, 8, 9, 10, 11, 12, 13, 14, 15, 8]]
    sched = spec_llm.engine.core.scheduler
    for params in cases:
        accepted = sched.num_accepted_tokens
        plain, spec = _run(plain_llm, prompts, params), _run(spec_llm, prompts, params)
        assert [(c.token_ids, c.finish_reason, c.stop_reason) for c in spec] == [
            (c.token_ids, c.finish_reason, c.stop_reason) for c in plain
        ]
        assert sched.num_accepted_tokens > accepted
        # One token from the prefill step, then steps of 5 (4 drafts + 1): a stop inside a step.
        assert all((len(c.token_ids) - 1) % 5 for c in spec), [len(c.token_ids) for c in spec]
    text = plain_llm.engine.tokenizer.decode([11, 12])
    stop = SamplingParams(temperature=0, max_tokens=60, stop=[text])
    assert [c.text for c in _run(spec_llm, prompts, stop)] == [c.text for c in _run(plain_llm, prompts, stop)]


def test_preemption_and_prefix_cache_with_drafts(periodic_model, make_llm):
    params = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
    want = [c.token_ids for c in _run(make_llm(periodic_model, max_num_seqs=12), PROMPTS, params)]
    small = make_llm(periodic_model, max_num_seqs=12, num_gpu_blocks=40, block_size=8, max_model_len=128, **SPEC)
    engine = small.engine
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(prompt, params, f"r{i}")
    got = {rid: out.outputs[0].token_ids for rid, out in run_checked(engine).items()}
    assert [got[f"r{i}"] for i in range(len(PROMPTS))] == want
    assert engine.core.scheduler.num_preemptions > 0 and engine.core.scheduler.num_accepted_tokens > 0
    again = _run(small, PROMPTS[:4], params)  # prefix-cache hits on blocks that drafts filled
    assert [c.token_ids for c in again] == want[:4]


def test_drafts_respect_max_model_len(periodic_model, make_llm):
    llm = make_llm(periodic_model, max_model_len=64, **SPEC)
    prompt = [5, 6, 7, 8, 9, 10, 11, 12] * 7  # 56 tokens: room for 8 more
    plain = make_llm(periodic_model, max_model_len=64)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    assert _run(llm, [prompt], params)[0].token_ids == _run(plain, [prompt], params)[0].token_ids


def test_back_off_when_drafts_keep_failing(tiny_llama, make_llm):
    """A random model never repeats its prompt: after a few rejected rounds drafts become rare."""
    llm = make_llm(tiny_llama, max_num_seqs=4, **SPEC)
    params = SamplingParams(temperature=0, max_tokens=100, ignore_eos=True)
    prompts = [[7, 8, 9, 10, 11] * 6, [40, 41, 42] * 10]
    plain = _run(make_llm(tiny_llama, max_num_seqs=4), prompts, params)
    assert [c.token_ids for c in _run(llm, prompts, params)] == [c.token_ids for c in plain]
    sched = llm.engine.core.scheduler
    attempts = sched.num_draft_tokens / SPEC["num_speculative_tokens"]
    assert attempts < 0.25 * 2 * 100, f"{attempts:.0f} verify steps for 200 tokens: no back-off"


def test_proposer_state_goes_with_the_sequence():
    import gc

    from engine.core.request import Request, Sequence

    proposer = NgramProposer(SpecDecodeConfig(3))
    request = Request("r", None, [1, 2, 1], SamplingParams())
    seq = Sequence(0, request, 0, [1, 2, 1, 2], 3)
    assert proposer.propose(seq, 10) == [1, 2]
    assert len(proposer._state) == 1
    del seq
    gc.collect()
    assert len(proposer._state) == 0


def test_settings_check_the_spec_combination():
    from engine.config.settings import EngineSettings

    with pytest.raises(ValueError, match="num_speculative_tokens"):
        EngineSettings(speculative_method="ngram")
    with pytest.raises(ValueError, match="prompt_lookup_min"):
        EngineSettings(speculative_method="ngram", num_speculative_tokens=2, prompt_lookup_min=5, prompt_lookup_max=3)


def test_metrics_count_drafts_and_generated_tokens(periodic_model, make_llm):
    import time

    from engine.entrypoints.openai.metrics import EngineMetrics
    from tests.support.metrics import _samples

    engine = make_llm(periodic_model, **SPEC).engine
    metrics = EngineMetrics("m", log_stats_interval=0)
    for i, prompt in enumerate(PROMPTS[:4]):
        engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True), f"r{i}")
    while engine.core.has_unfinished_requests():
        metrics.on_step(engine, engine.step(), time.monotonic())
    m = _samples(metrics)
    assert m[("kiln:spec_decode_num_draft_tokens_total", ())] == engine.core.scheduler.num_draft_tokens > 0
    assert m[("kiln:spec_decode_num_accepted_tokens_total", ())] == engine.core.scheduler.num_accepted_tokens > 0
    assert m[("kiln:generation_tokens_total", ())] == 4 * 30  # every kept token counted once
