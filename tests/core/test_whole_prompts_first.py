"""whole_prompts_first (engine/core/sched/step_budget.py whole_prompts_reserve): waiting prompts that
fit whole go before a running long prompt's next piece, which keeps at least half of every step.

Checked on random streams of short and long prompts at two priorities (blocks ample, so that what
the scheduler decides is the rule's, not a shortage's): every step, (1) the prompts that were mid-
prefill at its start get at least min(what they have left, the budget less the step's decodes and
less half the budget), and (2) the head of the waiting queue (at least as urgent as every running
prompt, within the free seats, their prompts adding up to at most half the budget) starts whole in
that step; at the end every request is done and every block free."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from engine.core.request import Sequence
from tests.support.scheduler import add, arrival_steps, make_scheduler, run_step


def _first_token_steps(whole_first: bool) -> tuple[int, int]:
    """Steps until both short prompts have a token, and until the long one has."""
    sched = make_scheduler(
        num_blocks=256, block_size=4, max_num_seqs=4, budget=64, max_model_len=256, whole_prompts_first=whole_first
    )
    long = add(sched, "long", 200, max_tokens=2)
    shorts = [add(sched, f"short{i}", 8, max_tokens=2, base=i + 1) for i in range(2)]
    steps, short_at, long_at = 0, 0, 0
    while sched.has_unfinished():
        run_step(sched)
        steps += 1
        if not short_at and all(r.seqs[0].num_output_tokens for r in shorts):
            short_at = steps
        if not long_at and long.seqs[0].num_output_tokens:
            long_at = steps
    assert sched.pool.is_fully_free()
    return short_at, long_at


def test_short_prompts_start_beside_a_running_long_one():
    # FCFS: the long prompt (admitted first, alone) takes every step's budget until its prefill is done.
    assert _first_token_steps(False) == (4, 4)
    # The rule: from step 2 the two short prompts (16 tokens, within half of 64) go first, whole;
    # the long prompt's pieces are 64, 48, 64, 24: its first token comes no later.
    assert _first_token_steps(True) == (2, 4)


def _head_that_fits(sched, budget: int) -> list[Sequence]:
    """The waiting prompts the rule must start this step (see the module docstring)."""
    prompts = [s for s in sched.running if len(s.token_ids) - s.num_computed_tokens > 1]
    if not prompts:
        return []
    urgency = min(s.request.priority for s in prompts)
    seats = sched.config.max_num_seqs - sched._seats_used()
    held, head = 0, []
    for s in sched.waiting:
        need = s.num_tokens - s.num_computed_tokens
        if s.request.priority > urgency or held + need > budget // 2 or seats < 1:
            break
        held += need
        seats -= 1
        head.append(s)
    return head


@given(
    arrivals=st.lists(
        st.tuples(st.integers(0, 3), st.integers(1, 100), st.integers(1, 6), st.integers(0, 1)),
        min_size=1,
        max_size=24,
    ),
    budget=st.integers(8, 48),
    max_num_seqs=st.integers(2, 6),
)
@settings(max_examples=120, deadline=None)
def test_running_prompts_keep_half_and_waiting_heads_start_whole(arrivals, budget, max_num_seqs):
    sched = make_scheduler(
        num_blocks=2048,
        block_size=4,
        max_num_seqs=max_num_seqs,
        budget=budget,
        max_model_len=128,
        prefix=False,  # (a prefix hit would start a prompt with fewer tokens than it has)
        whole_prompts_first=True,
    )
    requests: list = []
    for _ in arrival_steps(sched, arrivals, requests, steps=2000):
        mid = {s.seq_id: len(s.token_ids) - s.num_computed_tokens for s in sched.running}
        mid = {k: v for k, v in mid.items() if v > 1}
        head = _head_that_fits(sched, budget)
        # (a preempted sequence comes back as its prompt and its output so far, recomputed whole)
        whole = {s.seq_id: s.num_tokens - s.num_computed_tokens for s in head}
        out = run_step(sched)
        got = {s.seq_id: s.num_tokens for s in out.seqs}
        mid = {k: v for k, v in mid.items() if k not in out.preempted}  # (for a more urgent prompt's seat)
        piece = sum(got.get(k, 0) for k in mid)
        assert piece >= min(sum(mid.values()), budget - out.num_decode_tokens - budget // 2)
        for s in head:
            assert got.get(s.seq_id) == whole[s.seq_id], "a waiting prompt that fits did not start whole"
    assert not sched.has_unfinished() and all(r.is_finished for r in requests)
    assert sched.pool.is_fully_free()


@given(
    arrivals=st.lists(
        st.tuples(st.integers(0, 3), st.integers(1, 60), st.integers(1, 6), st.integers(0, 1)),
        min_size=1,
        max_size=20,
    ),
    budget=st.integers(8, 48),
    max_num_seqs=st.integers(2, 6),
)
@settings(max_examples=80, deadline=None)
def test_the_rule_changes_nothing_until_a_prompt_is_chunked(arrivals, budget, max_num_seqs):
    """Two schedulers, with and without the rule, in lockstep: the same steps until one starts with a
    running prompt mid-prefill beside a waiting one. Prompts of at most budget / max_num_seqs tokens
    are never chunked (short prompts at concurrency, as c16 64/64 serves): nothing changes at all."""
    scheds = [
        make_scheduler(
            num_blocks=2048,
            block_size=4,
            max_num_seqs=max_num_seqs,
            budget=budget,
            max_model_len=128,
            whole_prompts_first=whole,
        )
        for whole in (False, True)
    ]
    pending = list(arrivals)
    count = 0
    diverged = False
    for _ in range(2000):
        while pending and pending[0][0] == 0:
            _, plen, max_tokens, priority = pending.pop(0)
            for sched in scheds:
                add(sched, f"r{count}", plen, max_tokens, priority, base=count)
            count += 1
        if pending:
            pending[0] = (pending[0][0] - 1, *pending[0][1:])
        if not any(sched.has_unfinished() for sched in scheds) and not pending:
            break  # (both: once the rule moved a step, one may finish a step before the other)
        chunked = any(len(s.token_ids) - s.num_computed_tokens > 1 for s in scheds[1].running)
        diverged = diverged or (chunked and bool(scheds[1].waiting))
        outs = [run_step(sched) for sched in scheds]
        if not diverged:
            steps = [[(s.seq_id, s.start_pos, s.num_tokens) for s in out.seqs] for out in outs]
            assert steps[0] == steps[1]
    assert all(not sched.has_unfinished() and sched.pool.is_fully_free() for sched in scheds)
    short = max(plen for _, plen, _, _ in arrivals) <= budget // max_num_seqs
    if short and not scheds[0].num_preemptions:  # (a recomputed sequence is its prompt and its output)
        assert not diverged
