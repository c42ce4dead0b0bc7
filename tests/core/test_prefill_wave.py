"""cpu_prefill_wave_tokens (engine/core/sched/step_budget.py PrefillWave): prompts in flight together
have their first tokens together, as llama.cpp's batch of micro-batches: where they need more rows
than a step leaves beside its decodes, their pieces stop one token short (nothing sampled for them)
until the rest fits one step. Steps keep their rows, decodes run in every step, and a prompt's first
token waits for at most the wave's rows of prefill."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from tests.support.scheduler import add, arrival_steps, make_scheduler, run_step


def wave_scheduler(wave: int, **kw):
    args = dict(num_blocks=1024, block_size=16, max_num_seqs=16, budget=512, max_model_len=256)
    return make_scheduler(**{**args, **kw}, prefill_wave_tokens=wave)


def test_a_1024_row_wave_runs_in_two_512_row_steps_and_starts_together():
    sched = wave_scheduler(2048)
    wave = [add(sched, f"w{i}", 64, max_tokens=4, base=i) for i in range(16)]
    first = run_step(sched)
    assert first.num_tokens == 512 and not any(s.do_sample for s in first.seqs)  # held: nothing sampled
    assert not any(r.seqs[0].num_output_tokens for r in wave)
    second = run_step(sched)
    assert second.num_tokens == 512 and sum(s.do_sample for s in second.seqs) == 16
    assert all(r.seqs[0].num_output_tokens == 1 for r in wave)  # every first token at once
    while sched.has_unfinished():
        run_step(sched)
    assert all(r.is_finished for r in wave) and sched.pool.is_fully_free()


def test_without_it_the_first_half_starts_a_step_earlier():
    sched = wave_scheduler(0)
    wave = [add(sched, f"w{i}", 64, max_tokens=4, base=i) for i in range(16)]
    run_step(sched)
    assert sum(r.seqs[0].num_output_tokens for r in wave) == 8  # (the gap the wave removes: these wait next step)


def test_decodes_run_in_every_step_while_the_wave_is_held():
    sched = wave_scheduler(2048)
    early = [add(sched, f"e{i}", 64, max_tokens=20, base=i) for i in range(4)]
    run_step(sched)  # 256 rows: fit one step, nothing held
    assert all(r.seqs[0].num_output_tokens == 1 for r in early)
    late = [add(sched, f"l{i}", 64, max_tokens=4, base=10 + i) for i in range(12)]
    held = run_step(sched)
    assert held.num_decode_tokens == 4 and held.num_tokens == 512
    assert sum(s.do_sample for s in held.seqs) == 4  # the decodes only
    release = run_step(sched)
    assert release.num_decode_tokens == 4 and release.num_tokens == 4 + 768 - 508
    assert all(r.seqs[0].num_output_tokens == 1 for r in late)
    assert all(r.seqs[0].num_output_tokens == 3 for r in early)


def test_a_prompt_beyond_the_wave_leaves_the_steps_as_they_were():
    held = wave_scheduler(200, budget=128)
    plain = wave_scheduler(0, budget=128)
    for sched in (held, plain):
        add(sched, "long", 600, max_tokens=2, base=0)
        for i in range(8):
            add(sched, f"s{i}", 40, max_tokens=2, base=1 + i)
    for _ in range(4):  # while the long prompt has more than the wave's 200 rows left, nothing is held
        a, b = run_step(held), run_step(plain)
        assert [(s.seq_id, s.num_tokens, s.do_sample) for s in a.seqs] == [
            (s.seq_id, s.num_tokens, s.do_sample) for s in b.seqs
        ]
    assert held.seqs_by_id[0].num_computed_tokens == 512


def test_the_cap_bounds_a_first_token_wait():
    sched = wave_scheduler(1024, budget=256)
    wave = [add(sched, f"w{i}", 100, max_tokens=2, base=i) for i in range(16)]
    steps = 0
    while not wave[0].seqs[0].num_output_tokens:
        run_step(sched)
        steps += 1
    # 10 prompts (1,000 rows) form the wave: 3 held steps of 256 and the release (232 rows and the
    # next prompts' first pieces); the other 6 start in a later wave
    assert steps == 4
    assert [r.seqs[0].num_output_tokens for r in wave] == [1] * 10 + [0] * 6


@given(
    arrivals=st.lists(st.tuples(st.integers(0, 3), st.integers(1, 60), st.integers(1, 8)), min_size=1, max_size=20),
    budget=st.integers(16, 64),
    wave=st.integers(0, 200),
    max_num_seqs=st.integers(2, 6),
    prefix=st.booleans(),
)
@settings(max_examples=100, deadline=None)
def test_decodes_never_wait_and_the_same_tokens_come_out(arrivals, budget, wave, max_num_seqs, prefix):
    """Random arrivals, the wave against none in lockstep: every sequence with one token to decode runs
    in every step (the budget takes them all), a held step samples no prompt, a prompt's first token
    waits for at most the wave's rows plus a step, every request ends with the tokens the plain
    scheduler gives it, and every block is free."""
    results = []
    for w in (wave, 0):
        sched = make_scheduler(
            num_blocks=1024, block_size=4, max_num_seqs=max_num_seqs, budget=budget, max_model_len=128,
            prefix=prefix, prefill_wave_tokens=w,
        )  # fmt: skip
        requests: list = []
        waited: dict[int, int] = {}  # prompt seq id -> prefill rows run since it was admitted
        for _ in arrival_steps(sched, arrivals, requests, base=lambda n: n % 7):
            decoding = {
                s.seq_id for s in sched.running if s.num_output_tokens and s.num_tokens - s.num_computed_tokens == 1
            }
            prompts = {s.seq_id for s in sched.running if not s.num_output_tokens}
            out = run_step(sched)
            assert decoding <= {s.seq_id for s in out.seqs}, "a decode was held"
            for seq_id in prompts:
                seq = sched.seqs_by_id.get(seq_id)
                if seq is not None and not seq.num_output_tokens:
                    waited[seq_id] = waited.get(seq_id, 0) + out.num_prefill_tokens
                    assert waited[seq_id] <= max(wave, budget) + 2 * budget + 60, "a first token waited too long"
        assert not sched.has_unfinished() and sched.pool.is_fully_free()
        results.append([r.seqs[0].token_ids for r in requests])
    assert results[0] == results[1]
