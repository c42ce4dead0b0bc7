"""engine/models/cpu_stack.py: the C++ decoder stack (templates/cpu_decoder_stack.inc) against the
same model's layers run op by op.

Same weights, same KV cache, same steps (two prompts' prefill in one mixed step, then decodes; with
packed GGUF weights also a prefill longer than the dense kernels' rows): the hidden states and
the KV cache written are the eager forward's bit for bit, in float32 and bfloat16 (both run the
same kernels in the same order). A stack built from a model with one norm weight changed by 0.1%
is caught (the comparison can fail). The default CPU engine, which runs the stack, still equals
transformers' greedy `generate` token for token; models the stack does not cover say why and run
op by op."""

from __future__ import annotations

import logging

import pytest
import torch

from engine.config.settings import EngineSettings
from engine.layers.attention.base import AttentionMetadata
from engine.models import cpu_stack
from engine.runtime.llm_engine import LLMEngine
from tests.support.calls import count_calls
from tests.support.engine import assert_engine_clean
from tests.support.hf_reference import GREEDY, MAX_TOKENS, _prompts, hf_greedy

COMMON = dict(device="cpu", max_num_seqs=8, num_gpu_blocks=32, max_model_len=256, max_num_batched_tokens=64)
# Stack coverage among the tiny architectures: plain pre-norm layers (qkv bias: qwen2; q/k norms:
# qwen3; norm offset, tanh-GELU and embedding scale: gemma).
STACK_ARCHS = ("llama", "qwen2", "qwen3", "mistral", "gemma", "phi3")
OFF_ARCHS = {"gemma2": "sandwich norms", "mixtral": "mixture-of-experts"}


def _engine(model, **settings) -> LLMEngine:
    return LLMEngine.from_settings(EngineSettings(model=str(model), **{**COMMON, **settings}))


def _steps(vocab: int, bs: int, prefill: tuple[int, int], decodes: int, seed: int = 0):
    """(ids, positions, meta) per step: two sequences (blocks 1.. and 9..) prefilled in one step,
    then `decodes` steps of one token each."""
    g = torch.Generator().manual_seed(seed)
    tables = torch.tensor([[1 + i for i in range(8)], [9 + i for i in range(8)]], dtype=torch.int32)
    lens = list(prefill)

    def slots(seq: int, start: int, n: int) -> list[int]:
        return [int(tables[seq, p // bs]) * bs + p % bs for p in range(start, start + n)]

    pos = torch.cat([torch.arange(n) for n in prefill])
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots(0, 0, prefill[0]) + slots(1, 0, prefill[1])),
        query_start_loc=torch.tensor([0, prefill[0], sum(prefill)], dtype=torch.int32),
        seq_lens=torch.tensor(lens, dtype=torch.int32),
        block_tables=tables,
        max_query_len=max(prefill),
        max_seq_len=max(prefill),
        num_decodes=0,
    )
    steps = [(torch.randint(3, vocab, (sum(prefill),), generator=g), pos, meta)]
    for _ in range(decodes):
        pos = torch.tensor(lens)
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots(0, lens[0], 1) + slots(1, lens[1], 1)),
            query_start_loc=torch.tensor([0, 1, 2], dtype=torch.int32),
            seq_lens=torch.tensor([n + 1 for n in lens], dtype=torch.int32),
            block_tables=tables,
            max_query_len=1,
            max_seq_len=max(lens) + 1,
            num_decodes=2,
        )
        lens = [n + 1 for n in lens]
        steps.append((torch.randint(3, vocab, (2,), generator=g), pos, meta))
    return steps


@torch.inference_mode()
def _run(model, kv: torch.Tensor, steps, stack) -> list[torch.Tensor]:
    """The hidden states of each step with model.cpu_stack = stack (None: the layers op by op)."""
    saved = model.cpu_stack
    model.cpu_stack = stack
    try:
        return [model(ids, pos, kv, meta) for ids, pos, meta in steps]
    finally:
        model.cpu_stack = saved


def _differences(engine, stack, prefill=(17, 12), decodes=3) -> list[str]:
    """Where running `stack` differs from the engine's model op by op (empty: bit for bit equal)."""
    model = engine.core.runner.model
    steps = _steps(engine.model_config.vocab_size, engine.settings.block_size, prefill, decodes)
    base = engine.core.runner.kv_cache.tensor
    kv_eager, kv_stack = base.clone().zero_(), base.clone().zero_()
    eager = _run(model, kv_eager, steps, None)
    ran = count_calls(stack)
    try:
        got = _run(model, kv_stack, steps, stack)
    finally:
        del stack.forward
    assert len(ran) == len(steps), "the stack did not run every step"
    out = [
        f"step {i}: max |diff| {(a.float() - b.float()).abs().max():.3g}"
        for i, (a, b) in enumerate(zip(got, eager))
        if not torch.equal(a, b)
    ]
    if not torch.equal(kv_stack, kv_eager):
        out.append("KV cache")
    return out


