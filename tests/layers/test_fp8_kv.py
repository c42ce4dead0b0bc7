"""The fp8 (e4m3) KV cache in engine runs: output quality, scales from a checkpoint, swap, prefix
caching and copy-on-write over fp8 blocks, the metrics. (The element format, the settings, sizing
and the CUTLASS launches' arguments: test_fp8_kv_format.py.)

Agreement with the model-dtype cache: the issue's gate (>= 95% greedy token agreement over
20 prompts x 32 tokens) runs on tiny models trained on the tokenizer's corpus, whose next tokens
are sure; a broken cache must fail it. On the random tiny checkpoints the logits are nearly
flat, so greedy continuations diverge after the first flipped near-tie (between an fp32 and a
bf16 model too); there the greedy figures are printed for context, and the agreement asserted
is position by position over the same sequences (prompt logprobs).
"""

from __future__ import annotations

import random
import shutil

import pytest
import torch

from compiler.kernels.kv_quant import FP8_DTYPE, FP8_MAX
from engine.core.params import SamplingParams
from engine.layers.kv_cache import KVCache
from engine.models.loader.kv_scales import is_kv_scale_name, read_kv_scales
from tests.support.engine import run_checked
from tests.support.kv_fidelity import FIDELITY_PROMPTS, token_agreement

# ---- output quality ----


def logprob_drift(a, b):
    """|logprob difference| of the chosen token at each position both runs agree on so far."""
    d = []
    for oa, ob in zip(a, b):
        ca, cb = oa.outputs[0], ob.outputs[0]
        for ta, tb, la, lb in zip(ca.token_ids, cb.token_ids, ca.logprobs, cb.logprobs):
            if ta != tb:
                break
            d.append(abs(la[ta] - lb[tb]))
    return (sum(d) / len(d), max(d)) if d else (float("nan"), float("nan"))  # nan: every first token differs


PROMPTS = [f"The number {i} is followed by" for i in range(20)]
GREEDY = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True, logprobs=0)
SCORE = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=1)


def _positionwise(seqs, ref, got):
    """Top-1 agreement and |logprob drift| of the actual next token at every scored position."""
    same, drift = [], []
    for s, a, b in zip(seqs, ref, got):
        for i in range(1, len(s)):
            same.append(max(a[i], key=a[i].get) == max(b[i], key=b[i].get))
            drift.append(abs(a[i][s[i]] - b[i][s[i]]))
    return sum(same) / len(same), sum(drift) / len(drift), max(drift)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_agreement_with_the_model_dtype_cache(make_llm, tiny_models, arch):
    """20 prompts x 32 greedy tokens, fp8 cache (calibrated scales) against the fp32 cache, and the
    bf16 model against the fp32 one for scale. Greedy agreement is printed: the random tiny models
    have nearly flat logits, so one flipped near-tie changes every later token (the bf16 model
    alone diverges too). What is asserted is the position-wise agreement: the same 20 sequences
    (prompt + the fp32 run's 32 tokens) scored by each cache, the share of positions whose most
    likely next token is the same; saturating scales must score far worse (the check can fail)."""
    model = tiny_models[arch]
    base = make_llm(model, enforce_eager=False)
    ref_gen = base.generate(PROMPTS, GREEDY, use_tqdm=False)
    seqs = [list(o.prompt_token_ids) + list(o.outputs[0].token_ids) for o in ref_gen]

    def scored(llm):
        return [o.prompt_logprobs for o in llm.generate(seqs, SCORE, use_tqdm=False)]

    ref = scored(base)
    results = {}
    for label, settings in (
        ("fp8 KV", dict(kv_cache_dtype="fp8", calculate_kv_scales=True)),
        ("bf16 model", dict(dtype="bfloat16")),
    ):
        llm = make_llm(model, enforce_eager=False, **settings)
        gen = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        greedy, (mean, worst) = token_agreement(ref_gen, gen), logprob_drift(ref_gen, gen)
        results[label] = _positionwise(seqs, ref, scored(llm))
        print(
            f"{arch}: {label} vs fp32 KV, 20 prompts x 32 tokens: greedy token agreement {greedy:.4f}, "
            f"logprob drift mean {mean:.4f} max {worst:.4f} (until the first difference); position-wise "
            f"top-1 agreement {results[label][0]:.4f}, drift mean {results[label][1]:.4f} "
            f"max {results[label][2]:.4f}"
        )
    assert results["fp8 KV"][0] >= 0.75
    bad = make_llm(model, kv_cache_dtype="fp8")
    bad.engine.core.kv_cache.set_scales(torch.full_like(bad.engine.core.kv_cache.scales, 1e-4))  # everything saturates
    assert _positionwise(seqs, ref, scored(bad))[0] < results["fp8 KV"][0] - 0.2


