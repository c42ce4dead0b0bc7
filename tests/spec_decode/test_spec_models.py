"""Speculative decoding with a draft model and with EAGLE / EAGLE-3 heads: greedy and seeded
outputs equal plain decoding token for token (with penalties, logprobs, LoRA, mixed batches,
preemption by swap and by recompute, prefix-cache hits), the drafts are exactly what the draft
model or head predicts (checked against transformers and a reference head), sampled output
follows the target's distribution, draft lengths adapt, misfit heads are refused, and block
accounting holds after every step."""

from __future__ import annotations

import dataclasses
import json
import shutil

import pytest
import torch
from safetensors.torch import load_file

from engine import LoRARequest, SamplingParams
from engine.spec_decode.sched.decoder import SpecDecoder
from engine.training.eagle_head import TrainableEagle, random_eagle
from tests.support.engine import run_checked
from tests.support.spec_models import METHODS, PROMPTS, K, spec_settings, target_weights, with_draft_vocab
from tests.support.stats import chi_square_p


def _outputs(llm, prompts, params):
    return [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]


@pytest.mark.parametrize("method,draft", METHODS)
def test_greedy_equals_plain_decoding_in_mixed_batches(spec_models, make_llm, method, draft):
    """Prompts of several lengths prefill in chunks beside decodes and verify steps (a small
    token budget); every step is checked for block accounting."""
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    common = dict(max_num_seqs=8, max_num_batched_tokens=24)
    want = [o.token_ids for o in _outputs(make_llm(spec_models["target"], **common), PROMPTS, params)]
    engine = make_llm(spec_models["target"], **common, **spec_settings(spec_models, method, draft)).engine
    for i, p in enumerate(PROMPTS):
        engine.add_request(p, params, f"r{i}")
    got = run_checked(engine)
    assert [got[f"r{i}"].outputs[0].token_ids for i in range(len(PROMPTS))] == want
    assert engine.core.scheduler.num_draft_tokens > 0


def test_perfect_draft_keeps_every_draft_and_stops_inside_a_run(spec_models, make_llm):
    """The target as its own draft: every draft is kept, each verify step adds K + 1 tokens, and
    max_tokens / a stop token inside a run end the output where plain decoding ends it."""
    target = spec_models["target"]
    plain, spec = make_llm(target), make_llm(target, **spec_settings(spec_models, "draft_model", "target"))
    greedy = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    want = _outputs(plain, PROMPTS[:3], greedy)
    got = _outputs(spec, PROMPTS[:3], greedy)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    sched = spec.engine.core.scheduler
    assert sched.num_accepted_tokens == sched.num_draft_tokens > 0
    assert sched.spec.num_accepted_per_pos == sched.spec.num_drafts_per_pos
    stop_at = want[0].token_ids[13]  # a token inside the 4th run of K + 1
    params = SamplingParams(temperature=0, max_tokens=30, stop_token_ids=[stop_at])
    assert [(o.token_ids, o.finish_reason) for o in _outputs(spec, PROMPTS[:1], params)] == [
        (o.token_ids, o.finish_reason) for o in _outputs(plain, PROMPTS[:1], params)
    ]


# A small pool (sequences are swapped out and back) and a second run of the same prompts (prefix
# hits): the draft's KV must survive both, block for block with the target's.
TIGHT = dict(
    max_num_batched_tokens=16,
    num_gpu_blocks=9,
    block_size=8,
    max_model_len=64,
    preemption_mode="swap",
    swap_space_gb=0.01,
)


def _run_twice(llm, params):
    _outputs(llm, PROMPTS[6:8] + PROMPTS[:2], params)
    assert llm.engine.core.scheduler.num_preemptions > 0
    _outputs(llm, PROMPTS[6:7], params)
    hits = llm.engine.core.pool.counters.prefix_hits
    _outputs(llm, PROMPTS[6:7], params)
    assert llm.engine.core.pool.counters.prefix_hits > hits


