"""Decode CUDA graphs: replay == eager, stale rows masked, greedy tokens == enforce_eager, with
overlap scheduling on and off.

The engines are driven only through `LLMEngine.step()`, as serving drives them: with overlap on
(`async_scheduling`, a GPU's default) a step's results are processed after the next step was
launched, so a test never reads `last_step` or schedules by hand. Each decode-graph replay is
checked where it happens: a `ReplayChecker` wraps the graph runner's `replay`, and after every
replay runs the same step eagerly over the same static buffers ([:n] rows, exact max_seq_len)
and compares logits and tokens, and that rows past the batch are padding.

Targets (each with a graphs engine with overlap on, one with it off, and an eager serial one):
  cpu                 in CI: the CPU backend (torch attention, the C++ decode), float32, and
                      simulated graphs (compiler.compilation.capture.SimulatedGraphSet: each replay runs the
                      graph body over the static buffers, eager forward): the driving logic, the
                      bucketing and the padding exactly as on a GPU, with a GPU's default
                      settings (overlap on, graph buckets, chunked prefill)
  torch, cutlass_v1, cutlass_v2 (gpu)   a tiny Llama (head_dim 64, so the CUTLASS kernels can
                      take it) in bfloat16, real CUDA graphs, once per attention backend and
                      kernel generation
Failures print the numbers needed to diagnose them (max |diff|, scale, the bucket, the key).
"""

from __future__ import annotations

import pytest
import torch

from compiler.compilation.capture import bucket_for, compile_count, graph_ctx
from engine.core.params import SamplingParams
from engine.layers.attention.base import AttentionMetadata
from engine.runtime.llm_engine import LLMEngine
from tests.support.cuda_graph import (  # noqa: F401 (names the tests here use)
    MAX_MODEL_LEN,
    MAX_STEPS,
    NEAR_TIE,
    REL_TOL,
    SIZES,
    TARGETS,
    make_model,
    settings,
    skip_unless_kernels_built,
)


