"""The latency target's step budget (engine/core/sched/step_budget.py): the online cost model, the
prefill allowance it derives, and the scheduler run against a simulated clock: once the model has
seen a few steps, every step that carries decodes stays within the target (give or take one KV
block of prefill), and every request still finishes."""

from __future__ import annotations

import pytest

from engine.core.sched.step_budget import MIN_PREFILL_SAMPLE, StepBudget, StepCostModel
from tests.core.test_scheduler import add, make_scheduler, run_step


def test_cost_model_learns_decode_and_prefill_costs():
    cost = StepCostModel()
    assert cost.decode_ms(4) == 0.0 and cost.ms_per_prefill_token is None
    cost.observe(0, 4, 20.0)  # 4 decodes: 20 ms
    cost.observe(100, 4, 70.0)  # the same plus 100 prefill tokens: 0.5 ms a token
    assert cost.decode_ms(4) == 20.0
    assert cost.ms_per_prefill_token == pytest.approx(0.5)
    assert cost.decode_ms(8) == pytest.approx(40.0)  # scaled up from the nearest smaller batch
    assert cost.decode_ms(2) == pytest.approx(20.0)  # nothing smaller: the nearest larger batch's
    cost.observe(MIN_PREFILL_SAMPLE - 1, 4, 500.0)  # too few prefill tokens to price one: ignored
    assert cost.ms_per_prefill_token == pytest.approx(0.5)
    cost.observe(100, 4, 120.0)  # 1.0 ms a token now: the running average moves a tenth of the way
    assert cost.ms_per_prefill_token == pytest.approx(0.55)


def test_allowance_from_the_target():
    budget = StepBudget(target_ms=50.0, max_tokens=512, block_size=16)
    assert budget.prefill_tokens(4) == 512 - 4  # no prefill measured yet: the token budget stands
    budget.observe(0, 4, 20.0)
    budget.observe(100, 4, 70.0)
    assert budget.prefill_tokens(4) == 48  # (50 - 20) / 0.5 = 60 tokens, whole blocks: 48
    assert budget.prefill_tokens(0) == 512  # no decodes to protect: everything
    budget.observe(0, 16, 60.0)  # the decodes alone overrun the target: still one block of progress
    assert budget.prefill_tokens(16) == 16
    with pytest.raises(ValueError):
        StepBudget(target_ms=0.0, max_tokens=512, block_size=16)


def _simulated_ms(out) -> float:
    """The fake clock: a step costs 2 ms + 1 ms a decode + 0.25 ms a prefill token."""
    return 2.0 + 1.0 * out.num_decode_tokens + 0.25 * out.num_prefill_tokens


@pytest.mark.parametrize("target", [None, 12.0])
def test_scheduler_keeps_mixed_steps_within_the_target(target):
    sched = make_scheduler(
        num_blocks=256, block_size=4, max_num_seqs=6, budget=256, max_model_len=256, target_itl_ms=target
    )
    reqs = [add(sched, f"short{i}", 6, max_tokens=30, base=i) for i in range(4)]
    steps = []
    for k in range(200):
        if k == 3:  # long prompts arrive while the short ones decode
            reqs += [add(sched, f"long{i}", 150, max_tokens=4, base=10 + i) for i in range(2)]
        if not sched.has_unfinished():
            break
        out = run_step(sched)
        ms = _simulated_ms(out)
        if sched.step_budget is not None:
            sched.step_budget.observe(out.num_prefill_tokens, out.num_decode_tokens, ms)
        steps.append((out.num_prefill_tokens, out.num_decode_tokens, ms))
    assert not sched.has_unfinished() and all(r.is_finished for r in reqs)
    assert sched.pool.is_fully_free()
    mixed = [ms for p, d, ms in steps if p and d]  # (the first step, all prefill, taught it a prefill token)
    assert mixed
    one_block = 0.25 * 4
    if target is None:
        assert max(mixed) > 12.0 + one_block  # without a target a 150-token chunk rides with the decodes
    else:
        assert max(mixed) <= target + one_block


def test_long_prefill_threshold_lets_short_prompts_start_beside_a_long_one():
    def first_tokens(threshold):
        sched = make_scheduler(
            num_blocks=256,
            block_size=4,
            max_num_seqs=4,
            budget=64,
            max_model_len=256,
            long_prefill_token_threshold=threshold,
        )
        add(sched, "long", 200, max_tokens=2)
        shorts = [add(sched, f"short{i}", 8, max_tokens=2, base=i + 1) for i in range(2)]
        steps = 0
        while not all(r.seqs[0].num_output_tokens for r in shorts):
            out = run_step(sched)
            steps += 1
            assert all(s.num_tokens <= (threshold or 64) for s in out.seqs)
        while sched.has_unfinished():
            run_step(sched)
        assert sched.pool.is_fully_free()
        return steps

    assert first_tokens(0) == 4  # FCFS without a cap: the long prompt takes the first 3 steps' budget
    assert first_tokens(32) == 1  # one 32-token piece of it per step: the short prompts start at once