# The fidelity gate: models trained on the tokenizer's corpus (conftest trained_tiny_model).
# Half the prompts are pieces of the corpus, half are text the model never saw that leads into
# a piece of it; 32 greedy tokens each. (On text that never meets the corpus the trained models
# are as unsure as random ones: tools/bench_fp8_kv.py prints those figures.)
GATE = 0.95


def greedy_fidelity(llm, ref) -> tuple[float, float, float, list]:
    """(token agreement, mean and max logprob drift) of `llm`'s greedy run of FIDELITY_PROMPTS
    against `ref`'s outputs, and the outputs."""
    out = llm.generate(FIDELITY_PROMPTS, GREEDY, use_tqdm=False)
    mean, worst = logprob_drift(ref, out)
    return token_agreement(ref, out), mean, worst, out


def test_make_tiny_model_train_steps(tmp_path, capsys):
    """`kiln make-tiny-model DIR --train-steps N` trains (the weights move, the loss falls, the
    seed fixes the result); the option refuses what it cannot train."""
    from safetensors.torch import load_file

    from engine.entrypoints.cli.main import main
    from engine.models.tiny_model import make_tiny_model, train_on_corpus, train_tokenizer

    assert main(["make-tiny-model", str(tmp_path / "t"), "--train-steps", "2"]) == 0
    make_tiny_model(tmp_path / "r", seed=0)
    trained, plain = (
        load_file(str(tmp_path / "t" / "model.safetensors")),
        load_file(str(tmp_path / "r" / "model.safetensors")),
    )
    assert trained.keys() == plain.keys() and not torch.equal(trained["lm_head.weight"], plain["lm_head.weight"])
    import copy

    import transformers

    tok = train_tokenizer()
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "r")
    twin = copy.deepcopy(model)
    first = train_on_corpus(model, tok, 1, seed=4)
    assert train_on_corpus(twin, tok, 1, seed=4) == first  # seeded: the same step, the same loss
    assert train_on_corpus(model, tok, 8, seed=4) < first
    with pytest.raises(ValueError, match="train-steps"):
        make_tiny_model(tmp_path / "x", preset="llama-3.2-1b", config_only=True, train_steps=5)
    with pytest.raises(ValueError, match=">= 0"):
        make_tiny_model(tmp_path / "y", train_steps=-1)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_fp8_cache_within_tolerance_of_the_model_dtype_cache(make_llm, trained_tiny_model, monkeypatch, arch):
    """The issue's gate on trained tiny models: bf16 model + fp8 cache (scales 1.0, kiln's default
    without checkpoint scales; and calibrated) against the same bf16 model + bf16 cache: >= 95% of
    the 20 x 32 greedy tokens agree, logprob drift printed. A cache read back with the wrong scale
    (x16, as a write/read mismatch would) must fall far below, so the gate can fail."""
    model = trained_tiny_model(arch)
    ref = make_llm(model, dtype="bfloat16").generate(FIDELITY_PROMPTS, GREEDY, use_tqdm=False)
    assert "lazy dog" in ref[0].outputs[0].text  # the model has learnt its corpus
    results = {}
    for label, settings in (("fp8 KV, scales 1.0", {}), ("fp8 KV, calibrated", dict(calculate_kv_scales=True))):
        llm = make_llm(model, dtype="bfloat16", kv_cache_dtype="fp8", **settings)
        results[label] = greedy_fidelity(llm, ref)[:3]
    import compiler.kernels.reference_attention as reference

    read = reference.from_cache
    monkeypatch.setattr(reference, "from_cache", lambda x, dtype, scale: read(x, dtype, scale * 16))
    wrong = make_llm(model, dtype="bfloat16", kv_cache_dtype="fp8", calculate_kv_scales=True)
    results["fp8 KV read x16 (broken)"] = greedy_fidelity(wrong, ref)[:3]
    for label, (agree, mean, worst) in results.items():
        print(
            f"trained tiny {arch}, bf16 model: {label} vs bf16 KV, 20 prompts x 32 greedy tokens: token agreement "
            f"{agree:.4f}, logprob drift mean {mean:.4f} max {worst:.4f} (until the first difference)"
        )
    assert results["fp8 KV, scales 1.0"][0] >= GATE and results["fp8 KV, calibrated"][0] >= GATE
    assert results["fp8 KV read x16 (broken)"][0] < 0.5, (
        "the broken cache passed: does the eager CPU attention still read through "
        "compiler.kernels.reference_attention.from_cache (what this control patches)?"
    )