@pytest.mark.parametrize("overlap", [False, True], ids=["serial", "overlap"])
def test_draft_model_drafts_are_its_own_greedy_continuation(spec_models, make_llm, monkeypatch, overlap):
    """Every draft of a greedy request is what transformers' draft model says after the
    sequence (and the drafts before it): the draft's KV in kiln's block tables is right, also
    after a swap, on prefix-cache hits, and when a verify step's successor was launched before
    its results were known (overlap scheduling: the device moves the successor's positions)."""
    from transformers import AutoModelForCausalLM

    seen = _record_drafts(monkeypatch)
    llm = make_llm(
        spec_models["target"], **TIGHT, async_scheduling=overlap, **spec_settings(spec_models, "draft_model", "small")
    )
    _run_twice(llm, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
    hf = AutoModelForCausalLM.from_pretrained(str(spec_models["small"]), dtype=torch.float32).eval()
    with torch.no_grad():
        for tokens, drafts in seen:
            ids = torch.tensor([tokens])
            out = hf.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=len(drafts),
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
            )
            assert drafts == out[0, len(tokens) :].tolist()
    assert len(seen) > 10


def test_draft_vocabulary_drafts_the_argmax_of_its_rows(spec_models, make_llm, monkeypatch):
    """A draft model with a draft vocabulary drafts, at every step, the argmax of its logits over
    those token ids only (transformers' draft model, masked), and greedy output stays plain
    decoding's."""
    from transformers import AutoModelForCausalLM

    seen = _record_drafts(monkeypatch)
    greedy = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    want = [o.token_ids for o in _outputs(make_llm(spec_models["target"]), PROMPTS[:4], greedy)]
    llm = make_llm(spec_models["target"], **spec_settings(spec_models, "draft_model", "noisy_vocab"))
    assert [o.token_ids for o in _outputs(llm, PROMPTS[:4], greedy)] == want
    hf = AutoModelForCausalLM.from_pretrained(str(spec_models["noisy"]), dtype=torch.float32).eval()
    odd = torch.zeros(hf.config.vocab_size)
    odd[1::2] = -float("inf")
    with torch.no_grad():
        for tokens, drafts in seen:
            ids, expect = list(tokens), []
            for _ in drafts:
                expect.append(int((hf(torch.tensor([ids])).logits[0, -1] + odd).argmax()))
                ids.append(expect[-1])
            assert drafts == expect
    assert len(seen) > 10 and all(t % 2 == 0 for _, drafts in seen for t in drafts)
    sched = llm.engine.core.scheduler
    assert 0 < sched.num_accepted_tokens < sched.num_draft_tokens


