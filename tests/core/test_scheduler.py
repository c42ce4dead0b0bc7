"""Scheduler: unit and property tests with a fake model (no tensors)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.core.admission_rules import InvalidRequestError
from engine.core.kv.block_pool import BlockPool
from engine.core.outputs import FinishReason
from engine.core.params import SamplingParams
from engine.core.request import Request
from engine.core.sched.scheduler import Scheduler, SchedulerConfig
from tests.support.scheduler import add, make_scheduler, run_step


def test_decodes_first_then_chunked_prefill():
    sched = make_scheduler(budget=8)
    add(sched, "a", 3)
    run_step(sched)  # a's prefill
    add(sched, "b", 20)
    out = run_step(sched)
    assert out.seqs[0].num_tokens == 1 and out.seqs[0].start_pos == 3  # a decodes first
    assert out.seqs[1].num_tokens == 7  # b gets the rest of the budget
    assert out.num_decode_tokens == 1 and out.num_prefill_tokens == 7


def test_priority_then_fcfs_admission():
    sched = make_scheduler(max_num_seqs=1)
    add(sched, "late-low", 2, priority=5)
    add(sched, "high", 2, priority=0)
    add(sched, "high2", 2, priority=0)
    out = sched.schedule()
    assert [sched.requests["high"].seqs[0].seq_id] == [s.seq_id for s in out.seqs]


def test_what_can_never_fit_the_kv_pool_is_admissions_to_refuse():
    # (the rules are engine/core/admission_rules/'s, applied at admission: tests/core/test_admission.py)
    sched = make_scheduler(max_model_len=16, num_blocks=3)
    with pytest.raises(InvalidRequestError, match="KV blocks"):
        add(sched, "big", 8, max_tokens=4)  # 12 tokens > 2 usable blocks of 4
    add(sched, "fits", 4, max_tokens=4)
    with pytest.raises(RuntimeError, match="already in use"):  # (only a race gets here: the request fails)
        add(sched, "fits", 4, max_tokens=4)
    assert len(sched.requests) == 1


def test_the_update_ends_a_sequence_at_max_tokens_and_frees_it_at_once():
    sched = make_scheduler()
    req = add(sched, "a", 5, max_tokens=3)
    for _ in range(3):
        assert not req.is_finished
        run_step(sched)
    seq = req.seqs[0]
    assert seq.finish_reason is FinishReason.LENGTH and seq.num_output_tokens == 3
    assert "a" not in sched.requests and sched.pool.num_in_use == 0 and not sched.has_unfinished()


def test_abort_frees_blocks_at_once():
    sched = make_scheduler()
    add(sched, "a", 10)
    run_step(sched)
    assert sched.pool.num_in_use > 0
    sched.abort_request("a")
    assert sched.pool.num_in_use == 0
    sched.check_integrity()


def test_preemption_by_recompute_under_pressure():
    sched = make_scheduler(num_blocks=7, block_size=4, max_num_seqs=4, budget=32, max_model_len=24)
    for i in range(3):
        add(sched, f"r{i}", 8, max_tokens=8, base=i * 7)
    for _ in range(100):
        if not sched.has_unfinished():
            break
        run_step(sched)
    assert not sched.has_unfinished()
    assert sched.num_preemptions > 0
    assert sched.pool.is_fully_free()


def test_without_chunking_long_prompt_waits_for_room():
    sched = make_scheduler(budget=16, chunked=False, max_model_len=16)
    add(sched, "a", 10, max_tokens=2)
    add(sched, "b", 10, max_tokens=2)
    out = sched.schedule()
    assert [s.num_tokens for s in out.seqs] == [10]  # b does not fit in the same step, and is not chunked


# ---- property test: random add / abort / step streams ----

ops = st.lists(
    st.one_of(
        st.tuples(st.just("add"), st.integers(1, 30), st.integers(1, 8), st.integers(0, 2), st.integers(1, 3)),
        st.tuples(st.just("abort"), st.integers(0, 50)),
        st.tuples(st.just("step"), st.integers(1, 3)),
    ),
    min_size=1,
    max_size=40,
)


@given(
    ops=ops,
    num_blocks=st.integers(6, 40),
    block_size=st.sampled_from([2, 4, 8]),
    budget=st.integers(4, 40),
    max_num_seqs=st.integers(1, 6),
    prefix=st.booleans(),
)
@settings(max_examples=150, deadline=None)
def test_scheduler_invariants_hold_under_random_workloads(ops, num_blocks, block_size, budget, max_num_seqs, prefix):
    max_num_seqs = max(max_num_seqs, 3)
    sched = make_scheduler(
        num_blocks=num_blocks,
        block_size=block_size,
        budget=budget,
        max_num_seqs=max_num_seqs,
        max_model_len=64,
        prefix=prefix,
    )
    ids = []
    for op in ops:
        if op[0] == "add":
            _, plen, mt, prio, n = op
            rid = f"r{len(ids)}"
            try:
                add(sched, rid, plen, max_tokens=mt, priority=prio, n=n, base=len(ids) % 3)
                ids.append(rid)
            except InvalidRequestError:
                pass
        elif op[0] == "abort" and ids:
            sched.abort_request(ids[op[1] % len(ids)])
            sched.check_integrity()
        else:
            for _ in range(op[1]):
                out = run_step(sched)
                assert out.num_tokens <= budget
                assert len(sched.running) <= max_num_seqs
    # Everything drains: nothing is stuck forever and nothing leaks.
    for _ in range(2000):
        if not sched.has_unfinished():
            break
        run_step(sched)
    assert not sched.has_unfinished(), "requests stuck in the scheduler"
    assert sched.pool.is_fully_free()
    sched.check_integrity()


def test_a_held_request_is_known_but_queued_only_when_released():
    """(KV tiers: a request waits, held, while its prefix loads.) Held: its id is taken and it can
    be aborted, but it is not scheduled; released, it runs; released after an abort, nothing."""
    from engine.core.request import Request

    config = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64, block_size=4)
    sched = Scheduler(config, BlockPool(32, 4))

    def request(rid: str) -> Request:
        return Request(rid, None, list(range(1, 10)), SamplingParams(max_tokens=2), arrival_time=0.0)

    held, aborted = request("held"), request("aborted")
    sched.add_request(held, held=True)
    sched.add_request(aborted, held=True)
    assert "held" in sched.requests and not sched.waiting and not sched.has_unfinished()
    assert sched.schedule().is_empty
    sched.abort_request("aborted")
    sched.release_held(aborted)
    sched.release_held(held)
    assert [s.request.request_id for s in sched.waiting] == ["held"]
    assert [s.seq_id for s in sched.schedule().seqs] == [held.seqs[0].seq_id]
    sched.check_integrity()