@pytest.fixture(scope="module")
def engines(tiny_models):
    made = {arch: _engine(tiny_models[arch]) for arch in STACK_ARCHS}
    made["llama-bf16"] = _engine(tiny_models["llama"], dtype="bfloat16")
    yield made
    for engine in made.values():
        assert_engine_clean(engine)


@pytest.mark.parametrize("name", [*STACK_ARCHS, "llama-bf16"])
def test_stack_equals_layers_op_by_op(name, engines):
    engine = engines[name]
    stack = engine.core.runner.model.cpu_stack
    assert stack is not None, f"{name}: the stack is off"
    # up to 31 rows on the dense kernels (a 29-row prefill); 2-row decodes on the thread team
    assert _differences(engine, stack, prefill=(17, 12)) == []


@pytest.mark.parametrize("name", ["llama", "llama-bf16"])
def test_stack_keeps_eagle3_hidden_states(name, engines):
    """EAGLE-3's aux_layers (with layer 0 and a repeat): the stack copies the residual stream
    entering those layers into aux_hidden as the op-by-op forward does, step by step, on the
    thread team (2-row decodes) and on fork/join (the 29-row prefill)."""
    engine = engines[name]
    model, stack = engine.core.runner.model, engine.core.runner.model.cpu_stack
    width = engine.model_config.hidden_size
    steps = _steps(engine.model_config.vocab_size, engine.settings.block_size, (17, 12), 2)
    aux_layers = (0, 1, 1)
    kv = engine.core.runner.kv_cache.tensor.clone().zero_()
    kept = {}
    ran = count_calls(stack)
    try:
        model.aux_layers = aux_layers
        for which, runner in (("eager", None), ("stack", stack)):
            kv.zero_()
            kept[which] = []
            for step in steps:
                model.aux_hidden = torch.full((40, len(aux_layers) * width), 7.0, dtype=model.norm.weight.dtype)
                _run(model, kv, [step], runner)
                kept[which].append(model.aux_hidden)
    finally:
        model.aux_layers, model.aux_hidden = (), None
        del stack.forward
    assert len(ran) == len(steps), "the stack did not run every step"
    for i, (a, b) in enumerate(zip(kept["stack"], kept["eager"])):
        assert torch.equal(a, b), f"step {i}: max |diff| {(a.float() - b.float()).abs().max():.3g}"
    rows = steps[0][0].shape[0]
    assert not torch.equal(kept["stack"][0][:rows, :width], kept["stack"][0][:rows, width : 2 * width])
    assert torch.equal(kept["stack"][0][:rows, width : 2 * width], kept["stack"][0][:rows, 2 * width :])
    assert (kept["stack"][0][rows:] == 7).all()  # rows past the step's tokens untouched


def test_stack_equals_layers_glm_interleaved_partial_rotary(tmp_path_factory):
    from engine.models.tiny_model import make_tiny_model
    from tests.support.glm import GLM_CONFIGS

    name = sorted(GLM_CONFIGS)[0]
    path = make_tiny_model(
        tmp_path_factory.mktemp("glm-stack"),
        arch="llama",
        seed=11,
        overrides=dict(GLM_CONFIGS[name], partial_rotary_factor=0.5, attention_bias=True, rope_scaling=None),
    )
    engine = _engine(path)
    assert engine.model_config.rope_interleaved and engine.core.runner.model.cpu_stack is not None
    assert _differences(engine, engine.core.runner.model.cpu_stack) == []
    assert_engine_clean(engine)


def test_stack_equals_layers_sliding_window(tmp_path_factory):
    """Mistral-style window of 8 positions: a 13-token prefill and decodes past the window."""
    from engine.models.tiny_model import make_tiny_model

    path = make_tiny_model(
        tmp_path_factory.mktemp("window8-stack"), arch="mistral", seed=7, overrides={"sliding_window": 8}
    )
    engine = _engine(path)
    assert engine.core.runner.model.layers[0].self_attn.sliding_window == 8
    assert _differences(engine, engine.core.runner.model.cpu_stack, prefill=(13, 3), decodes=4) == []
    assert_engine_clean(engine)


