"""The latency target's step budget (engine/core/sched/step_budget.py): the online cost model, the
prefill allowance it derives, and the scheduler run against a simulated clock: once the model has
seen a few steps, every step that carries decodes stays within the target (give or take one KV
block of prefill), and every request still finishes."""

from __future__ import annotations

import pytest

from engine.core.sched.step_budget import WINDOW, StepBudget, StepCostModel
from tests.support.scheduler import add, make_scheduler, run_step


def test_cost_model_learns_decode_and_prefill_costs():
    cost = StepCostModel()
    assert cost.decode_ms(4) == 0.0 and cost.ms_per_prefill_token is None
    truth = lambda p, d: 5.0 + 2.0 * d + 0.5 * p  # noqa: E731 - the fake clock
    # Every step mixed (as when requests trickle in): per-kind averages could not split these.
    for d, p in [(2, 32), (3, 48), (4, 32), (6, 64), (8, 48), (9, 16)]:
        cost.observe(p, d, truth(p, d))
    assert cost.ms_per_prefill_token == pytest.approx(0.5, rel=1e-3)
    assert cost.decode_ms(16) == pytest.approx(37.0, rel=1e-3)
    for _ in range(WINDOW + 5):  # a long run of decodes: the prefill rate is not forgotten
        cost.observe(0, 16, truth(0, 16) + 3.0)  # (slower now: the newest steps move the line)
    assert cost.ms_per_prefill_token == pytest.approx(0.5, rel=0.05)
    assert cost.decode_ms(16) == pytest.approx(40.0, rel=0.02)
    cost.observe(0, 0, 12.0)  # an empty step teaches nothing
    cost.observe(16, 0, 0.0)
    assert cost.decode_ms(16) == pytest.approx(40.0, rel=0.02)


def test_allowance_from_the_target():
    budget = StepBudget(target_ms=50.0, max_tokens=512, block_size=16)
    assert budget.prefill_tokens(4) == 512 - 4  # no prefill measured yet: the token budget stands
    for d, p in [(4, 0), (8, 0), (4, 100), (2, 60)]:
        budget.observe(p, d, 4.0 + 4.0 * d + 0.5 * p)
    assert budget.prefill_tokens(4) == 48  # (50 - 20) / 0.5 = 60 tokens, whole blocks: 48
    assert budget.prefill_tokens(0) == 512  # no decodes to protect: everything
    assert budget.prefill_tokens(16) == 16  # the decodes alone overrun the target: one block of progress
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
