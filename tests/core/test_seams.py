"""Feature seams (issue 12): tasks (engine/core/request_kinds.py), the forward context (engine/worker/step_features.py)
and the step builder's decode fast path (engine/worker/step_builder.py)."""

import numpy as np
import pytest
import torch

from engine.core.params import LoRARequest, PoolingParams, SamplingParams
from engine.core.request_kinds import GENERATE, Generate, Pool, ScorePrompt, make_task
from engine.core.sched.scheduler_output import ScheduledSeq
from engine.worker.task_reads import read_task
from tests.support.engine import assert_engine_clean

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


# ---- tasks ----
def test_task_per_request_kind():
    assert make_task(SamplingParams(), None) is GENERATE
    score = make_task(SamplingParams(prompt_logprobs=2), None)
    assert isinstance(score, ScorePrompt) and score.top_n == 2 and not score.prefix_cacheable
    last, mean = make_task(None, PoolingParams("last")), make_task(SamplingParams(), PoolingParams("mean"))
    assert isinstance(last, Pool) and last.prefix_cacheable and not last.text_output
    assert isinstance(mean, Pool) and not mean.prefix_cacheable  # the mean needs every prompt position
    assert last is not make_task(None, PoolingParams("last"))  # (one per request)


def _scheduled(task, **kw) -> ScheduledSeq:
    base = dict(
        seq_id=1,
        token_ids=[5],
        start_pos=9,
        blocks_from=0,
        new_block_ids=[0],
        do_sample=True,
        num_samples=1,
        params=SamplingParams(),
        history_from=0,
        new_history=list(range(10)),
        num_prompt_tokens=4,
        sample_index=0,
        task=task,
    )
    return ScheduledSeq(**(base | kw))


def test_sample_rows():
    assert Generate.sample_rows(_scheduled(GENERATE)) == 1
    assert Generate.sample_rows(_scheduled(GENERATE, num_samples=3)) == 3  # a fork point
    assert Generate.sample_rows(_scheduled(GENERATE, token_ids=[5, 6, 7], draft_token_ids=[6, 7])) == 3
    assert Generate.sample_rows(_scheduled(GENERATE, do_sample=False)) == 0  # a prefill chunk mid-prompt
    pool = Pool(PoolingParams("last"))
    assert pool.sample_rows(_scheduled(pool)) == 0


def test_score_prompt_plans_only_prompt_positions():
    task = ScorePrompt(1)
    # positions 0..5 of a 4-token prompt: positions 0, 1, 2 predict prompt tokens 1, 2, 3
    row, first, targets = task.plan(_scheduled(task, token_ids=list(range(6)), start_pos=0), 7, list(range(10)))
    assert (row, first, targets) == (7, 1, [1, 2, 3])
    decode = _scheduled(task, token_ids=[9], start_pos=9)
    assert task.plan(decode, 0, list(range(10))) is None  # a decode scores nothing


class _Seq:
    def __init__(self):
        self.request = type("R", (), {"embedding": None, "pooled": None})()


def test_mean_pool_over_chunks_equals_the_mean_of_all_rows():
    hidden = torch.randn(10, 6)
    task = Pool(PoolingParams("mean", normalize=True, dimensions=4))
    seq = _Seq()
    chunks = [(0, 4), (4, 3), (7, 3)]  # (first position, rows): three prefill chunks of one prompt
    done = []
    for k, (start, rows) in enumerate(chunks):
        s = _scheduled(task, token_ids=[0] * rows, start_pos=start, do_sample=k == len(chunks) - 1)
        plan = task.plan(s, 0, [0] * 10)
        done.append(task.record(seq, read_task(task, None, hidden[start : start + rows], plan)))
    assert done == [False, False, True]
    want = torch.nn.functional.normalize(hidden.mean(dim=0)[:4], dim=0)
    assert torch.allclose(torch.tensor(seq.request.embedding), want, atol=1e-6)


def test_last_pool_reads_only_the_final_chunk():
    task = Pool(PoolingParams("last", normalize=False))
    assert task.plan(_scheduled(task, token_ids=[0] * 4, start_pos=0, do_sample=False), 0, [0] * 7) is None
    hidden = torch.randn(3, 5)
    seq = _Seq()
    plan = task.plan(_scheduled(task, token_ids=[0] * 3, start_pos=4, do_sample=True), 0, [0] * 7)
    assert task.record(seq, read_task(task, None, hidden, plan))
    assert torch.allclose(torch.tensor(seq.request.embedding), hidden[-1])


# ---- the step builder ----
def _host_state(buf, n):
    return {
        name: getattr(buf, name)[:n].copy()
        for name in ("np_input_ids", "np_positions", "np_slot_mapping", "np_seq_lens")
    } | {"qsl": buf.np_query_start_loc[: n + 1].copy(), "tables": buf.np_block_tables[:n].copy()}