def test_a_broken_stack_is_caught(engines):
    """Control: a stack built with one layer's post-attention norm 0.1% off differs."""
    engine = engines["llama"]
    model = engine.core.runner.model
    norm = model.layers[1].post_attention_layernorm
    saved = norm.weight
    norm.weight = torch.nn.Parameter(saved.detach() * 1.001, requires_grad=False)
    try:
        broken = cpu_stack.build(model, saved.dtype)
    finally:
        norm.weight = saved
    assert broken is not None
    assert _differences(engine, broken)


@pytest.mark.parametrize("arch", STACK_ARCHS)
def test_default_cpu_engine_matches_transformers(arch, tiny_models, make_llm):
    """The default CPU engine (compiled attention, so the stack) against HF greedy generate."""
    llm = make_llm(tiny_models[arch], max_num_seqs=16, enforce_eager=False, kv_cache_dtype="float32")
    stack = llm.engine.core.runner.model.cpu_stack
    assert stack is not None
    ran = count_calls(stack)
    prompts = _prompts(llm.engine.model_config.vocab_size)
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert ran, "the stack never ran"
    for i, (out, want) in enumerate(zip(outs, hf_greedy(str(tiny_models[arch]), prompts, MAX_TOKENS))):
        assert out.outputs[0].token_ids == want, f"{arch} prompt {i} diverged"


@pytest.mark.parametrize("arch", sorted(OFF_ARCHS))
def test_uncovered_models_run_op_by_op_and_say_why(arch, tiny_models, caplog):
    with caplog.at_level(logging.INFO, logger="engine.models.cpu_stack"):
        engine = _engine(tiny_models[arch])
    assert engine.core.runner.model.cpu_stack is None
    assert any(OFF_ARCHS[arch] in r.getMessage() for r in caplog.records)
    assert_engine_clean(engine)


def test_setting_turns_it_off(tiny_llama):
    engine = _engine(tiny_llama, cpu_decoder_stack=False)
    assert engine.core.runner.model.cpu_stack is None
    assert_engine_clean(engine)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_packed_gguf_stack_equals_layers(dtype):
    """SmolLM2's Q4_1 GGUF kept packed (float activations in float32, int8 ones in bfloat16): the
    stack runs up to the rows where prefill chunks go to the GEMM (63; int8: 127, or on VNNI kernels
    the MLP's row pieces, 256), here a 49-row step."""
    from engine.config.settings_base import default_cache_dir
    from engine.layers.quant import cpu_packed
    from tests.support.real_model import Unavailable, fetch_smollm2

    try:
        path = fetch_smollm2(default_cache_dir())
    except Unavailable as exc:
        pytest.skip(f"SmolLM2 GGUF not available: {exc}")
    # (float32 on the float path as set: auto takes int8 activations on AVX2-only CPUs)
    engine = _engine(path, dtype=dtype, max_model_len=512, cpu_quant_activations="float")
    stack = engine.core.runner.model.cpu_stack
    float_acts = dtype == "float32"
    expected = min(cpu_packed.default_gemm_rows(float_acts) - 1, cpu_packed.MLP_PIECE_ROWS)
    assert stack is not None and stack.max_rows == expected
    assert _differences(engine, stack, prefill=(40, 9), decodes=2) == []
    assert_engine_clean(engine)


def test_thread_team_equals_one_call_per_projection(engines):
    """Steps of up to team_rows rows run with the stack's own thread team (one parallel region,
    each thread its slices of every projection); larger ones call each projection on all threads.
    Both give the eager forward's bits; an error inside the team's region comes back as an
    exception (every thread still meets every barrier: no hang), and the next step runs."""
    engine = engines["llama"]
    runner = engine.core.runner.model.cpu_stack
    if torch.get_num_threads() < 2:
        pytest.skip("one intra-op thread: no team")
    assert runner.stack.team_rows() == 8
    runner.stack.set_team_rows(0)
    try:
        assert _differences(engine, runner, prefill=(4, 3), decodes=2) == []
    finally:
        runner.stack.set_team_rows(8)
    model = engine.core.runner.model
    ids, pos, meta = _steps(engine.model_config.vocab_size, engine.settings.block_size, (4, 3), 1)[1]
    x = model.embed_tokens(ids)
    kv = engine.core.runner.kv_cache.tensor.clone().zero_()
    with pytest.raises(RuntimeError):  # (the KV write refuses a cache of another dtype, inside the team)
        runner.forward(x.clone(), pos, kv.double(), meta)
    assert runner.forward(x.clone(), pos, kv, meta).shape == x.shape
