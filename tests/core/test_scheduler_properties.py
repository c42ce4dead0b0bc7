"""Scheduler properties under random streams of everything an engine does to it.

Requests are added, aborted and stopped early (a stop string the output side found:
Scheduler.finish_by_text) at random;
running sequences are preempted at random (swap or recompute) on top of those the block
shortage causes; steps run serially or overlapped (step N+1 scheduled and launched before
step N's tokens reach the host, its placeholders fed on the "device"), with and without
n-gram speculative decoding. A fake model keeps the KV *contents* per block and checks that
every token a sequence attends to is in its blocks (so a stale block table in a reused step
record, a wrong copy-on-write or a swap mapping would show), and computes each token from
the sequence so far (so outputs can be compared with an unconstrained run). After every
operation `check_integrity()` holds; the fake device reads block tables and token histories
that it keeps itself from the messages' deltas (engine/worker/seq_states.py), and each step
they equal the core's;
at the end every request is done, every GPU and CPU
block is free, and every output is right (a prefix of it, for requests stopped early).
"""

from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from engine.core import admission_rules as rules
from engine.core.admission_rules import InvalidRequestError
from engine.core.kv.block_pool import BlockPool
from engine.core.kv.swap_space import SwapSpace
from engine.core.params import SamplingParams
from engine.core.request import Request, SeqStatus
from engine.core.sched.scheduler import Scheduler, SchedulerConfig
from engine.core.sched.scheduler_output import PLACEHOLDER, SchedulerOutput
from engine.spec_decode.sched import NgramProposer, SpecDecodeConfig, SpecDecoder
from engine.worker.seq_states import SeqStates
from tests.support.engine import sampler_output, take_updates
from tests.support.swap import expected_outputs, fake_token


def prompt(base: int, length: int, period: int) -> list[int]:
    """A prompt repeating every `period` tokens (n-gram drafts find matches in it)."""
    return [(base * 7 + i % period) % 50 + 1 for i in range(length)]


