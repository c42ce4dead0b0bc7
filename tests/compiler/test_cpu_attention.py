"""The C++ CPU paged attention (compiler/kernels/cpu_attention.py) agrees with the reference on random
paged inputs: decodes, prefill chunks, mixed steps; GQA/MQA; float32, bfloat16 and fp8 caches;
sliding windows, soft-capping, padding rows, stale slots and blocks."""

from __future__ import annotations

import pytest
import torch

from compiler.kernels.kv_quant import FP8_DTYPE
from tests.support.paged_attention import check_attention as _check
from tests.support.paged_attention import paged_inputs as _paged


@pytest.mark.parametrize("hq,hkv,bs", [(4, 4, 16), (8, 2, 8), (6, 1, 16), (4, 2, 32)])
def test_decode_matches_reference(hq, hkv, bs):
    """GQA, MQA and MHA; lengths around block edges, padding rows (length 0), long contexts."""
    g = torch.Generator().manual_seed(hq * 100 + hkv * 10 + bs)
    for lens in ([1, 7, bs, bs + 1, 3 * bs - 1], [0, 5, 2 * bs], [4 * bs], [0], [700, 3, 129]):
        kv, q, qsl, seq_lens, tables = _paged(g, lens, [1] * len(lens), hq, hkv, 32, bs)
        out = _check(kv, q, qsl, seq_lens, tables)
        assert (out[seq_lens == 0] == 0).all()


@pytest.mark.parametrize("d", [32, 64, 80, 96, 128, 256])
def test_head_dims(d):
    g = torch.Generator().manual_seed(d)
    kv, q, qsl, lens, tables = _paged(g, [33, 1, 100], [1, 1, 20], 4, 2, d, 16)
    _check(kv, q, qsl, lens, tables, scale=d**-0.5)


def test_prefill_chunks_and_mixed_steps():
    """Whole prompts, chunks continuing a cached context, decodes first, padding tokens at the
    end that no sequence claims (zeros), chunks longer than one row block of the kernel."""
    g = torch.Generator().manual_seed(7)
    cases = [
        ([5, 17, 1, 20, 4], [1, 1, 1, 9, 4]),  # three decodes, then two chunks
        ([64, 16, 40], [64, 16, 40]),  # a prefill step of whole prompts
        ([100, 37], [30, 37]),  # a chunk continuing 70 cached tokens
        ([0, 9, 0], [0, 9, 0]),
    ]  # padding sequences with no tokens
    for lens, q_lens in cases:
        kv, q, qsl, seq_lens, tables = _paged(g, lens, q_lens, 8, 2, 32, 8)
        q = torch.cat([q, torch.randn(2, 8, 32, generator=g)])  # two unclaimed padding tokens
        out = _check(kv, q, qsl, seq_lens, tables, num_decodes=sum(1 for n in q_lens if n == 1))
        assert (out[-2:] == 0).all()


@pytest.mark.parametrize("window,softcap", [(4, 0.0), (17, 0.0), (0, 5.0), (9, 2.5)])
def test_sliding_window_and_softcap(window, softcap):
    g = torch.Generator().manual_seed(window * 10 + int(softcap))
    kv, q, qsl, lens, tables = _paged(g, [3, 40, 1, 33, 50], [1, 1, 1, 33, 12], 4, 2, 32, 8)
    _check(kv, q, qsl, lens, tables, window=window, softcap=softcap, scale=0.5)


def test_bfloat16_queries_and_cache():
    g = torch.Generator().manual_seed(11)
    kv, q, qsl, lens, tables = _paged(g, [1, 45, 16, 90], [1, 1, 16, 7], 8, 2, 64, 16, dtype=torch.bfloat16)
    _check(kv, q.bfloat16(), qsl, lens, tables, tol=1e-2)
    _check(kv, q, qsl, lens, tables, tol=1e-5)  # float32 queries over a bfloat16 cache


def test_fp8_cache_with_per_layer_scales():
    g = torch.Generator().manual_seed(13)
    kv, q, qsl, lens, tables = _paged(g, [1, 45, 16, 90, 0], [1, 1, 16, 7, 0], 8, 2, 32, 16, dtype=FP8_DTYPE)
    scales = torch.tensor([[1.0, 1.0], [0.03, 0.07]])
    _check(kv, q, qsl, lens, tables, scales=scales, tol=2e-5)
    _check(kv, q, qsl, lens, tables, layer=0, tol=2e-5)  # no scales: scale 1
    _check(kv, q.bfloat16(), qsl, lens, tables, scales=scales, tol=2e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, FP8_DTYPE])