class ReplayChecker:
    """Wraps a graph runner's `replay`: after each replay, the same decode step eagerly over the
    same static buffers; logits compared, tokens checked, padding rows checked. Every replay's
    (rows, bucket, max |diff|, scale) is kept in `seen`."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self.graph_runner = engine.core.runner.graph_runner
        self._replay = self.graph_runner.replay
        self.graph_runner.replay = self  # (the runner calls graph_runner.replay(step))
        self.seen: list[dict] = []
        # Off while a test compares whole generations: the eager check writes the step's K/V again,
        # with eager rounding, which would pull the graphs' tokens towards eager's.
        self.active = True

    def __call__(self, step):
        hidden, tokens = self._replay(step)
        if self.active:
            self.seen.append(self._check(step, hidden, tokens))
        return hidden, tokens

    def _check(self, step, graph_hidden, graph_tokens) -> dict:
        engine = self.engine
        runner = engine.core.runner
        buf = runner.buffers
        n = len(step.rows)
        max_len = int(buf.seq_lens[:n].max())
        bucket = bucket_for(n, SIZES)
        want_key = (bucket, graph_ctx(max_len, engine.max_model_len, self.graph_runner.device_reads_lengths))
        assert step.graph_key == want_key, (step.graph_key, n, max_len)
        logits, tokens = engine.core.model.compute_logits(graph_hidden[:n]), graph_tokens[:n].clone()
        # rows past the batch are padding on the device: they wrote and read nothing
        assert (buf.seq_lens[n:bucket] == 0).all().item() and (buf.slot_mapping[n:bucket] == -1).all().item(), (
            f"stale rows not masked: seq_lens {buf.seq_lens[n:bucket].tolist()}, "
            f"slots {buf.slot_mapping[n:bucket].tolist()}"
        )
        meta = AttentionMetadata(
            slot_mapping=buf.slot_mapping[:n],
            query_start_loc=buf.query_start_loc[: n + 1],
            seq_lens=buf.seq_lens[:n],
            block_tables=buf.block_tables[:n],
            max_query_len=1,
            max_seq_len=max_len,
            num_decodes=n,
        )
        hidden = engine.core.model.forward(
            buf.input_ids[:n], buf.positions[:n], runner.kv_cache.tensor, meta, runner.builder.features.context(n)
        )  # eager
        ref = engine.core.model.compute_logits(hidden)
        assert torch.isfinite(logits).all(), f"non-finite logits from the bucket-{bucket} graph"
        diff = (logits - ref).abs().max().item()
        scale = ref.abs().max().item()
        assert diff <= REL_TOL * scale + 1e-2, (
            f"bucket {bucket} (batch {n}, key {step.graph_key}): graph vs eager logits max |diff| {diff:.4f}, "
            f"max |logit| {scale:.3f}"
        )
        assert torch.equal(tokens, logits.argmax(-1))
        top2 = ref.topk(2, dim=-1).values
        clear = (top2[:, 0] - top2[:, 1]) > 2 * (REL_TOL * scale + 1e-2)
        assert torch.equal(tokens[clear], ref.argmax(-1)[clear]), f"bucket {bucket}: argmax differs away from ties"
        return {"rows": n, "bucket": bucket, "key": step.graph_key, "diff": diff, "scale": scale}

    def count(self, rows: int, since: int = 0) -> int:
        return sum(1 for s in self.seen[since:] if s["rows"] == rows)


@pytest.fixture(
    scope="module",
    params=[
        "cpu",
        pytest.param("torch", marks=pytest.mark.gpu),
        pytest.param("cutlass_v1", marks=pytest.mark.gpu),
        pytest.param("cutlass_v2", marks=pytest.mark.gpu),
    ],
)
def engines(request, tmp_path_factory):
    """{"overlap": graphs engine (async_scheduling on), "serial": graphs engine (off), "eager": the
    reference (enforce_eager, serial)}, each graphs engine with its ReplayChecker as `.checker`."""
    target = request.param
    model = make_model(tmp_path_factory.mktemp("tiny-hd64"))
    cache = tmp_path_factory.mktemp("compile-cache")
    if TARGETS[target][2] == "cutlass":
        skip_unless_kernels_built(model, target, cache)
    made = {"eager": LLMEngine.from_settings(settings(model, target, cache, overlap=False, enforce_eager=True))}
    for name, overlap in (("overlap", True), ("serial", False)):
        engine = LLMEngine.from_settings(settings(model, target, cache, overlap=overlap, enforce_eager=False))
        assert engine.core.async_scheduling is overlap and engine.core.backend.name == TARGETS[target][2]
        if target == "cpu":
            # Simulated graphs over the eager forward: padded steps and full-width block tables, as
            # the compiled forward takes them (compiling it on the CPU costs minutes: tests/compiler/test_compile.py).
            engine.core.runner.builder.compiled = True
            engine.core.runner.capture_graphs(SIZES, device_reads_lengths=False, simulate=True)
        engine.checker = ReplayChecker(engine)
        made[name] = engine
    made["target"] = target
    return made


OVERLAP = pytest.mark.parametrize("mode", ["overlap", "serial"])


def _params(max_tokens: int, logprobs: int | None = None) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, detokenize=False, logprobs=logprobs)


def _prompts(n: int, seed: int, lo: int = 3, hi: int = 60) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(5, 500, (int(ln),), generator=g).tolist() for ln in torch.randint(lo, hi, (n,), generator=g)]


def step_until_replayed(engine, rows: int, times: int) -> None:
    """engine.step() until the checker has seen `times` more replays of `rows`-row decode steps."""
    checker = engine.checker
    mark = len(checker.seen)
    for _ in range(MAX_STEPS):
        if checker.count(rows, mark) >= times:
            return
        engine.step()
    raise AssertionError(
        f"no {times} replays of {rows} rows in {MAX_STEPS} steps; replays seen: "
        f"{[s['rows'] for s in checker.seen[mark:]]}"
    )


def drain(engine) -> None:
    """Step until nothing is left: no request and, with overlap on, no launched step unprocessed."""
    for _ in range(MAX_STEPS):
        if not engine.core.has_unfinished_requests():
            break
        engine.step()
    engine.core.check_integrity()
    assert engine.core.is_idle_and_free(), "requests, a step in flight or KV blocks left"


def _abort(engine, ids) -> None:
    for rid in ids:
        engine.abort_request(rid)


@OVERLAP
def test_startup_captures_every_bucket(engines, mode):
    graphs, eager = engines[mode], engines["eager"]
    gr = graphs.core.runner.graph_runner
    assert gr is not None and eager.core.runner.graph_runner is None
    ctx0 = graph_ctx(1, graphs.max_model_len, gr.device_reads_lengths)
    assert {(b, ctx0) for b in SIZES} <= set(gr.graphs.graphs), sorted(gr.graphs.graphs)
    if engines["target"] != "cpu":  # (the CPU's graphs are simulated, captured after start-up)
        assert graphs.core.compile_seconds > 0 and graphs.core.capture_seconds > 0
        print(f"compile {graphs.core.compile_seconds:.1f}s, capture {graphs.core.capture_seconds:.2f}s")


@OVERLAP
def test_every_bucket_replay_matches_eager(engines, mode):
    graphs = engines[mode]
    for b in SIZES:
        # seed 16: 590 prompt tokens over the 512-token budget, so the prefill is chunked and the
        # first decode rows ride in a mixed step before the batch decodes as one
        ids = [graphs.add_request(p, _params(200)).request_id for p in _prompts(b, seed=b)]
        step_until_replayed(graphs, b, 2)
        _abort(graphs, ids)
        drain(graphs)
    assert {s["bucket"] for s in graphs.checker.seen} >= set(SIZES)


@OVERLAP
def test_shrink_and_grow_replays_right_bucket(engines, mode):
    graphs = engines[mode]
    seen = graphs.checker.seen
    ids = [graphs.add_request(p, _params(200)).request_id for p in _prompts(8, seed=21)]
    step_until_replayed(graphs, 8, 1)
    _abort(graphs, ids[5:])
    mark = len(seen)
    step_until_replayed(graphs, 5, 2)  # 5 left: bucket 8 with 3 stale rows from the earlier steps
    assert [s["bucket"] for s in seen[mark:] if s["rows"] == 5][:2] == [8, 8]
    ids = ids[:5] + [graphs.add_request(p, _params(200)).request_id for p in _prompts(6, seed=22)]
    mark = len(seen)
    step_until_replayed(graphs, 11, 1)  # grows into bucket 16
    assert next(s["bucket"] for s in seen[mark:] if s["rows"] == 11) == 16
    _abort(graphs, ids[1:])
    step_until_replayed(graphs, 1, 1)  # the one-token graph
    _abort(graphs, ids[:1])
    drain(graphs)


def _drive(engine, plan, logprobs=None):
    done, step = {}, 0
    while engine.core.has_unfinished_requests() or any(k >= step for k in plan):
        for i, (prompt, max_tokens) in enumerate(plan.get(step, [])):
            engine.add_request(prompt, _params(max_tokens, logprobs), request_id=f"s{step}-{i}")
        for out in engine.step():
            if out.finished:
                done[out.request_id] = (out.outputs[0].token_ids, out.outputs[0].logprobs)
        step += 1
        assert step < 2000
    return done


@OVERLAP
def test_greedy_tokens_graphs_equal_eager(engines, mode):
    graphs, eager = engines[mode], engines["eager"]
    prompts = _prompts(20, seed=5)
    prompts[3] = _prompts(1, seed=99, lo=240, hi=241)[0]  # crosses max_seq_len 256 while decoding
    at = [0] * 6 + [1, 1, 3, 3, 3, 7, 12, 12, 20, 20, 31, 31, 40, 55]
    plan: dict[int, list] = {}
    for i, (p, t) in enumerate(zip(prompts, at)):
        plan.setdefault(t, []).append((p, 40 if i == 3 else 5 + (i * 7) % 31))
    gr = graphs.core.runner.graph_runner
    if "want" not in engines:  # the eager reference, once for both modes
        engines["want"] = _drive(eager, plan, logprobs=1)
        drain(eager)
    want = engines["want"]
    replays, compiles = gr.num_replays, compile_count()
    graphs.checker.active = False
    try:
        got = _drive(graphs, plan)
    finally:
        graphs.checker.active = True
    assert compile_count() == compiles, "Dynamo recompiled while serving"
    assert gr.num_replays - replays > 50
    if not gr.device_reads_lengths:  # the long sequence needed a graph with a longer context
        assert any(key[1] == 512 for key in gr.replayed), sorted(gr.replayed)
    assert set(got) == set(want)
    ties = []
    for rid, (tokens, lps) in want.items():
        mine = got[rid][0]
        k = next((i for i, (a, b) in enumerate(zip(tokens, mine)) if a != b), None)
        if k is None:
            assert len(tokens) == len(mine)
            continue
        top = sorted(lps[k].values(), reverse=True)
        assert len(top) >= 2 and top[0] - top[1] < NEAR_TIE, (
            f"{rid}: graphs and eager differ at output {k} ({mine[k]} vs {tokens[k]}) without a near-tie: {lps[k]}"
        )
        ties.append((rid, k))
    assert len(ties) <= len(want) // 4, f"too many divergences (near-ties): {ties}"
    drain(graphs)


@pytest.mark.parametrize("engines", ["cpu"], indirect=True)  # a check of the test itself: once, on the CPU
def test_the_checker_catches_unmasked_padding_rows(engines, monkeypatch):
    """The checks can fail: with the padding of a graph's spare rows broken, the first replay of a
    shrunk batch (bucket 8, 5 rows) reports the stale rows."""
    graphs = engines["serial"]
    buf = graphs.core.runner.buffers
    real = buf.fill_padding
    ids = [graphs.add_request(p, _params(50)).request_id for p in _prompts(8, seed=31)]
    step_until_replayed(graphs, 8, 1)
    _abort(graphs, ids[5:])
    monkeypatch.setattr(buf, "fill_padding", lambda t, n, extra, q=1: real(t, n, 0, q))  # pads no row
    with pytest.raises(AssertionError, match="stale rows not masked"):
        step_until_replayed(graphs, 5, 1)
    monkeypatch.setattr(buf, "fill_padding", real)
    _abort(graphs, ids[:5])
    drain(graphs)
