"""The step's message is plain: what the scheduler hands the worker holds copied values, never
the core's own objects (a Sequence, a Request, a grammar matcher, a sequence's token or block
list), so nothing the worker does with it can reach the core's state."""

from __future__ import annotations

import dataclasses
import enum

from engine.core.kv.block_pool import BlockPool
from engine.core.kv.swap_space import SwapSpace
from engine.core.params import SamplingParams
from engine.core.request import Request
from engine.core.sched.scheduler import Scheduler, SchedulerConfig
from engine.core.sched.scheduler_output import ScheduledSeq, SchedulerOutput
from tests.support.engine import sampler_output

# Fields that still carry an object the core holds, and why they may (item 5 of issue 38):
STILL_SHARED = {
    "params": "the request's SamplingParams: set at admission, never written after",
    "task": "the request's kind (engine/core/request_kinds.py): no state, the worker calls its plan()",
}


class _Matcher:
    """A grammar matcher that accepts everything (the scheduler only asks whether there is one)."""

    is_terminated = False

    def accept(self, token: int) -> bool:
        return True


def _live_objects(sched: Scheduler) -> dict[int, str]:
    live: dict[int, str] = {}
    for request in sched.requests.values():
        live[id(request)] = "a Request"
        live[id(request.prompt_token_ids)] = "a request's prompt list"
        if request.grammars:
            live[id(request.grammars)] = "a request's grammar matchers"
            live.update((id(m), "a grammar matcher") for m in request.grammars)
        for seq in request.seqs:
            live[id(seq)] = "a Sequence"
            live[id(seq.token_ids)] = "a sequence's token list"
            live[id(seq.block_ids)] = "a sequence's block table"
    return live


def _check_plain(value, live: dict[int, str], path: str) -> None:
    if value is None or isinstance(value, (bool, int, float, str, enum.Enum)):
        return
    assert id(value) not in live, f"{path} is {live[id(value)]} of the core"
    if isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            _check_plain(v, live, f"{path}[{i}]")
    elif type(value) in (SchedulerOutput, ScheduledSeq):
        for f in dataclasses.fields(value):
            if f.name not in STILL_SHARED:
                _check_plain(getattr(value, f.name), live, f"{path}.{f.name}")
    else:
        raise AssertionError(f"{path}: a {type(value).__name__} in the message")


def test_a_message_of_every_kind_of_step_is_plain():
    cfg = SchedulerConfig(
        max_num_seqs=6, max_num_batched_tokens=24, max_model_len=64, block_size=4, preemption_mode="swap"
    )
    pool = BlockPool(20, 4, True)
    sched = Scheduler(cfg, pool, SwapSpace(pool, 16, bytes_per_block=100))
    shared = list(range(1, 13))
    requests = [
        Request("a", None, shared + [20], SamplingParams(max_tokens=12, temperature=0)),
        Request("b", None, shared + [21], SamplingParams(max_tokens=12, n=3, temperature=0)),  # a fork
        Request("c", None, list(range(30, 47)), SamplingParams(max_tokens=10, temperature=0)),  # chunked
        Request("d", None, [5, 6, 7], SamplingParams(max_tokens=8, temperature=0), priority=-1),
    ]
    requests[3].grammars = [_Matcher()]
    requests[3].lora_slot = 2
    for request in requests:
        sched.add_request(request)
    seen: set[str] = set()
    for step in range(60):
        if not sched.has_unfinished():
            break
        out = sched.schedule()
        _check_plain(out, _live_objects(sched), "out")
        seen.update(
            k
            for k, hit in (
                ("fork", any(s.num_samples > 1 for s in out.seqs)),
                ("swap", bool(out.blocks_to_swap_out)),
                ("copy", bool(out.blocks_to_copy)),
                ("constrained", any(s.constrained and s.lora_slot == 2 for s in out.seqs)),
            )
            if hit
        )
        tokens = [[(s.seq_id + step) % 40 + 1] * s.task.sample_rows(s) for s in out.seqs]
        sched.update_from_output(out, sampler_output(out, tokens))
        sched.check_integrity()
    assert not sched.has_unfinished()
    assert {"fork", "copy", "swap", "constrained"} <= seen, seen


def test_a_core_object_in_the_message_is_caught():
    """(The check above is not vacuous: a record that shares a core list, or holds a Sequence, fails.)"""
    cfg = SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=16, max_model_len=32, block_size=4)
    sched = Scheduler(cfg, BlockPool(8, 4, False))
    sched.add_request(Request("a", None, [1, 2, 3], SamplingParams(max_tokens=2)))
    out = sched.schedule()
    seq = sched.requests["a"].seqs[0]
    for leak in (seq.block_ids, seq.token_ids, seq):
        record = dataclasses.replace(out.seqs[0], new_block_ids=leak)
        try:
            _check_plain(dataclasses.replace(out, seqs=[record]), _live_objects(sched), "out")
        except AssertionError:
            continue
        raise AssertionError(f"{type(leak).__name__} in a record went unnoticed")


def test_a_steady_decode_carries_only_what_changed():
    """The speed guard of the plain message (issue 38): a running sequence's record carries its
    block table and tokens whole once, then only what changed: no block ids while it decodes
    inside its blocks, the one new block id when it takes one, and its newest token."""
    bs = 4
    sched = Scheduler(
        SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=64, max_model_len=64, block_size=bs),
        BlockPool(16, bs, True),
    )
    sched.add_request(Request("r", None, [3, 4, 5, 6, 7, 8], SamplingParams(max_tokens=12, temperature=0)))
    seq = sched.requests["r"].seqs[0]
    first = sched.schedule()
    (rec,) = first.seqs
    assert (rec.blocks_from, rec.new_block_ids) == (0, seq.block_ids) and len(rec.new_block_ids) == 2
    assert (rec.history_from, rec.new_history) == (0, [3, 4, 5, 6, 7, 8])
    sched.update_from_output(first, sampler_output(first, [[9]]))
    for step in range(10):
        out = sched.schedule()
        (rec,) = out.seqs
        held = len(seq.block_ids)
        grew = rec.start_pos % bs == 0  # (this step's token is the first of a new block)
        assert rec.blocks_from == (held - 1 if grew else held), step
        assert rec.new_block_ids == (seq.block_ids[-1:] if grew else []), step
        assert rec.new_history == [9 + step] and rec.history_from == rec.start_pos, step
        sched.update_from_output(out, sampler_output(out, [[10 + step]]))
    sched.check_integrity()