@pytest.mark.parametrize("version,overlap", [(1, False), (3, False), (3, True)])
def test_eagle_drafts_equal_the_reference_head(spec_models, make_llm, monkeypatch, version, overlap):
    """The drafts kiln's head makes equal a reference implementation of the same checkpoint
    (engine/training/eagle_head.py's TrainableEagle, over transformers' hidden states of the
    target): features, the token shift, positions, the head's KV and the chain all line up,
    also after a swap and on prefix-cache hits. (A sequence just swapped back in has no seed
    and drafts poorly: its first drafts are left out.)"""
    from transformers import AutoModelForCausalLM

    name = "eagle" if version == 1 else "eagle3"
    llm = make_llm(spec_models["target"], **TIGHT, async_scheduling=overlap, **spec_settings(spec_models, name, name))
    seen = _record_drafts(monkeypatch, llm.engine.core.runner.spec)
    _run_twice(llm, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
    config = json.loads((spec_models[name] / "config.json").read_text())
    cfg, embed, head = target_weights(spec_models["target"])
    ref = TrainableEagle(config, version, embed, head, cfg["hidden_size"])
    ref.load_state_dict(load_file(str(spec_models[name] / "model.safetensors")))
    hf = AutoModelForCausalLM.from_pretrained(str(spec_models["target"]), dtype=torch.float32).eval()
    aux = config.get("eagle_aux_hidden_state_layer_ids")
    with torch.no_grad():
        for tokens, drafts in seen:
            hs = hf(torch.tensor([tokens]), output_hidden_states=True).hidden_states
            feats = hs[-1] if version == 1 else torch.cat([hs[i] for i in aux], dim=-1)
            assert drafts == _reference_chain(ref, tokens, feats[:, : len(tokens) - 1], len(drafts))
    assert len(seen) > 10


def _reference_chain(ref, tokens, feats, k):
    """Greedy drafts of a reference head: row p reads (feature p, token p + 1); each later step
    reads the head's own output and the token it drafted."""
    ids, out = torch.tensor([tokens[1:]]), []
    for _ in range(k):
        h = ref.step(ids, feats, torch.arange(ids.shape[1])[None])
        logits = ref.logits(h[:, -1])[0]
        token = int(logits.argmax())
        if ref.version == 3:
            token += int(ref.d2t[token])
        out.append(token)
        own = h[:, -1:] if ref.version == 1 else h[:, -1:]
        feats = torch.cat([feats if feats.shape[-1] == own.shape[-1] else ref.fc(feats), own], dim=1)
        ids = torch.cat([ids, torch.tensor([[token]])], dim=1)
    return out


def _record_drafts(monkeypatch, eagle=None):
    """(tokens, drafts) of every verify step (an EAGLE head's: only those drafted from a seed; a
    sequence's verify steps are proposed and processed in the same order)."""
    seen = []
    seeded: dict[int, list[bool]] = {}
    if eagle is not None:
        propose = eagle.propose

        def proposing(sched, target):
            proposal = propose(sched, target)
            for v in proposal.seqs if proposal is not None else []:
                seeded.setdefault(v.record.seq_id, []).append(v.record.seq_id not in eagle.unseeded)
            return proposal

        monkeypatch.setattr(eagle, "propose", proposing)
    accept = SpecDecoder.accept_launched

    def recording(self, seq, drafts, sampled, kv):
        if eagle is None or seeded[seq.seq_id].pop(0):
            seen.append((seq.token_ids[: len(seq.token_ids) - seq.num_pending], list(drafts)))
        return accept(self, seq, drafts, sampled, kv)

    monkeypatch.setattr(SpecDecoder, "accept_launched", recording)
    return seen


def test_periodic_eagle_head_is_accepted_and_exact(spec_models, make_llm):
    """A head that knows the periodic model keeps most drafts, so the seeds come from every row
    of the verify steps; seeded sampling (which breaks the cycle now and then) is still plain
    decoding's, token for token."""
    periodic = spec_models["periodic"]
    spec = dict(
        speculative_method="eagle", speculative_model=str(spec_models["periodic_eagle"]), num_speculative_tokens=4
    )
    for params in (
        SamplingParams(temperature=0, max_tokens=40, ignore_eos=True),
        SamplingParams(temperature=1.0, seed=5, max_tokens=40, ignore_eos=True),
    ):
        want = [o.token_ids for o in _outputs(make_llm(periodic, max_num_seqs=8), PROMPTS, params)]
        llm = make_llm(periodic, max_num_seqs=8, **spec)
        assert [o.token_ids for o in _outputs(llm, PROMPTS, params)] == want
        sched = llm.engine.core.scheduler
        assert sched.num_accepted_tokens > 0.5 * sched.num_draft_tokens > 0
        per_pos = sched.spec.num_accepted_per_pos
        assert per_pos == sorted(per_pos, reverse=True) and per_pos[-1] > 0


@pytest.mark.parametrize("method,draft", METHODS[::2] + [("eagle3", "eagle3")])
def test_seeded_sampling_with_penalties_logprobs_and_lora(spec_models, make_llm, method, draft):
    """Seeded sampling at temperature 1 with penalties, logprobs and a LoRA adapter on the target:
    tokens, logprobs and cumulative logprobs equal plain decoding's."""
    from tests.support.lora import _make_adapter

    adapter = _make_adapter(
        spec_models["target"], spec_models["target"].parent / f"lora-{method}", ["q_proj", "v_proj"], 4, 1
    )
    lora = LoRARequest("a", 1, adapter)
    params = SamplingParams(
        temperature=1.0,
        seed=11,
        max_tokens=20,
        ignore_eos=True,
        logprobs=2,
        repetition_penalty=1.2,
        frequency_penalty=0.3,
    )
    settings = dict(max_num_seqs=8, enable_lora=True, max_loras=1, max_lora_rank=8)
    plain = make_llm(spec_models["target"], **settings)
    spec = make_llm(spec_models["target"], **settings, **spec_settings(spec_models, method, draft))
    for llm in (plain, spec):
        llm.outs = [o.outputs[0] for o in llm.generate(PROMPTS, params, use_tqdm=False, lora_request=lora)]
    for a, b in zip(plain.outs, spec.outs):
        assert b.token_ids == a.token_ids
        assert b.cumulative_logprob == pytest.approx(a.cumulative_logprob, abs=1e-3)
        assert [sorted(e) for e in b.logprobs] == [sorted(e) for e in a.logprobs]
    assert spec.engine.core.scheduler.num_draft_tokens > 0


@pytest.mark.parametrize("mode,method,draft", [("swap", "draft_model", "small"), ("recompute", "eagle3", "eagle3")])
def test_preemption_and_prefix_hits(spec_models, make_llm, mode, method, draft):
    """A pool too small for the batch: sequences are preempted (their draft KV swapped or
    recomputed with the target's) and come back. Outputs equal plain decoding's. (The drafts'
    exactness after swaps and on prefix hits: the reference tests above.)"""
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    prompts = PROMPTS + PROMPTS[:4]
    want = [o.token_ids for o in _outputs(make_llm(spec_models["target"], max_num_seqs=16), prompts, params)]
    llm = make_llm(
        spec_models["target"],
        max_num_seqs=16,
        num_gpu_blocks=40,
        block_size=8,
        max_model_len=128,
        preemption_mode=mode,
        swap_space_gb=0.01 if mode == "swap" else 0,
        **spec_settings(spec_models, method, draft),
    )
    engine = llm.engine
    for i, p in enumerate(prompts):
        engine.add_request(p, params, f"r{i}")
    got = run_checked(engine)
    assert [got[f"r{i}"].outputs[0].token_ids for i in range(len(prompts))] == want
    assert engine.core.scheduler.preemptions_by_mode.get(mode, 0) > 0


@pytest.mark.parametrize("draft", ["noisy", "noisy_vocab"])
def test_sampled_output_follows_the_target(spec_models, make_llm, draft):
    """Unseeded sampling (temperature 1, top-p 0.9) with a sampled draft (rejection sampling with
    its q): the second token, the first one verified (one draft), is distributed as the target
    says (chi-square against transformers' exact marginal, significance 1e-3; the engine's seed is
    fixed, so CI draws the same). engine/spec_decode/rejection.py's own tests cover more
    settings, chains of drafts, and a broken rule failing."""
    params = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=3, ignore_eos=True)
    from transformers import AutoModelForCausalLM

    from engine.spec_decode.rejection import DraftRow
    from engine.worker.sample.distributions import processed_probs

    prompt = [5, 9, 100, 200, 7]
    llm = make_llm(
        spec_models["target"], max_num_seqs=64, seed=3, **spec_settings(spec_models, "draft_model", draft, 1)
    )
    many = dataclasses.replace(params, n=64)
    outs = llm.generate([prompt] * 40, many, use_tqdm=False)
    second = torch.tensor([c.token_ids[1] for o in outs for c in o.outputs])
    sched = llm.engine.core.scheduler
    assert 0 < sched.num_accepted_tokens < sched.num_draft_tokens  # both branches of the rule ran
    if draft == "noisy_vocab":  # the target's odd tokens come from the residual alone (q is 0 there)
        assert (second % 2 == 1).any()
    hf = AutoModelForCausalLM.from_pretrained(str(spec_models["target"]), dtype=torch.float32).eval()
    with torch.no_grad():
        first = hf(torch.tensor([prompt])).logits[0, -1:]
        rows = [DraftRow(params, 0, 0)]
        p1 = processed_probs(first, rows, [False])[0]
        p1 = p1 / p1.sum()
        vocab = p1.shape[0]
        batch = torch.tensor([prompt + [t] for t in range(vocab)])
        p2 = processed_probs(hf(batch).logits[:, -1], rows * vocab, [False] * vocab)
        p2 = p2 / p2.sum(-1, keepdim=True)
    marginal = (p1[:, None] * p2).sum(0)
    assert chi_square_p(torch.bincount(second, minlength=vocab), marginal) > 1e-3