class DeviceKV:
    """KV contents by block, written and read as the runner's step would; samples the fake model."""

    def __init__(self, block_size: int) -> None:
        self.bs = block_size
        self.gpu: dict[int, list] = {}
        self.cpu: dict[int, list] = {}
        self.states = SeqStates()  # the worker's own copies, from the messages' deltas

    def step(self, out: SchedulerOutput, fed: dict[int, int]) -> list[list[int]]:
        """fed: seq id -> the token the previous launched step sampled for it (a placeholder's id)."""
        bs = self.bs
        if out.seqs:  # (as the runner: a message without sequences is not built)
            self.states.drop(out.dropped_seqs)
        tables = {s.seq_id: self.states.table(s) for s in out.seqs}
        histories = {s.seq_id: self.states.history(s) for s in out.seqs}
        for g, c in out.blocks_to_swap_out:
            self.cpu[c] = list(self.gpu[g])
        for c, g in out.blocks_to_swap_in:
            self.gpu[g] = list(self.cpu[c])
        for a, b in out.blocks_to_copy:
            self.gpu[b] = list(self.gpu[a])
        contexts = []
        for s in out.seqs:
            inputs = [fed[s.seq_id] if t == PLACEHOLDER else t for t in s.token_ids]
            for k, tok in enumerate(inputs):
                p = s.start_pos + k
                block = tables[s.seq_id][p // bs]
                assert block != 0, "a sequence writes into the null block"
                self.gpu.setdefault(block, [None] * bs)[p % bs] = tok
            history = [fed[s.seq_id] if t == PLACEHOLDER else t for t in histories[s.seq_id][: s.start_pos]]
            contexts.append(history + inputs)
        sampled = []
        for s, context in zip(out.seqs, contexts):
            end = s.start_pos + s.num_tokens
            seen = [self.gpu.get(tables[s.seq_id][p // bs], [None] * bs)[p % bs] for p in range(end)]
            assert seen == context, f"seq {s.seq_id} reads the wrong KV"
            if not s.do_sample:
                sampled.append([])
            elif s.draft_token_ids:  # every position is sampled
                sampled.append([fake_token(context[: s.start_pos + 1 + j]) for j in range(s.num_tokens)])
            elif s.num_samples > 1:
                base = fake_token(context)
                sampled.append([(base + k) % 100 for k in range(s.num_samples)])
            else:
                sampled.append([fake_token(context)])
        return sampled


class Engine:
    """The engine loop around a Scheduler: serial or overlapped steps, finishing by length."""

    def __init__(self, sched: Scheduler) -> None:
        self.sched = sched
        self.kv = DeviceKV(sched.config.block_size)
        self.inflight: tuple[SchedulerOutput, list[list[int]]] | None = None
        self.fed: dict[int, int] = {}
        self.expected: dict[str, list[list[int]]] = {}
        self.stopped: set[str] = set()
        self.got: dict[str, dict[int, list[int]]] = {}  # what the output side saw (the core's updates)
        self.done: dict[str, list[list[int]]] = {}

    def add(self, rid: str, tokens: list[int], max_tokens: int, priority: int, n: int) -> None:
        rules.kv_capacity(self.sched.kv, len(tokens) + max_tokens, priority)  # (admission's, as the engine's)
        self.sched.add_request(
            Request(rid, None, tokens, SamplingParams(max_tokens=max_tokens, n=n, temperature=0), priority=priority)
        )
        self.expected[rid] = expected_outputs(tokens, max_tokens, n)

    def step(self, overlap: bool) -> None:
        sched = self.sched
        out = sched.schedule()
        assert out.num_tokens <= sched.config.max_num_batched_tokens
        sampled = self.kv.step(out, self.fed)
        held, histories = self.kv.states.tables, self.kv.states.histories
        for s in out.seqs:  # the worker's copies are the core's, copied, not shared
            seq = sched.seqs_by_id[s.seq_id]
            assert held[s.seq_id] == seq.block_ids and held[s.seq_id] is not seq.block_ids
            assert histories[s.seq_id] == seq.token_ids and histories[s.seq_id] is not seq.token_ids
        # It holds a copy of each sequence it was sent, and no other (drops wait for a message).
        assert set(held) == set(histories) == sched.deltas.sent() | set(sched.deltas.dropped)
        sched.launched(out)
        self.fed = {s.seq_id: tokens[0] for s, tokens in zip(out.seqs, sampled) if len(tokens) == 1}
        previous, self.inflight = self.inflight, (out, sampled)
        if previous is not None:
            self._process(*previous)
        serial = any(not s.advances_at_launch for s in out.seqs)  # forks and drafts: as the engine does
        if not overlap or serial:
            self.flush()
        sched.check_integrity()

    def flush(self) -> None:
        if self.inflight is not None:
            previous, self.inflight = self.inflight, None
            self._process(*previous)

    def _process(self, out: SchedulerOutput, sampled: list[list[int]]) -> None:
        take_updates(self.sched.update_from_output(out, sampler_output(out, sampled)), self.got, self.done)

    def live(self, status: SeqStatus | None = None) -> list:
        seqs = [s for r in self.sched.requests.values() for s in r.seqs if not s.is_finished]
        return [s for s in seqs if status is None or s.status is status]

    def stop(self, pick: int) -> None:
        """The output side found a stop string: it ends one sequence early (one that has handed
        out a token, after its request forked for n > 1); the request is done here once all of
        its samples are."""
        seqs = [s for s in self.live() if s.num_emitted and (s.request.forked or s.request.params.n == 1)]
        if seqs:
            seq = seqs[pick % len(seqs)]
            request = seq.request
            rid = request.request_id
            self.stopped.add(rid)
            self.sched.finish_by_text(rid, seq.sample_index, "stop")
            if rid not in self.sched.requests:  # (its other samples had ended: no update will come)
                samples = self.got[rid]
                self.done[rid] = [samples.get(i, []) for i in range(len(request.seqs))]
            self.sched.check_integrity()

    def preempt(self, pick: int) -> None:
        """Preempt a running sequence as a block shortage would (between steps)."""
        self.flush()  # (the scheduler preempts only while scheduling: no step is in flight then)
        running = self.sched.running
        if running:
            out = SchedulerOutput()
            self.sched.preemption.preempt(running[pick % len(running)], out, reason="test")
            self.kv.step(out, self.fed)  # its swap-out copies, before anything else on the device
            self.sched.check_integrity()

    def drain(self, overlap: bool) -> None:
        for _ in range(3000):
            if not self.sched.has_unfinished() and self.inflight is None:
                break
            self.step(overlap)
            if not self.sched.has_unfinished():
                self.flush()
        assert not self.sched.has_unfinished(), "requests stuck in the scheduler"


ops = st.lists(
    st.one_of(
        st.tuples(
            st.just("add"),
            st.integers(1, 24),
            st.integers(1, 12),
            st.integers(0, 3),
            st.integers(1, 3),
            st.integers(0, 3),
            st.integers(2, 60),
        ),
        st.tuples(st.just("abort"), st.integers(0, 60)),
        st.tuples(st.just("stop"), st.integers(0, 60)),
        st.tuples(st.just("preempt"), st.integers(0, 60)),
        st.tuples(st.just("step"), st.integers(1, 8)),
    ),
    min_size=12,
    max_size=60,
)


@given(
    ops=ops,
    num_blocks=st.integers(8, 28),
    block_size=st.sampled_from([2, 4, 8]),
    budget=st.integers(4, 40),
    max_num_seqs=st.integers(3, 6),
    prefix=st.booleans(),
    cpu_blocks=st.integers(0, 24),
    mode=st.sampled_from(["swap", "auto", "recompute"]),
    overlap=st.booleans(),
    spec=st.booleans(),
    reserve=st.sampled_from([0.0, 0.2]),
    whole_first=st.booleans(),
    micro=st.sampled_from([0, 0, 6, 12]),
    wave=st.sampled_from([0, 0, 24, 64]),
)
@settings(max_examples=150, deadline=None)
def test_integrity_and_no_leaks_under_random_engine_streams(  # noqa: PLR0913 - hypothesis draws each
    ops,
    num_blocks,
    block_size,
    budget,
    max_num_seqs,
    prefix,
    cpu_blocks,
    mode,
    overlap,
    spec,
    reserve,
    whole_first,
    micro,
    wave,
):
    cfg = SchedulerConfig(
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=budget,
        max_model_len=64,
        block_size=block_size,
        preemption_mode=mode,
        reserved_blocks_fraction=reserve,
        whole_prompts_first=whole_first,
        micro_batch_tokens=micro,
        prefill_wave_tokens=wave,
    )
    pool = BlockPool(num_blocks, block_size, prefix)
    swap = SwapSpace(pool, cpu_blocks, bytes_per_block=100) if cpu_blocks else None
    drafts = (
        SpecDecoder(NgramProposer(SpecDecodeConfig(num_speculative_tokens=3, prompt_lookup_min=1)), cfg.max_model_len)
        if spec
        else None
    )
    eng = Engine(Scheduler(cfg, pool, swap, drafts))
    ids: list[str] = []
    aborted: set[str] = set()
    for op in ops:
        if op[0] == "add":
            _, plen, mt, prio, n, base, period = op
            rid = f"r{len(ids)}"
            try:
                eng.add(rid, prompt(base, plen, period), mt, prio, n)
                ids.append(rid)
            except InvalidRequestError:
                pass
        elif op[0] == "abort" and ids:
            rid = ids[op[1] % len(ids)]
            if eng.sched.abort_request(rid) is not None:
                aborted.add(rid)
            eng.sched.check_integrity()
        elif op[0] == "stop":
            eng.stop(op[1])
        elif op[0] == "preempt":
            eng.preempt(op[1])
        elif op[0] == "step":
            for _ in range(op[1]):
                eng.step(overlap)
    eng.drain(overlap)
    sched = eng.sched
    assert sched.pool.is_fully_free(), "KV blocks leaked"
    if swap is not None:
        swap.begin_step()
        assert swap.is_fully_free(), "CPU blocks leaked"
    assert not sched.kv.digests and not sched._spare and not sched._unforked
    assert set(eng.done) | aborted == set(ids)
    for rid, outs in eng.done.items():
        if rid in aborted:
            continue
        for got, want in zip(outs, eng.expected[rid]):
            if rid in eng.stopped:
                assert got == want[: len(got)], f"request {rid}: wrong tokens before its stop"
            else:
                assert got == want, f"request {rid}: wrong tokens"


def test_rejected_drafts_give_their_blocks_back_and_the_table_is_rewritten():
    """A verify step allocates blocks for its drafts; the blocks only rejected drafts reached are
    freed at once, and the table's version changes so a cached block-table row is rewritten."""
    cfg = SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=64, max_model_len=64, block_size=2)
    pool = BlockPool(40, 2, True)
    proposer = NgramProposer(SpecDecodeConfig(num_speculative_tokens=6, prompt_lookup_min=1))
    sched = Scheduler(cfg, pool, None, SpecDecoder(proposer, cfg.max_model_len))
    tokens = [1, 2, 3, 4, 5, 6, 7, 1, 2, 3]  # with the next token 4, the tail repeats the start
    sched.add_request(Request("r", None, tokens, SamplingParams(max_tokens=20, temperature=0)))
    out = sched.schedule()
    sched.update_from_output(out, sampler_output(out, [[4]]))  # the prompt's token: 4 (the drafts' first is then 5)
    seq = sched.requests["r"].seqs[0]
    out = sched.schedule()
    (verify,) = out.seqs
    assert verify.draft_token_ids == [5, 6, 7, 1, 2, 3]
    held, version = len(seq.block_ids), seq.table_version
    assert held == 9  # 11 tokens + 6 drafts over blocks of 2
    sched.update_from_output(out, sampler_output(out, [[5, 9, 9, 9, 9, 9, 9]]))  # the first draft kept, the second not
    assert seq.output_token_ids == [4, 5, 9] and seq.num_computed_tokens == 12
    assert len(seq.block_ids) == 7 and seq.table_version == version + 1  # 13 tokens: 7 blocks
    sched.check_integrity()
    sched.abort_request("r")
    assert pool.is_fully_free()


def test_steady_decodes_reuse_records_only_after_their_step_is_processed():
    """The fast path writes a decode into a record of an earlier step only once that step has
    been processed: with a step in flight (overlap), the two steps' records are distinct."""
    cfg = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64, block_size=16)
    sched = Scheduler(cfg, BlockPool(20, 16, True))
    rng = random.Random(0)
    for i in range(3):
        sched.add_request(
            Request(
                f"r{i}", None, [rng.randrange(1, 50) for _ in range(5)], SamplingParams(max_tokens=30, temperature=0)
            )
        )
    first = sched.schedule()
    sched.launched(first)
    sched.update_from_output(first, sampler_output(first, [[7]] * 3))
    inflight = None
    seen: list[SchedulerOutput] = []
    for step in range(8):
        out = sched.schedule()
        sched.launched(out)
        if inflight is not None:
            assert not {id(r) for r in out.seqs} & {id(r) for r in inflight.seqs}
            assert [r.start_pos for r in inflight.seqs] == [p - 1 for p in (r.start_pos for r in out.seqs)]
            sched.update_from_output(inflight, sampler_output(inflight, [[7 + step]] * len(inflight.seqs)))
        inflight = out
        seen.append(out)
    assert len({id(r) for out in seen for r in out.seqs}) == 6  # two records per sequence, alternating
    sched.check_integrity()