@pytest.mark.parametrize("threads", [1, 2])
def test_many_decodes_read_every_kv_head_at_once(dtype, threads):
    """Enough decode rows for one work item per sequence (all its KV heads, with the other
    kind of step's items split per head: the two mixed), GQA and MHA, windows and soft-capping."""
    g = torch.Generator().manual_seed(29)
    lens = torch.randint(1, 300, (24,), generator=g).tolist()
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for hq, hkv, d, window, softcap in [
            (9, 3, 64, 0, 0.0),
            (4, 4, 32, 0, 0.0),
            (8, 2, 128, 50, 0.0),
            (6, 2, 64, 0, 3.0),
        ]:
            kv, q, qsl, seq_lens, tables = _paged(g, lens, [1] * 20 + [5, 1, 3, 1], hq, hkv, d, 16, dtype=dtype)
            tol = {torch.float32: 1e-5, FP8_DTYPE: 2e-4}.get(dtype, 2e-5)  # (fp8 values reach 448: rounding)
            _check(kv, q, qsl, seq_lens, tables, scale=d**-0.5, window=window, softcap=softcap, tol=tol)
            if dtype != FP8_DTYPE:
                _check(
                    kv,
                    q.to(dtype),
                    qsl,
                    seq_lens,
                    tables,
                    scale=d**-0.5,
                    window=window,
                    softcap=softcap,
                    tol=1e-5 if dtype == torch.float32 else 2e-2,
                )
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_long_decodes_split_across_threads(dtype):
    """One or two decode rows with long contexts (fewer work items than 4 x threads): on 2 threads
    each row's keys are split into chunks on block boundaries, every KV head of a chunk read in one
    pass, and the chunks merged by their softmax maxima and sums; on 1 thread nothing is split.
    Either way the reference's result, windows (a chunk starting mid-block) and soft-capping too."""
    g = torch.Generator().manual_seed(31)
    before = torch.get_num_threads()
    try:
        for threads in (2, 1):
            torch.set_num_threads(threads)
            for lens, window, softcap in [([5000], 0, 0.0), ([3000, 17], 0, 0.0), ([2100], 700, 0.0), ([1500], 0, 4.0)]:
                kv, q, qsl, seq_lens, tables = _paged(g, lens, [1] * len(lens), 9, 3, 64, 16, dtype=dtype)
                tol = 1e-5 if dtype == torch.float32 else 2e-5
                _check(kv, q, qsl, seq_lens, tables, scale=0.125, window=window, softcap=softcap, tol=tol)
    finally:
        torch.set_num_threads(before)


def test_strided_query_and_output_views():
    """q is a view of the fused qkv projection in the model: its rows are strided."""
    g = torch.Generator().manual_seed(17)
    kv, q, qsl, lens, tables = _paged(g, [9, 30], [9, 1], 4, 2, 32, 8)
    wide = torch.randn(q.shape[0], 8, 32, generator=g)
    wide[:, 2:6] = q
    _check(kv, wide[:, 2:6], qsl, lens, tables)


def test_bad_input_is_a_clear_error():
    g = torch.Generator().manual_seed(19)
    kv, q, qsl, lens, tables = _paged(g, [9, 30], [9, 1], 4, 2, 32, 8)
    out = torch.empty_like(q)
    with pytest.raises(RuntimeError, match="query_start_loc"):
        torch.ops.kiln_cpu.paged_attention(
            out, q, kv, 0, torch.tensor([0, 12, 10], dtype=torch.int32), lens, tables, 0.1, 0, 0.0, None, None
        )
    with pytest.raises(RuntimeError, match="block-table columns"):
        torch.ops.kiln_cpu.paged_attention(
            out, q, kv, 0, qsl, torch.tensor([9, 300], dtype=torch.int32), tables, 0.1, 0, 0.0, None, None
        )
    with pytest.raises(RuntimeError, match="layer"):
        torch.ops.kiln_cpu.paged_attention(out, q, kv, 5, qsl, lens, tables, 0.1, 0, 0.0, None, None)
    with pytest.raises(RuntimeError, match="head_dim"):
        torch.ops.kiln_cpu.paged_attention(
            out[..., :16], q[..., :16], kv, 0, qsl, lens, tables, 0.1, 0, 0.0, None, None
        )


def test_random_shapes_against_the_reference():
    g = torch.Generator().manual_seed(23)
    for _ in range(12):
        hkv = int(torch.randint(1, 4, (1,), generator=g))
        hq = hkv * int(torch.randint(1, 5, (1,), generator=g))
        bs = [8, 16, 32][int(torch.randint(0, 3, (1,), generator=g))]
        s = int(torch.randint(1, 9, (1,), generator=g))
        lens = torch.randint(0, 200, (s,), generator=g).tolist()
        q_lens = [min(n, int(torch.randint(1, 40, (1,), generator=g))) if n else 0 for n in lens]
        kv, q, qsl, seq_lens, tables = _paged(g, lens, q_lens, hq, hkv, 32, bs)
        _check(kv, q, qsl, seq_lens, tables, scale=0.3)


# ---- the engine with the C++ attention (compilation on: the CPU default) against transformers ----