def test_draft_length_adapts_per_sequence(spec_models, make_llm):
    """A draft the target always follows drafts K every step; one it never follows backs off to
    few verify steps (a random head on a periodic target)."""
    greedy = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
    good = make_llm(spec_models["target"], **spec_settings(spec_models, "draft_model", "target", 4))
    _outputs(good, PROMPTS[:2], greedy)
    s = good.engine.core.scheduler.spec
    assert s.num_draft_tokens >= 4 * s.num_drafts - 2 * 3  # (fewer only where max_tokens leaves less room)
    bad = make_llm(spec_models["target"], **spec_settings(spec_models, "draft_model", "small", 4))
    _outputs(bad, PROMPTS[:2], greedy)
    s = bad.engine.core.scheduler.spec
    assert s.num_accepted_tokens <= 0.1 * s.num_draft_tokens
    assert s.num_drafts < 0.4 * 2 * 60, f"{s.num_drafts} verify steps for 120 tokens: no back-off"
    assert s.num_draft_tokens < 2 * s.num_drafts  # mostly one-draft probes


def test_misfit_heads_and_drafts_are_refused(spec_models, make_llm, tmp_path):
    cfg, embed, head = target_weights(spec_models["target"])
    wide = dict(cfg, hidden_size=2 * cfg["hidden_size"])
    random_eagle(
        tmp_path / "wide",
        wide,
        torch.zeros(cfg["vocab_size"], 2 * cfg["hidden_size"]),
        torch.zeros(cfg["vocab_size"], 2 * cfg["hidden_size"]),
        1,
    )
    cases = [
        (("eagle", tmp_path / "wide"), "no embeddings of its own"),
        (("eagle", spec_models["eagle3"]), "an EAGLE-3 head"),
        (("eagle3", spec_models["eagle"]), "not an EAGLE-3 head"),
    ]
    shallow = tmp_path / "shallow"
    shutil.copytree(spec_models["eagle3"], shallow)
    config = json.loads((shallow / "config.json").read_text())
    config["eagle_aux_hidden_state_layer_ids"] = [0, 1, 7]
    (shallow / "config.json").write_text(json.dumps(config))
    cases.append((("eagle3", shallow), "target has 2 layers"))
    from engine.models.tiny_model import make_tiny_model

    other = make_tiny_model(tmp_path / "other-vocab", seed=3, overrides=dict(vocab_size=300))
    cases.append((("draft_model", other), "does not cover the target's tokenizer"))
    for name, ids, message in [
        ("unsorted", [5, 3], "ascending"),
        ("outside", [1, 10**6], "outside the vocabulary"),
        ("empty", [], "must list token ids"),
    ]:
        cases.append((("draft_model", with_draft_vocab(spec_models["noisy"], tmp_path / name, ids)), message))
    for (method, path), message in cases:
        with pytest.raises(ValueError, match=message):
            make_llm(
                spec_models["target"], speculative_method=method, speculative_model=str(path), num_speculative_tokens=2
            )


