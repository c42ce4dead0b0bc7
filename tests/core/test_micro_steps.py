"""cpu_micro_batch_tokens (engine/core/sched/step_budget.py MicroSteps): where prefill meets decodes,
steps of at most `tokens` rows; held steps run prompt pieces only (no decode, nothing sampled, each
piece one token short of its prompt's end), then the decodes and the prompts' last tokens run
together. Checked on a wave (as c16 serving makes them) and on random streams: held steps stay
within `tokens` rows and sample nothing, a decoding sequence never waits for more than one ordinary
step's budget of prefill (plus one micro-step), every request finishes and every block is free."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from tests.support.scheduler import add, arrival_steps, make_scheduler, run_step


def test_a_wave_of_prompts_runs_in_micro_steps_and_starts_together():
    sched = make_scheduler(
        num_blocks=512, block_size=4, max_num_seqs=8, budget=256, max_model_len=128, micro_batch_tokens=20
    )
    decoders = [add(sched, f"d{i}", 4, max_tokens=40, base=i) for i in range(2)]
    run_step(sched)  # (their prompts: 8 rows)
    wave = [add(sched, f"w{i}", 16, max_tokens=4, base=10 + i) for i in range(6)]
    held = 0
    while not wave[0].seqs[0].num_output_tokens:
        out = run_step(sched)
        if not sched.micro.held_prefill:  # the release step: decodes and every prompt's last token
            break
        held += 1
        assert out.num_decode_tokens == 0 and out.num_tokens <= 20
        assert not any(s.do_sample for s in out.seqs)
    assert held == 4  # 80 of the 6 prompts' 90 tokens before their last, in held steps of 20 rows
    assert all(r.seqs[0].num_output_tokens == 1 for r in wave)  # the whole wave's first tokens, together
    assert out.num_decode_tokens == 2 and out.num_tokens == 2 + 10 + 6  # the other 10 fit beside the decodes
    while sched.has_unfinished():
        run_step(sched)
    assert all(r.is_finished for r in wave + decoders) and sched.pool.is_fully_free()


@given(
    arrivals=st.lists(
        st.tuples(st.integers(0, 3), st.integers(1, 60), st.integers(1, 8)),
        min_size=1,
        max_size=20,
    ),
    budget=st.integers(16, 64),
    tokens=st.integers(8, 24),
    max_num_seqs=st.integers(2, 4),
)
@settings(max_examples=100, deadline=None)
def test_held_steps_stay_small_and_decodes_wait_at_most_one_step_of_prefill(arrivals, budget, tokens, max_num_seqs):
    sched = make_scheduler(
        num_blocks=1024,
        block_size=4,
        max_num_seqs=max_num_seqs,
        budget=budget,
        max_model_len=128,
        micro_batch_tokens=tokens,
    )
    requests: list = []
    waited: dict[int, int] = {}  # decoding seq id -> prefill tokens run since its last token
    for _ in arrival_steps(sched, arrivals, requests):
        decoding = {s.seq_id for s in sched.running if s.num_output_tokens and s.num_tokens - s.num_computed_tokens < 2}
        out = run_step(sched)
        if out.num_decode_tokens == 0 and any(s.num_tokens > 1 for s in out.seqs) and decoding:
            assert out.num_tokens <= tokens and not any(s.do_sample for s in out.seqs), "a held step"
        ran = {s.seq_id for s in out.seqs}
        for seq_id in decoding:
            waited[seq_id] = 0 if seq_id in ran else waited.get(seq_id, 0) + out.num_prefill_tokens
            assert waited[seq_id] <= budget + tokens, "a decode waited for more than a step's prefill"
    assert not sched.has_unfinished() and all(r.is_finished for r in requests)
    assert sched.pool.is_fully_free()