@pytest.mark.parametrize("arch", ["llama", "qwen3", "gemma2", "phi3"])
def test_engine_greedy_matches_transformers(arch, tiny_models, make_llm):
    """Prompts of 1..200 tokens crossing many blocks, 16 at once: prefill steps, then decode batches."""
    from tests.support.hf_reference import GREEDY, MAX_TOKENS, _prompts, hf_greedy

    llm = make_llm(tiny_models[arch], max_num_seqs=16, enforce_eager=False, kv_cache_dtype="float32")
    assert llm.engine.core.backend.compiled_cpu_decode
    prompts = _prompts(llm.engine.model_config.vocab_size)
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == hf_greedy(str(tiny_models[arch]), prompts, MAX_TOKENS)


def test_engine_sliding_window_matches_transformers(tmp_path_factory, make_llm):
    """Window 16, chunked prefill over blocks of 8: the kernel's window crosses chunks and blocks."""
    from engine.models.tiny_model import make_tiny_model
    from tests.support.hf_reference import GREEDY, MAX_TOKENS, _prompts, hf_greedy

    path = tmp_path_factory.getbasetemp() / "mistral-window16"
    if not (path / "config.json").is_file():
        make_tiny_model(path, arch="mistral", seed=7, overrides={"sliding_window": 16})
    llm = make_llm(
        path, max_num_seqs=16, max_num_batched_tokens=32, block_size=8, enforce_eager=False, kv_cache_dtype="float32"
    )
    prompts = _prompts(llm.engine.model_config.vocab_size, seed=5)
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == hf_greedy(str(path), prompts, MAX_TOKENS)


def test_engine_softcap_logprobs_match_transformers(tiny_models, make_llm):
    """Gemma 2's capped scores and mixed windowed / full layers, chunked: prompt logprobs equal
    transformers' at every position (greedy tokens alone would not show the cap)."""
    import random

    from transformers import AutoModelForCausalLM

    from engine import SamplingParams

    model_dir = tiny_models["gemma2"]
    rng = random.Random(5)
    prompt = [rng.randrange(5, 500) for _ in range(60)]
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager")
    with torch.no_grad():
        ref = model.eval()(torch.tensor([prompt])).logits[0].log_softmax(-1)
    llm = make_llm(model_dir, max_num_batched_tokens=24, enforce_eager=False, kv_cache_dtype="float32")
    out = llm.generate([prompt], SamplingParams(max_tokens=1, prompt_logprobs=3, temperature=0), use_tqdm=False)[0]
    for i in range(1, len(prompt)):
        assert out.prompt_logprobs[i][prompt[i]] == pytest.approx(ref[i - 1, prompt[i]].item(), abs=1e-4), i


@pytest.mark.parametrize(
    "cache_dtype,x_dtype",
    [
        (torch.float32, torch.float32),
        (torch.bfloat16, torch.float32),
        (torch.bfloat16, torch.bfloat16),
        (torch.float16, torch.float32),
        (torch.float16, torch.bfloat16),
        (FP8_DTYPE, torch.float32),
        (FP8_DTYPE, torch.bfloat16),
    ],
)
def test_write_kv_stores_what_the_reference_stores(cache_dtype, x_dtype):
    """Exactly, fp8 saturation and NaN included; slot -1 writes nothing; strided k/v views."""
    from compiler.kernels.cpu_attention import write_kv_cpu_impl
    from compiler.kernels.reference_attention import write_kv_reference

    g = torch.Generator().manual_seed(29)
    cache = torch.zeros(2, 2, 9, 8, 2, 32, dtype=cache_dtype)
    want = cache.clone()
    kv = (torch.randn(13, 4, 32, generator=g) * 40).to(x_dtype)  # fused k|v rows: strided views
    kv[0, 0, 0] = float("nan")
    kv[1, 2, 3] = 1e6  # saturates in fp8
    k, v = kv[:, :2], kv[:, 2:]
    slots = torch.tensor([8, 9, -1, 70, 71, 15, 16, -1, 30, 31, 32, 60, 64])
    scales = torch.tensor([[1.0, 1.0], [0.5, 3.0]]) if cache_dtype == FP8_DTYPE else None
    write_kv_cpu_impl(k, v, cache, 1, slots, scales)
    write_kv_reference(
        k, v, want[1, 0], want[1, 1], slots, *((scales[1, 0], scales[1, 1]) if scales is not None else (None, None))
    )
    want[1, :, 0] = 0  # the reference routes slot -1 to the null block 0; the kernel skips it
    cache[1, :, 0] = 0
    torch.testing.assert_close(cache.float(), want.float(), rtol=0, atol=0, equal_nan=True)  # exact; NaN stays NaN
    with pytest.raises(RuntimeError, match="past the cache"):
        write_kv_cpu_impl(k, v, cache, 1, torch.full((13,), 72), scales)
