"""Scheduler test helpers: a scheduler over a small pool, requests added as admission would, and
one step of a deterministic fake model through the real update."""

from __future__ import annotations

from engine.core import admission_rules as rules
from engine.core.kv.block_pool import BlockPool
from engine.core.params import SamplingParams
from engine.core.request import Request
from engine.core.sched.scheduler import Scheduler, SchedulerConfig
from tests.support.engine import sampler_output


def make_scheduler(
    num_blocks=32, block_size=4, max_num_seqs=4, budget=16, max_model_len=64, chunked=True, prefix=True, **kw
) -> Scheduler:
    cfg = SchedulerConfig(
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=budget,
        max_model_len=max_model_len,
        block_size=block_size,
        enable_chunked_prefill=chunked,
        **kw,
    )
    return Scheduler(cfg, BlockPool(num_blocks, block_size, prefix))


def fake_token(seq_id_tokens: list[int]) -> int:
    # Deterministic "model": next token depends only on the sequence so far.
    return (sum(seq_id_tokens) * 31 + len(seq_id_tokens)) % 97 + 3


def run_step(sched: Scheduler) -> list:
    """One step of a fake model through the real update (Scheduler.update_from_output: the core
    appends the tokens, ends what reached max_tokens and lets finished requests go)."""
    out = sched.schedule()
    sampled = []
    for s in out.seqs:
        if s.do_sample:
            base = fake_token(sched.seqs_by_id[s.seq_id].token_ids[: s.start_pos + s.num_tokens])
            sampled.append([(base + k) % 100 for k in range(s.num_samples)])
        else:
            sampled.append([])
    sched.update_from_output(out, sampler_output(out, sampled))
    sched.check_integrity()
    return out


def add(
    sched: Scheduler, rid: str, prompt_len: int, max_tokens: int = 4, priority: int = 0, n: int = 1, base: int = 0
) -> Request:
    req = Request(
        rid,
        None,
        [(base + i) % 50 + 1 for i in range(prompt_len)],
        SamplingParams(max_tokens=max_tokens, n=n, temperature=0 if n == 1 else 1.0),
        priority=priority,
    )
    rules.kv_capacity(sched.kv, prompt_len + max_tokens, priority)  # (admission's, as the engine's)
    sched.add_request(req)
    return req


def arrival_steps(sched: Scheduler, arrivals: list[tuple], requests: list[Request], steps: int = 3000, base=None):
    """Random arrivals for property tests: each of `arrivals` is (steps to wait after the previous one,
    prompt length, max_tokens[, priority]); added to `requests` as it arrives. Yields before each step
    the caller is to run, until everything arrived and finished (or `steps` ran out)."""
    pending = list(arrivals)
    for _ in range(steps):
        while pending and pending[0][0] == 0:
            _, plen, max_tokens, *priority = pending.pop(0)
            n = len(requests)
            requests.append(add(sched, f"r{n}", plen, max_tokens, *priority, base=n if base is None else base(n)))
        if pending:
            pending[0] = (pending[0][0] - 1, *pending[0][1:])
        if not sched.has_unfinished():
            if not pending:
                return
            continue
        yield