def test_settings_and_metrics(spec_models, make_llm, caplog):
    import logging
    import time

    from prometheus_client import generate_latest

    from engine.config.settings import EngineSettings
    from engine.entrypoints.openai.metrics import EngineMetrics

    s = EngineSettings(speculative_config={"method": "eagle3", "model": "/x", "num_speculative_tokens": 3})
    assert (s.speculative_method, s.speculative_model, s.num_speculative_tokens) == ("eagle3", "/x", 3)
    with pytest.raises(ValueError, match="needs speculative_model"):
        EngineSettings(speculative_method="draft_model", num_speculative_tokens=2)
    llm = make_llm(spec_models["target"], **spec_settings(spec_models, "draft_model", "noisy"))
    _outputs(llm, PROMPTS[:3], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
    spec = llm.engine.core.scheduler.spec
    assert sum(spec.num_accepted_per_pos) == spec.num_accepted_tokens > 0
    metrics = EngineMetrics("m", log_stats_interval=1e-9)
    metrics._log_prev["t"] -= 1
    llm.engine.add_request(PROMPTS[0], SamplingParams(max_tokens=2), "unfinished")  # (so the line is logged)
    with caplog.at_level(logging.INFO, logger="engine.entrypoints.openai.stats"):
        metrics.on_step(llm.engine, [], time.monotonic())
    text = generate_latest(metrics.registry).decode()
    first = spec.num_accepted_per_pos[0]
    assert f'kiln:spec_decode_num_accepted_tokens_per_pos_total{{model_name="m",position="0"}} {float(first)}' in text
    mean = 1 + spec.num_accepted_tokens / spec.num_drafts
    assert f"mean acceptance length {mean:.2f}" in caplog.text
    llm.engine.abort_request("unfinished")


def _simulated_graphs(engine, sizes=(1, 2, 4)):
    """Every runner of the engine (the target's, the draft model's or head's) replays its decode
    and verify steps as graphs, simulated on the CPU (the body runs again over the static
    buffers: compiler/compilation/capture.py SimulatedGraphSet) with the compiled runner's padding."""
    runners = [(engine.core.runner, 1 + K)]
    if engine.core.draft_runner is not None:
        runners.append((engine.core.draft_runner, 1 if engine.settings.speculative_method == "draft_model" else 1 + K))
    for runner, max_query in runners:
        runner.builder.compiled = True  # (full-width tables, padded steps: what graphs read; the forward stays eager)
        runner.capture_graphs(list(sizes), device_reads_lengths=False, simulate=True, max_query=max_query)
    return [r for r, _ in runners]


class GraphSpy:
    """Wraps a runner's graph replays: each verify replay's key and its real sequences' token
    counts (read off the host staging: rows with a length), and whether the model's
    compute_logits ran inside a replay (a proposer's graphs hold no logits)."""

    def __init__(self, runner) -> None:
        self.runner, self.replays, self.logits_in_graph, self.logits_calls = runner, [], 0, 0
        self._replay, self._inside = runner.graph_runner.replay, False
        runner.graph_runner.replay = self.replay
        self._logits = runner.model.compute_logits
        runner.model.compute_logits = self.compute_logits

    def replay(self, step):
        key = step.graph_key
        if len(key) == 3:
            buf = self.runner.buffers
            starts, lens = buf.np_query_start_loc[: key[0] + 1], buf.np_seq_lens[: key[0]]
            self.replays.append((key, [int(starts[i + 1] - starts[i]) for i in range(key[0]) if lens[i] > 0]))
        self._inside = True
        try:
            return self._replay(step)
        finally:
            self._inside = False

    def compute_logits(self, *args, **kw):
        self.logits_calls += 1
        self.logits_in_graph += self._inside
        return self._logits(*args, **kw)


@pytest.mark.parametrize(
    "method,draft,overlap,k",
    [
        ("draft_model", "noisy", False, K),
        ("draft_model", "target", True, K),
        ("draft_model", "noisy", True, 4),  # draft lengths adapt: they differ between sequences
        ("eagle", "eagle", False, K),
        ("eagle3", "eagle3", True, K),
    ],
)
def test_draft_and_verify_steps_replay_graphs(spec_models, make_llm, method, draft, overlap, k):
    """With graphs (simulated), verify steps replay the target's verify graphs (keyed (rows, ctx,
    q), every q = 2..1 + drafts captured at start-up and none later; sequences with fewer drafts
    than q in one step, the adaptive lengths, replay the q graph too; a verify graph has at least
    two rows), the draft model's forwards and the head's drafting steps replay their own graphs,
    which compute no logits (the proposer computes them once), and the output is plain eager
    decoding's."""
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    prompts = PROMPTS[:4]
    want = [o.token_ids for o in _outputs(make_llm(spec_models["target"]), prompts, params)]
    llm = make_llm(
        spec_models["target"], async_scheduling=overlap, max_num_seqs=4, **spec_settings(spec_models, method, draft, k)
    )
    target, drafter = _simulated_graphs(llm.engine)
    ctx = target.graph_runner.key_for(1, 1)[1]
    captured = set(target.graph_runner.graphs.graphs)
    assert {(r, ctx, q) for r in (2, 4) for q in range(2, K + 2)} <= captured, sorted(captured)
    assert not any(key[0] < 2 for key in captured if len(key) == 3)
    spy, drafter_spy = GraphSpy(target), GraphSpy(drafter)
    assert [o.token_ids for o in _outputs(llm, prompts, params)] == want
    assert set(target.graph_runner.graphs.graphs) == captured  # (nothing captured mid-serving)
    assert spy.replays and all(key[2] >= 2 and max(qs) <= key[2] for key, qs in spy.replays), spy.replays
    assert drafter.graph_runner.num_replays > 0 and not drafter.graph_runner.logits
    assert drafter_spy.logits_in_graph == 0 and drafter_spy.logits_calls > 0
    assert spy.logits_in_graph == target.graph_runner.num_replays  # (the target's graphs do hold them)
    if k == 4:  # some verify step replayed a graph with sequences of different draft lengths
        assert any(len(set(qs)) > 1 for _, qs in spy.replays), spy.replays