# ---- scales from a checkpoint ----


def _with_scales(src, dst, k_scale, v_scale, layers):
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    weights = load_file(str(dst / "model.safetensors"))
    for i in range(layers):
        weights[f"model.layers.{i}.self_attn.k_scale"] = torch.tensor(k_scale)
        weights[f"model.layers.{i}.self_attn.v_scale"] = torch.tensor(v_scale)
    save_file(weights, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


def test_checkpoint_scales_are_read_and_used(make_llm, tiny_llama, tmp_path):
    from engine.models.config import ModelConfig

    layers = ModelConfig.from_dir(tiny_llama).num_layers
    one = _with_scales(tiny_llama, tmp_path / "one", 1.0, 1.0, layers)
    two = _with_scales(tiny_llama, tmp_path / "two", 2.0, 0.5, layers)
    assert is_kv_scale_name("model.layers.3.self_attn.k_scale") and not is_kv_scale_name("model.layers.3.mlp.x")
    assert read_kv_scales([two / "model.safetensors"], layers).tolist() == [[2.0, 0.5]] * layers
    assert read_kv_scales([tiny_llama / "model.safetensors"], layers) is None
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    caches = {}
    for name, path in (("one", one), ("two", two)):
        llm = make_llm(path, kv_cache_dtype="fp8", num_gpu_blocks=8, block_size=16, enable_prefix_caching=False)
        llm.generate(["a prompt of a few words"], params, use_tqdm=False)
        caches[name] = llm.engine.core.kv_cache
    assert caches["two"].scales.tolist() == [[2.0, 0.5]] * layers
    k1, k2 = caches["one"].tensor[:, 0].float(), caches["two"].tensor[:, 0].float()
    v1, v2 = caches["one"].tensor[:, 1].float(), caches["two"].tensor[:, 1].float()
    written = k1 != 0
    assert written.any()
    # The same rows stored with K scale 2 and V scale 0.5: the bytes are x / scale. The first
    # layer's rows do not depend on the scales: there, rounding commutes with the power-of-two
    # scale wherever both values are normal e4m3 numbers (> 2^-6) and unsaturated, so the
    # elements are exactly halved / doubled; later layers read back scaled values and agree to
    # within e4m3's rounding.
    k_normal = k1[0].abs() > 2**-5  # (a value rounded up to 2^-6 may have come from the subnormals)
    v_normal = (v1[0].abs() > 2**-6) & (v1[0].abs() <= FP8_MAX / 2)
    assert k_normal.sum() > 100 and v_normal.sum() > 100
    assert torch.equal(k2[0][k_normal], k1[0][k_normal] / 2)
    assert torch.equal(v2[0][v_normal], v1[0][v_normal] * 2)
    assert torch.allclose(k2 * 2, k1, rtol=0.15, atol=0.02) and not torch.equal(k2, k1)
    assert torch.allclose(v2 * 0.5, v1, rtol=0.15, atol=0.02)


def test_loader_ignores_scales_without_fp8_cache(make_llm, tiny_llama, tmp_path):
    from engine.models.config import ModelConfig

    path = _with_scales(tiny_llama, tmp_path / "m", 2.0, 2.0, ModelConfig.from_dir(tiny_llama).num_layers)
    llm = make_llm(path)
    assert llm.engine.core.kv_cache.scales is None
    assert llm.generate(["hi"], SamplingParams(max_tokens=2), use_tqdm=False)[0].outputs[0].token_ids


def test_calculate_kv_scales_uses_the_first_prompt(make_llm):
    llm = make_llm(kv_cache_dtype="fp8", calculate_kv_scales=True, enable_prefix_caching=False)
    llm.generate(["the first prompt sets the scales"], SamplingParams(max_tokens=3), use_tqdm=False)
    cache = llm.engine.core.kv_cache
    assert (cache.scales != 1.0).all()
    # Each layer's largest K and V element of that prompt is stored as exactly ±448.
    first = cache.tensor.float().abs().amax(dim=(2, 3, 4, 5))  # [layers, 2]
    assert torch.equal(first, torch.full_like(first, FP8_MAX))
    before = cache.scales.clone()
    llm.generate(["a later prompt does not change them " * 3], SamplingParams(max_tokens=3), use_tqdm=False)
    assert torch.equal(cache.scales, before)


# ---- swap, prefix caching, copy-on-write ----


def _prompts(n, seed=0):
    rng = random.Random(seed)
    return [[rng.randrange(5, 500) for _ in range(rng.randint(6, 30))] for _ in range(n)]


def test_swap_under_pressure_matches_fp8_without_pressure(make_llm):
    prompts = _prompts(12)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, detokenize=False)
    ref = make_llm(kv_cache_dtype="fp8", max_num_seqs=16, max_model_len=128)
    expected = [o.outputs[0].token_ids for o in ref.generate(prompts, params, use_tqdm=False)]
    llm = make_llm(
        kv_cache_dtype="fp8",
        max_num_seqs=8,
        max_model_len=64,
        block_size=8,
        num_gpu_blocks=14,
        preemption_mode="swap",
        swap_space_gb=0.01,
        max_num_batched_tokens=64,
    )
    eng = llm.engine
    assert eng.core.block_swapper.cpu.element_size() == 1  # the CPU pool holds the fp8 bytes
    for i, p in enumerate(prompts):
        eng.add_request(request_id=str(i), prompt=p, params=params)
    done = run_checked(eng)
    assert [done[str(i)].outputs[0].token_ids for i in range(len(prompts))] == expected
    assert eng.core.scheduler.preemptions_by_mode["swap"] > 0
    space = eng.core.swap_space
    assert space.bytes_out == eng.core.block_swapper.bytes_out > 0 and space.bytes_in == eng.core.block_swapper.bytes_in
    assert space.bytes_per_block == KVCache.bytes_per_block(
        eng.model_config.num_layers, 8, eng.model_config.num_kv_heads, eng.model_config.head_dim, FP8_DTYPE
    )
    assert space.is_fully_free() and eng.core.is_idle_and_free()


