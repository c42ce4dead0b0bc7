"""Scheduler with swap and priorities, against a fake runner that keeps the KV *contents*.

The fake runner mirrors the real step order (swap-outs, swap-ins, copy-on-write copies, then
the forward's KV writes) over a dict of block -> tokens, and checks that every token a
sequence attends to is really in its blocks: a wrong block table, swap mapping or
copy-on-write would show as a wrong token. Its "model" is a pure function of the tokens so
far, so every request's output is known in advance, whatever was preempted.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.core import admission_rules as rules
from engine.core.admission_rules import InvalidRequestError
from engine.core.kv.block_pool import BlockPool
from engine.core.kv.swap_space import SwapSpace
from engine.core.params import SamplingParams
from engine.core.request import Request, SeqStatus
from engine.core.sched.scheduler import Scheduler, SchedulerConfig
from engine.core.sched.scheduler_output import SchedulerOutput
from engine.worker.seq_states import SeqStates
from tests.support.engine import sampler_output, take_updates
from tests.support.swap import expected_outputs, fake_token, prompt


class FakeKV:
    def __init__(self, block_size: int) -> None:
        self.bs = block_size
        self.gpu: dict[int, list] = {}
        self.cpu: dict[int, list] = {}
        self.swapped_out = 0
        self.swapped_in = 0
        self.states = SeqStates()  # the worker's own copies, from the messages' deltas

    def step(self, out) -> list[list[int]]:
        bs = self.bs
        self.states.drop(out.dropped_seqs)
        tables = {s.seq_id: self.states.table(s) for s in out.seqs}
        histories = {s.seq_id: self.states.history(s) for s in out.seqs}
        for g, c in out.blocks_to_swap_out:
            self.cpu[c] = list(self.gpu[g])
        for c, g in out.blocks_to_swap_in:
            self.gpu[g] = list(self.cpu[c])
        self.swapped_out += len(out.blocks_to_swap_out)
        self.swapped_in += len(out.blocks_to_swap_in)
        for a, b in out.blocks_to_copy:
            self.gpu[b] = list(self.gpu[a])
        for s in out.seqs:  # every write of the step first (a layer writes all K/V, then attends)
            for k, tok in enumerate(s.token_ids):
                p = s.start_pos + k
                block = tables[s.seq_id][p // bs]
                assert block != 0, "a sequence writes into the null block"
                self.gpu.setdefault(block, [None] * bs)[p % bs] = tok
        sampled = []
        for s in out.seqs:
            end = s.start_pos + s.num_tokens
            seen = [self.gpu.get(tables[s.seq_id][p // bs], [None] * bs)[p % bs] for p in range(end)]
            assert seen == histories[s.seq_id][:end], f"seq {s.seq_id} reads the wrong KV"
            if s.do_sample:
                base = fake_token(histories[s.seq_id][:end])
                sampled.append([(base + k) % 100 for k in range(s.num_samples)] if s.num_samples > 1 else [base])
            else:
                sampled.append([])
        return sampled


def make(
    num_blocks=16,
    block_size=4,
    max_num_seqs=4,
    budget=16,
    max_model_len=64,
    cpu_blocks=8,
    mode="swap",
    prefix=True,
    **kw,
) -> Scheduler:
    cfg = SchedulerConfig(
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=budget,
        max_model_len=max_model_len,
        block_size=block_size,
        preemption_mode=mode,
        **kw,
    )
    pool = BlockPool(num_blocks, block_size, prefix)
    swap = SwapSpace(pool, cpu_blocks, bytes_per_block=100) if cpu_blocks else None
    return Scheduler(cfg, pool, swap)


class Driver:
    def __init__(self, sched: Scheduler) -> None:
        self.sched = sched
        self.kv = FakeKV(sched.config.block_size)
        self.expected: dict[str, list[list[int]]] = {}
        self.got: dict[str, dict[int, list[int]]] = {}  # what the output side saw (the core's updates)
        self.done: dict[str, list[list[int]]] = {}
        self.aborted: set[str] = set()

    def add(self, rid, prompt, max_tokens=4, priority=0, n=1):
        rules.kv_capacity(self.sched.kv, len(prompt) + max_tokens, priority)  # (admission's, as the engine's)
        req = Request(
            rid, None, list(prompt), SamplingParams(max_tokens=max_tokens, n=n, temperature=0), priority=priority
        )
        self.sched.add_request(req)
        self.expected[rid] = expected_outputs(prompt, max_tokens, n)
        return req

    def step(self):
        sched = self.sched
        out = sched.schedule()
        assert out.num_tokens <= sched.config.max_num_batched_tokens
        sampled = self.kv.step(out)
        take_updates(sched.update_from_output(out, sampler_output(out, sampled)), self.got, self.done)
        sched.check_integrity()
        return out

    def abort(self, rid):
        if self.sched.abort_request(rid) is not None:
            self.aborted.add(rid)
        self.sched.check_integrity()

    def drain(self, max_steps=3000):
        for _ in range(max_steps):
            if not self.sched.has_unfinished():
                break
            self.step()
        assert not self.sched.has_unfinished(), "requests stuck in the scheduler"
        assert self.sched.pool.is_fully_free()
        if self.sched.swapper is not None:
            self.sched.swapper.begin_step()
            assert self.sched.swapper.is_fully_free()
        for rid, outs in self.done.items():
            assert outs == self.expected[rid], f"request {rid}: wrong tokens after preemption"


# ---- unit tests ----


def test_swap_out_and_back_restores_the_kv_exactly():
    d = Driver(make(num_blocks=9, block_size=4, budget=32, max_model_len=32, cpu_blocks=16, prefix=False))
    for i in range(3):
        d.add(f"r{i}", prompt(i, 9), max_tokens=12)
    d.drain()
    s = d.sched
    assert s.preemptions_by_mode["swap"] > 0 and s.preemptions_by_mode["recompute"] == 0
    assert d.kv.swapped_out > 0 and d.kv.swapped_in == d.kv.swapped_out
    assert s.swapper.bytes_out == d.kv.swapped_out * 100 == s.swapper.bytes_in
    assert len(d.done) == 3


def test_shared_prefix_blocks_stay_on_the_gpu_with_the_swapped_sequence():
    s = make(num_blocks=12, block_size=4, budget=64, max_model_len=48, cpu_blocks=16)
    d = Driver(s)
    d.add("a", prompt(0, 12), max_tokens=4)
    d.step()  # a's prompt is cached: 3 full blocks
    d.add("b", prompt(0, 12) + [9, 9], max_tokens=8)
    d.step()  # b hits a's blocks (all but the last token's block)
    b = s.requests["b"].seqs[0]
    shared = [blk for blk in b.block_ids if s.pool.ref_count(blk) > 1]
    assert shared
    out_pairs = s.swapper.swap_out(b)  # as _preempt would
    s.running.remove(b)
    b.status = SeqStatus.SWAPPED
    s.swapped.append(b)
    moved = {g for g, _ in out_pairs}
    assert not moved & set(shared), "a shared block was moved from under its other owner"
    for blk in shared:
        assert s.pool.ref_count(blk) == 2  # b still holds its reference
    s.check_integrity()
    d.kv.step(SchedulerOutput(blocks_to_swap_out=out_pairs))
    d.drain()
    assert d.done["b"] == d.expected["b"]


def test_swap_in_takes_blocks_still_in_the_prefix_cache_instead_of_copying():
    from engine.core.sched.scheduler_output import SchedulerOutput

    s = make(num_blocks=20, block_size=4, budget=64, max_model_len=48, cpu_blocks=16)
    d = Driver(s)
    seq = d.add("a", prompt(0, 13), max_tokens=6).seqs[0]
    d.step()
    out = SchedulerOutput()
    s.preemption.preempt(seq, out, reason="test")  # 4 blocks of KV: 3 full (hashed) + 1 partial
    assert len(out.blocks_to_swap_out) == 4 and seq.status is SeqStatus.SWAPPED
    d.kv.step(out)
    s.check_integrity()
    assert s.swapper.blocks_needed(seq) == 4  # the 3 cached ones are idle: taking them still costs room
    back = d.step()
    assert len(back.blocks_to_swap_in) == 1 and s.swapper.blocks_reused == 3  # only the partial block copied
    d.drain()
    assert d.done["a"] == d.expected["a"]


def test_auto_recomputes_short_sequences_and_swaps_long_ones():
    s = make(num_blocks=20, block_size=4, cpu_blocks=8, mode="auto")
    d = Driver(s)
    short = d.add("short", prompt(1, 2), max_tokens=4).seqs[0]
    long = d.add("long", prompt(2, 10), max_tokens=4).seqs[0]
    d.step()
    assert not s.swapper.can_swap_out(short, "auto")  # 2 tokens: cheaper to recompute
    assert s.swapper.can_swap_out(long, "auto")
    assert s.swapper.can_swap_out(short, "swap")


def test_auto_cost_model_uses_measured_rates():
    """Once both rates are measured, auto compares copy time out and back with recompute time."""
    s = make(num_blocks=20, block_size=4, cpu_blocks=8, mode="auto")
    sw = s.swapper
    sw.bytes_per_block = 1000
    d = Driver(s)
    short = d.add("short", prompt(1, 2), max_tokens=4).seqs[0]
    long = d.add("long", prompt(2, 10), max_tokens=4).seqs[0]
    d.step()
    assert sw.auto_estimate(long) is None  # nothing measured yet: the token threshold decides
    sw.observe_prefill(100, 0.1)  # 1 ms per token
    sw.observe_swap(1000, 1e-4)  # a block each way: 0.2 ms for one block
    swap_s, recompute_s = sw.auto_estimate(long)  # 10 tokens in 3 blocks
    assert swap_s == pytest.approx(6e-4) and recompute_s == pytest.approx(1e-2)
    assert sw.can_swap_out(long, "auto") and sw.can_swap_out(short, "auto")  # 2 tokens: 0.2 ms < 2 ms
    sw.observe_swap(1000, 0.1)  # a very slow link: the moving average climbs
    assert sw.swap_seconds_per_byte == pytest.approx(0.8 * 1e-7 + 0.2 * 1e-4)
    assert not sw.can_swap_out(short, "auto") and not sw.can_swap_out(long, "auto")
    assert sw.can_swap_out(long, "swap")  # swap mode ignores the costs
    sw.observe_prefill(10, 10.0)  # and when recomputation is slower still, swapping wins again
    assert sw.can_swap_out(long, "auto")
    d.drain()
    assert d.done["long"] == d.expected["long"]


def test_full_swap_space_falls_back_to_recompute():
    d = Driver(make(num_blocks=9, block_size=4, budget=32, max_model_len=32, cpu_blocks=1, prefix=False))
    for i in range(3):
        d.add(f"r{i}", prompt(i, 9), max_tokens=12)
    d.drain()
    assert d.sched.preemptions_by_mode["recompute"] > 0


def test_high_priority_arrival_preempts_low_priority_running():
    s = make(num_blocks=9, block_size=4, max_num_seqs=4, budget=64, max_model_len=32, cpu_blocks=16, prefix=False)
    d = Driver(s)
    d.add("low1", prompt(1, 12), max_tokens=8, priority=5)
    d.add("low2", prompt(2, 12), max_tokens=8, priority=5)
    d.step()
    assert s.pool.num_available < 4
    d.add("high", prompt(3, 12), max_tokens=2, priority=0)
    out = d.step()
    high = s.requests["high"].seqs[0]
    assert high.status is SeqStatus.RUNNING and out.preempted
    assert all(s.requests[r].seqs[0].num_preemptions <= 1 for r in ("low1", "low2"))
    d.drain()
    assert set(d.done) == {"low1", "low2", "high"}


def test_low_priority_does_not_preempt_high_priority():
    s = make(num_blocks=9, block_size=4, max_num_seqs=4, budget=64, max_model_len=32, cpu_blocks=16, prefix=False)
    d = Driver(s)
    d.add("high1", prompt(1, 12), max_tokens=8, priority=0)
    d.add("high2", prompt(2, 12), max_tokens=8, priority=0)
    d.step()
    d.add("low", prompt(3, 12), max_tokens=2, priority=3)
    out = d.step()
    assert not out.preempted and s.requests["low"].seqs[0].status is SeqStatus.WAITING
    d.drain()


def test_reserved_blocks_are_only_for_urgent_requests():
    s = make(
        num_blocks=11,
        block_size=4,
        max_num_seqs=8,
        budget=64,
        max_model_len=40,
        cpu_blocks=0,
        reserved_blocks_fraction=0.5,
        reserved_priority=0,
    )
    d = Driver(s)
    with pytest.raises(InvalidRequestError, match="priority 1"):
        d.add("too-big-for-low", prompt(1, 20), max_tokens=4, priority=1)  # 6 blocks > 10 - 5
    d.add("low", prompt(2, 16), max_tokens=4, priority=1)  # 5 blocks: all that is outside the reserve
    d.step()
    d.add("low2", prompt(3, 4), max_tokens=1, priority=1)
    d.add("urgent", prompt(4, 16), max_tokens=4, priority=0)
    d.step()
    assert s.requests["urgent"].seqs[0].status is SeqStatus.RUNNING  # in the reserve
    assert s.requests["low2"].seqs[0].status is SeqStatus.WAITING
    d.drain()


def test_swapped_come_back_before_new_arrivals_of_the_same_priority():
    s = make(num_blocks=9, block_size=4, max_num_seqs=4, budget=64, max_model_len=32, cpu_blocks=16, prefix=False)
    d = Driver(s)
    d.add("a", prompt(1, 12), max_tokens=12)
    d.add("b", prompt(2, 12), max_tokens=12)
    for _ in range(6):
        d.step()
        if s.swapped:
            break
    assert s.swapped
    victim = s.swapped[0]
    d.add("new", prompt(3, 4), max_tokens=2)
    new = s.requests["new"].seqs[0]
    while victim.status is SeqStatus.SWAPPED:
        assert new.status is SeqStatus.WAITING
        d.step()
    d.drain()


# ---- property test: random add / abort / step streams with swap and priorities ----

ops = st.lists(
    st.one_of(
        st.tuples(
            st.just("add"),
            st.integers(1, 24),
            st.integers(1, 10),
            st.integers(0, 3),
            st.integers(1, 3),
            st.integers(0, 3),
        ),
        st.tuples(st.just("abort"), st.integers(0, 60)),
        st.tuples(st.just("step"), st.integers(1, 4)),
    ),
    min_size=1,
    max_size=50,
)


@given(
    ops=ops,
    num_blocks=st.integers(8, 40),
    block_size=st.sampled_from([2, 4, 8]),
    budget=st.integers(4, 40),
    max_num_seqs=st.integers(3, 6),
    prefix=st.booleans(),
    cpu_blocks=st.integers(0, 24),
    mode=st.sampled_from(["swap", "auto", "recompute"]),
    reserve=st.sampled_from([0.0, 0.2]),
    reserved_priority=st.integers(0, 1),
)
@settings(max_examples=200, deadline=None)
def test_swap_and_priority_invariants_under_random_workloads(
    ops, num_blocks, block_size, budget, max_num_seqs, prefix, cpu_blocks, mode, reserve, reserved_priority
):
    d = Driver(
        make(
            num_blocks=num_blocks,
            block_size=block_size,
            budget=budget,
            max_num_seqs=max_num_seqs,
            max_model_len=64,
            prefix=prefix,
            cpu_blocks=cpu_blocks,
            mode=mode,
            reserved_blocks_fraction=reserve,
            reserved_priority=reserved_priority,
        )
    )
    ids: list[str] = []
    for op in ops:
        if op[0] == "add":
            _, plen, mt, prio, n, base = op
            rid = f"r{len(ids)}"
            try:
                d.add(rid, prompt(base, plen), max_tokens=mt, priority=prio, n=n)
                ids.append(rid)
            except InvalidRequestError:
                pass
        elif op[0] == "abort" and ids:
            d.abort(ids[op[1] % len(ids)])
        else:
            for _ in range(op[1]):
                d.step()
    d.drain()
    assert set(d.done) | d.aborted == set(ids)


def test_priority_preemption_never_preempts_for_blocks_it_cannot_free():
    """L shares six of its seven blocks with H: preempting L frees one block, not seven, so an
    urgent W that needs six must wait for room instead of throwing L's progress away."""
    s = make(
        num_blocks=13,
        block_size=4,
        max_num_seqs=4,
        budget=64,
        max_model_len=48,
        cpu_blocks=0,
        mode="recompute",
        watermark_fraction=0.0,
    )
    d = Driver(s)
    shared = list(range(1, 25))  # 6 full blocks
    d.add("H", shared + [90], max_tokens=20, priority=0)
    d.step()
    d.add("L", shared + [91], max_tokens=20, priority=1)
    d.step()
    d.step()
    d.add("W", [200 + i for i in range(21)], max_tokens=4, priority=0)
    out = d.step()
    assert not out.preempted, "L was preempted although that could not make room for W"
    assert s.requests["L"].seqs[0].status is SeqStatus.RUNNING