def _decode_step(make_llm, **settings):
    llm = make_llm(max_num_seqs=8, block_size=8, **settings)
    engine = llm.engine
    for i in range(6):
        engine.add_request(list(range(3 + i, 9 + 2 * i)), GREEDY, f"r{i}")
    for _ in range(4):
        engine.step()
    return engine


def test_decode_fast_path_writes_what_the_general_path_writes(make_llm):
    engine = _decode_step(make_llm, async_scheduling=False)
    sched = engine.core.scheduler.schedule()
    n = len(sched.seqs)
    assert n == 6 and sched.num_prefill_tokens == 0
    builder = engine.core.runner.builder
    general = builder._build_general(sched.seqs)
    want = _host_state(builder.buffers, n)
    builder.buffers.np_input_ids[:n] = 0
    builder.buffers.np_slot_mapping[:n] = 0
    builder.buffers.np_block_tables[:n] = 0  # (the rows stay known: only changed rows are rewritten...)
    builder.buffers._rows = [(None, 0)] * len(builder.buffers._rows)  # (...so forget them)
    decode = builder.build(sched)
    got = _host_state(builder.buffers, n)
    for name in want:
        assert np.array_equal(got[name], want[name]), name
    assert decode.sample_indices == general.sample_indices == list(range(n))
    assert [(r.key, r.sample_index, r.all_token_ids) for r in decode.rows] == [
        (r.key, r.sample_index, r.all_token_ids) for r in general.rows
    ]
    assert decode.meta.max_seq_len == general.meta.max_seq_len and decode.meta.num_decodes == n
    assert builder.build(sched).rows[0] is decode.rows[0]  # a decoding sequence's sampler row is kept
    for i in range(6):
        engine.abort_request(f"r{i}")
    while engine.core.has_unfinished_requests():
        engine.step()
    assert_engine_clean(engine)


def test_block_table_rows_are_rewritten_only_where_they_changed(make_llm):
    buf = make_llm(max_num_seqs=8).engine.core.runner.buffers
    a, b = [3, 4], [7, 8, 9]
    buf.write_table_rows([(a, 2), (b, 3)])
    assert buf.np_block_tables[0, :2].tolist() == a and buf.np_block_tables[1, :3].tolist() == b
    buf.np_block_tables[0, :2] = -5  # were row 0 rewritten, this would be gone
    b.append(11)  # row 1's sequence took a new block
    buf.write_table_rows([(a, 2), (b, 4)])
    assert buf.np_block_tables[0, :2].tolist() == [-5, -5]
    assert buf.np_block_tables[1, :4].tolist() == [7, 8, 9, 11]
    a = [3, 5]  # copy-on-write replaced an entry of row 0: the worker's table is a new list
    buf.write_table_rows([(a, 2), (b, 4)])
    assert buf.np_block_tables[0, :2].tolist() == a


# ---- the forward context: LoRA slots through decode graphs ----
@pytest.fixture
def lora_adapters(tiny_llama, tmp_path):
    from engine.bench.lora import write_random_adapter
    from engine.models.config import ModelConfig

    config = ModelConfig.from_dir(tiny_llama)
    return [
        LoRARequest(f"a{i}", i + 1, str(write_random_adapter(config, tmp_path / f"a{i}", 8, seed=i))) for i in range(2)
    ]


def test_lora_slots_reach_the_model_through_replayed_decode_graphs(make_llm, lora_adapters):
    """The graph body reads the forward context from its static buffers: decode steps replayed
    over them (simulated graphs on the CPU) give each sequence its own adapter, as eager does."""
    common = dict(enable_lora=True, max_loras=2, max_lora_rank=8, max_num_seqs=8)
    eager = make_llm(**common)
    graphs = make_llm(**common)
    runner = graphs.engine.core.runner
    runner.builder.compiled = True  # padded steps, full-width tables: the graph shapes (eager forward)
    runner.capture_graphs([1, 2, 4, 8], device_reads_lengths=False, simulate=True)
    prompts = [[1, 2, 3, 4], [5, 6, 7], [1, 2, 3, 4], [8, 9, 10, 11, 12], [1, 2, 3, 4], [5, 6, 7]]
    loras = [None, lora_adapters[0], lora_adapters[1], lora_adapters[0], lora_adapters[0], None]
    a = graphs.generate(prompts, GREEDY, use_tqdm=False, lora_request=loras)
    b = eager.generate(prompts, GREEDY, use_tqdm=False, lora_request=loras)
    assert runner.graph_runner.num_replays > 0
    assert [o.outputs[0].token_ids for o in a] == [o.outputs[0].token_ids for o in b]
    same_prompt = {tuple(o.outputs[0].token_ids) for o, p in zip(a, prompts) if p == [1, 2, 3, 4]}
    assert len(same_prompt) == 3  # base, adapter 0 and adapter 1 differ: the slots were read