def test_prefix_cache_hits_read_fp8_blocks(make_llm):
    shared = _prompts(1, seed=3)[0] * 3  # 3 full blocks of 16 and more
    prompts = [shared + [7, 8, 9], shared + [11, 12]]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, detokenize=False)
    cold = make_llm(kv_cache_dtype="fp8", enable_prefix_caching=False)
    expected = [[o.outputs[0].token_ids for o in cold.generate([p], params, use_tqdm=False)][0] for p in prompts]
    llm = make_llm(kv_cache_dtype="fp8", enable_prefix_caching=True)
    got = [llm.generate([p], params, use_tqdm=False)[0].outputs[0].token_ids for p in prompts]
    assert got == expected
    assert llm.engine.core.pool.counters.prefix_hits >= 32


def test_copy_on_write_parallel_sampling_and_beams(make_llm):
    prompts = _prompts(4, seed=5)
    params = SamplingParams(n=3, temperature=0.9, seed=11, max_tokens=20, ignore_eos=True, detokenize=False)
    ref = make_llm(kv_cache_dtype="fp8", max_num_seqs=16)
    expected = [[c.token_ids for c in o.outputs] for o in ref.generate(prompts, params, use_tqdm=False)]
    tight = make_llm(
        kv_cache_dtype="fp8",
        max_num_seqs=16,
        block_size=8,
        num_gpu_blocks=24,
        max_model_len=64,
        preemption_mode="swap",
        swap_space_gb=0.01,
    )
    eng = tight.engine
    for i, p in enumerate(prompts):
        eng.add_request(request_id=str(i), prompt=p, params=params)
    done = run_checked(eng)
    assert [[c.token_ids for c in done[str(i)].outputs] for i in range(len(prompts))] == expected
    from engine.runtime.beam_search import BeamSearchParams

    beams = ref.beam_search([prompts[0]], BeamSearchParams(beam_width=3, max_tokens=6, ignore_eos=True))
    beams_tight = tight.beam_search([prompts[0]], BeamSearchParams(beam_width=3, max_tokens=6, ignore_eos=True))
    assert [c.token_ids for c in beams[0].outputs] == [c.token_ids for c in beams_tight[0].outputs]


def test_metrics_report_the_cache_dtype(make_llm):
    from engine.entrypoints.openai.metrics import EngineMetrics

    llm = make_llm(kv_cache_dtype="fp8", num_gpu_blocks=20)
    metrics = EngineMetrics("m")
    metrics.set_engine_info(llm.engine)
    text = metrics.render().decode()
    line = next(x for x in text.splitlines() if x.startswith("kiln:cache_config_info{"))
    assert 'cache_dtype="fp8"' in line and 'num_gpu_blocks="20"' in line
