"""Greedy output equals transformers `generate` token for token (float32, CPU)."""

from __future__ import annotations

import random

import pytest
import torch

from engine import SamplingParams
from tests.support.engine import ARCHS, run_checked
from tests.support.hf_reference import GREEDY, MAX_TOKENS, _prompts, hf_greedy


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_matches_transformers(arch, tiny_models, make_llm):
    model = tiny_models[arch]
    llm = make_llm(model, max_num_seqs=16, kv_cache_dtype="float32")
    prompts = _prompts(llm.engine.model_config.vocab_size)
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    expected = hf_greedy(str(model), prompts, MAX_TOKENS)
    for i, (out, want) in enumerate(zip(outs, expected)):
        assert out.prompt_token_ids == prompts[i]
        assert out.outputs[0].token_ids == want, f"{arch} prompt {i} (len {len(prompts[i])}) diverged"
        assert out.outputs[0].finish_reason == "length"


@pytest.mark.parametrize(
    "variant",
    [
        dict(enable_prefix_caching=False),
        dict(max_num_batched_tokens=32),  # long prompts are chunked across steps
        dict(num_gpu_blocks=24, max_num_seqs=16, max_model_len=256),  # preemption by recompute
        dict(block_size=8, max_num_seqs=3),
        dict(block_size=32),
    ],
)
def test_greedy_matches_under_constraints(variant, tiny_llama, make_llm):
    llm = make_llm(tiny_llama, kv_cache_dtype="float32", **variant)
    prompts = _prompts(llm.engine.model_config.vocab_size)
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    expected = hf_greedy(str(tiny_llama), prompts, MAX_TOKENS)
    assert [o.outputs[0].token_ids for o in outs] == expected
    if "num_gpu_blocks" in variant:
        assert llm.engine.core.scheduler.num_preemptions > 0, "the pool was meant to be too small to avoid preemption"


def test_prefix_cache_hits_give_same_tokens(tiny_llama, make_llm):
    llm = make_llm(tiny_llama, kv_cache_dtype="float32")
    rng = random.Random(3)
    shared = [rng.randrange(5, 500) for _ in range(70)]
    prompts = [shared + [rng.randrange(5, 500) for _ in range(k)] for k in (1, 5, 20)]
    first = llm.generate(prompts, GREEDY, use_tqdm=False)
    queries_before = llm.engine.core.pool.counters.prefix_hits
    second = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert llm.engine.core.pool.counters.prefix_hits > queries_before
    assert [o.outputs[0].token_ids for o in first] == [o.outputs[0].token_ids for o in second]
    assert all(o.num_cached_tokens >= 64 for o in second)
    assert second[0].outputs[0].token_ids == hf_greedy(str(tiny_llama), prompts, MAX_TOKENS)[0]
    assert llm.reset_prefix_cache() > 0  # the idle cached blocks are dropped: nothing is hit again
    third = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert all(o.num_cached_tokens == 0 for o in third[:1])
    assert [o.outputs[0].token_ids for o in third] == [o.outputs[0].token_ids for o in first]
    llm.engine.core.check_integrity()


def test_parallel_samples_share_prompt_blocks(tiny_llama, make_llm):
    llm = make_llm(tiny_llama, enable_prefix_caching=False)
    prompt = list(range(10, 50))  # 40 tokens: 2 full blocks + a shared partial block
    params = SamplingParams(n=4, temperature=1.0, seed=7, max_tokens=6, ignore_eos=True)
    engine = llm.engine
    request = engine.add_request(prompt, params, "fork")
    allocations_at_fork = None
    out = None
    while engine.core.has_unfinished_requests():
        for done in engine.step():
            out = done if done.finished else out
        engine.core.check_integrity()
        if request.forked and allocations_at_fork is None:
            allocations_at_fork = engine.core.pool.counters.allocations
            # 3 prompt blocks shared by all four samples.
            assert all(engine.core.pool.ref_count(b) == 4 for b in request.seqs[0].block_ids[:2])
    # After the fork, each sample copied the partial block at most once (copy-on-write).
    assert engine.core.pool.counters.allocations - allocations_at_fork <= 3
    assert out is not None and out.request_id == "fork"
    assert len(out.outputs) == 4 and all(len(c.token_ids) == 6 for c in out.outputs)
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1, "four samples at temperature 1 all equal"
    # Greedy n=2 gives two identical continuations equal to n=1.
    outs = llm.generate([prompt], SamplingParams(n=2, temperature=0, max_tokens=6, ignore_eos=True), use_tqdm=False)
    single = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), use_tqdm=False)
    assert outs[0].outputs[0].token_ids == outs[0].outputs[1].token_ids == single[0].outputs[0].token_ids


