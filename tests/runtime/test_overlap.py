"""Overlap scheduling (async_scheduling): the loop that processes step N's tokens after launching
step N+1 gives exactly the serial loop's outputs, across features, under KV pressure (swap and
recompute), with aborts, and leaks no KV block; the extra token a finished sequence may get is
never shown."""

from __future__ import annotations

import pytest

from engine import SamplingParams
from engine.core.params import StructuredOutputsParams
from tests.support.engine import assert_engine_clean, run_checked
from tests.support.overlap import PROMPTS, _summary


def _pair(make_llm, **settings):
    return make_llm(async_scheduling=False, **settings), make_llm(async_scheduling=True, **settings)


def _count_overlapped(llm, fn):
    """Run fn(llm) counting the steps after which a launched step was left in flight."""
    engine = llm.engine
    step = engine.step
    seen = {"overlapped": 0}

    def counted():
        out = step()
        seen["overlapped"] += engine.core._inflight is not None
        return out

    engine.step = counted
    try:
        return fn(llm), seen["overlapped"]
    finally:
        engine.step = step


def _workload(llm):
    """Greedy with several lengths, EOS allowed, stop ids and strings, seeded sampling, n > 1,
    logprobs, min_tokens, penalties (a serial step), prefix sharing."""
    ref = llm.generate(PROMPTS[1:3], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True), use_tqdm=False)
    stop = ref[0].outputs[0].text[6:9]
    params = [
        SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=20, stop=[stop]),
        SamplingParams(temperature=0, max_tokens=9, stop_token_ids=[ref[1].outputs[0].token_ids[3]]),
        SamplingParams(temperature=0.9, top_p=0.9, seed=11, max_tokens=14, ignore_eos=True),
        SamplingParams(n=2, temperature=1.0, seed=5, max_tokens=7, ignore_eos=True, logprobs=2),
        SamplingParams(temperature=0, max_tokens=15, min_tokens=10),
        SamplingParams(temperature=0, max_tokens=10, frequency_penalty=0.5, presence_penalty=0.3),
        SamplingParams(temperature=0, max_tokens=1, logprobs=3),
    ]
    return _summary(llm.generate(PROMPTS, params, use_tqdm=False))


def test_overlap_equals_serial_across_features(make_llm):
    serial, overlap = _pair(make_llm, max_num_seqs=8)
    want = _workload(serial)
    got, overlapped = _count_overlapped(overlap, _workload)
    assert got == want
    assert overlapped > 5, "the overlapped loop never left a step in flight"
    # the stop string cut a sequence short and the n=2 request forked: the workload means something
    assert want[1][0][3] == "stop" and want[2][0][3] == "stop" and len(want[4]) == 2


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_overlap_equals_serial_under_kv_pressure(make_llm, mode):
    settings = dict(num_gpu_blocks=14, max_model_len=128, max_num_seqs=8, preemption_mode=mode, swap_space_gb=0.01)
    serial, overlap = _pair(make_llm, **settings)
    params = [
        SamplingParams(temperature=0, max_tokens=40, ignore_eos=True),
        SamplingParams(temperature=0.8, seed=3, max_tokens=40, ignore_eos=True),
    ] * 4

    def run(llm):
        return _summary(llm.generate(PROMPTS, params, use_tqdm=False))

    want = run(serial)
    got, overlapped = _count_overlapped(overlap, run)
    assert got == want
    assert overlapped > 5
    sched = overlap.engine.core.scheduler
    assert sched.num_preemptions > 0 and sched.preemptions_by_mode[mode] > 0, "no preemption: no pressure"
    assert_engine_clean(overlap.engine)


def test_overlap_with_aborts_and_prefix_caching(make_llm):
    def run(llm):
        engine = llm.engine
        shared = list(range(10, 58))  # 3 full blocks shared by every request
        params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
        engine.add_request(shared + [100], params, "r0")
        done = {}
        for step in range(30):
            if step == 2:  # r0's prompt blocks are cached by now: the others hit them
                for i in range(1, 6):
                    engine.add_request(shared + [100 + i], params, f"r{i}")
            if step == 5:
                engine.abort_request("r2")
            if step == 7:
                engine.abort_request("r4")
            for out in engine.step():
                if out.finished:
                    done[out.request_id] = out
            engine.core.check_integrity()
        done.update(run_checked(engine))
        assert engine.core.pool.counters.prefix_hits >= 5 * 48
        return {rid: _summary([o]) for rid, o in done.items() if rid not in ("r2", "r4")}

    serial, overlap = _pair(make_llm, max_num_seqs=8)
    assert run(overlap) == run(serial)
    assert_engine_clean(overlap.engine)


def test_overlap_with_spec_decode_and_structured_outputs(make_llm):
    settings = dict(max_num_seqs=4, speculative_method="ngram", num_speculative_tokens=3)
    serial, overlap = _pair(make_llm, **settings)
    params = [
        SamplingParams(temperature=0, max_tokens=16, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=12, structured_outputs=StructuredOutputsParams(regex="[ab]{3,8}")),
    ]

    def run(llm):
        return _summary(llm.generate([[44] * 12 + [45, 44, 45], PROMPTS[2]], params, use_tqdm=False))

    assert run(overlap) == run(serial)


def test_overlap_with_structured_outputs_and_beam_search(make_llm):
    from engine.runtime.beam_search import BeamSearchParams

    serial, overlap = _pair(make_llm, max_num_seqs=8)
    constrained = SamplingParams(
        temperature=0, max_tokens=12, structured_outputs=StructuredOutputsParams(regex="(ab|c)+d")
    )
    free = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)

    def run(llm):
        outs = _summary(llm.generate([PROMPTS[0], PROMPTS[1], PROMPTS[3]], [constrained, free, free], use_tqdm=False))
        beams = llm.beam_search([PROMPTS[2]], BeamSearchParams(beam_width=2, max_tokens=5))
        return outs, [[tuple(c.token_ids) for c in b.outputs] for b in beams]

    assert run(overlap) == run(serial)