def test_mixed_prefill_and_decode_in_one_step(tiny_llama, make_llm):
    """A step that holds a's decode and a chunk of b's prompt computes both right: each request's
    tokens equal those it gets run alone."""
    llm = make_llm(tiny_llama, max_num_batched_tokens=40)
    prompts = {"a": list(range(5, 25)), "b": list(range(5, 105))}  # b: 100 tokens, chunked
    alone = {rid: llm.generate([p], GREEDY, use_tqdm=False)[0].outputs[0].token_ids for rid, p in prompts.items()}
    llm.reset_prefix_cache()  # (the prompts are computed again, not found)
    engine = llm.engine
    plans = []
    schedule = engine.core.scheduler.schedule

    def recorded():
        plan = schedule()
        seqs = engine.core.scheduler.seqs_by_id
        plans.append([(seqs[s.seq_id].request.request_id, s.num_tokens) for s in plan.seqs])
        return plan

    engine.core.scheduler.schedule = recorded
    engine.add_request(prompts["a"], GREEDY, "a")
    engine.step()  # a's prefill
    engine.add_request(prompts["b"], GREEDY, "b")
    done = run_checked(engine)
    assert [("a", 1), ("b", 39)] in plans, plans  # the decode first, then a prefill chunk
    assert {rid: out.outputs[0].token_ids for rid, out in done.items()} == alone


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_runs_close_to_float32(dtype, tiny_llama, make_llm):
    llm32 = make_llm(tiny_llama)
    llm16 = make_llm(tiny_llama, dtype=dtype)
    prompts = _prompts(512)[:6]
    a = llm32.generate(prompts, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    b = llm16.generate(prompts, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    assert llm16.engine.core.kv_cache.tensor.dtype == getattr(torch, dtype)
    same_first = sum(x.outputs[0].token_ids[0] == y.outputs[0].token_ids[0] for x, y in zip(a, b))
    assert same_first >= 4, "half precision diverged from float32 on most first tokens"


def hf_prompt_logprobs(model_dir, prompt: list[int]) -> torch.Tensor:
    """transformers' log-softmax over the vocabulary at each prompt position [len - 1, vocab]."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.tensor([prompt])).logits[0, :-1].float()
    return logits.log_softmax(-1)


@pytest.mark.parametrize("variant", [dict(), dict(max_num_batched_tokens=32, enable_prefix_caching=True)])
def test_prompt_logprobs_match_transformers(variant, tiny_llama, make_llm):
    """Every prompt token's logprob (and the top 3) as transformers computes them; with chunked
    prefill the chunks' boundaries are scored too, and a cached prefix is recomputed, not skipped."""
    llm = make_llm(tiny_llama, kv_cache_dtype="float32", **variant)
    prompts = [p for p in _prompts(llm.engine.model_config.vocab_size, seed=3) if len(p) in (1, 2, 33, 150)]
    llm.generate([prompts[2]], GREEDY, use_tqdm=False)  # fills the prefix cache with one prompt
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True, prompt_logprobs=3)
    outs = llm.generate(prompts, params, use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        entries = out.prompt_logprobs
        assert len(entries) == len(prompt) and entries[0] is None
        if len(prompt) == 1:
            continue
        want = hf_prompt_logprobs(str(tiny_llama), prompt)
        for pos in range(1, len(prompt)):
            entry, ref = entries[pos], want[pos - 1]
            assert entry[prompt[pos]] == pytest.approx(ref[prompt[pos]].item(), abs=1e-4), f"position {pos}"
            top = ref.topk(3)
            for tok, lp in zip(top.indices.tolist(), top.values.tolist()):
                assert entry[tok] == pytest.approx(lp, abs=1e-4)
            assert len(entry) in (3, 4)  # the prompt token joins the top 3 unless it is one of them
    plain = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert all(o.prompt_logprobs is None for o in plain)


@pytest.mark.parametrize("variant", [dict(), dict(max_num_batched_tokens=32, block_size=8)])
def test_sliding_window_matches_transformers(variant, tmp_path_factory, make_llm):
    """Mistral-style sliding-window attention (window 16, prompts up to 200 tokens): every query
    sees only the last 16 positions, in prefill chunks and in decodes, as transformers masks."""
    from engine.models.tiny_model import make_tiny_model

    path = tmp_path_factory.getbasetemp() / "mistral-window16"
    if not (path / "config.json").is_file():
        make_tiny_model(path, arch="mistral", seed=7, overrides={"sliding_window": 16})
    llm = make_llm(path, max_num_seqs=16, kv_cache_dtype="float32", **variant)
    assert llm.engine.max_model_len == 1024  # the window no longer caps the context
    prompts = _prompts(llm.engine.model_config.vocab_size, seed=5)
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    expected = hf_greedy(str(path), prompts, MAX_TOKENS)
    assert [o.outputs[0].token_ids for o in outs] == expected


@pytest.mark.parametrize("arch", ["gemma2", "gemma3"])
def test_gemma2_and_3_logprobs_match_transformers(arch, tiny_models, make_llm):
    """Gemma 2's capped attention scores and logits, Gemma 3's q/k norms and local rotary base,
    both with windowed and full layers mixed and sandwich norms: prompt logprobs equal
    transformers' (eager) at every position past the window. (Greedy tokens alone would not
    show the caps: tanh keeps the argmax.)"""
    from transformers import AutoModelForCausalLM

    model_dir = tiny_models[arch]
    rng = random.Random(5)
    prompt = [rng.randrange(5, 500) for _ in range(60)]  # longer than the window of 16
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager")
    with torch.no_grad():
        ref = model.eval()(torch.tensor([prompt])).logits[0].log_softmax(-1)
    llm = make_llm(model_dir, max_num_batched_tokens=24, kv_cache_dtype="float32")  # chunked: windows span chunks
    out = llm.generate([prompt], SamplingParams(max_tokens=1, prompt_logprobs=3, temperature=0), use_tqdm=False)[0]
    for i in range(1, len(prompt)):
        entry = out.prompt_logprobs[i]
        assert entry[prompt[i]] == pytest.approx(ref[i - 1, prompt[i]].item(), abs=1e-4), i
        top = ref[i - 1].topk(3)
        assert [entry[int(t)] for t in top.indices] == pytest.approx(top.values.tolist(), abs=1e-4), i
