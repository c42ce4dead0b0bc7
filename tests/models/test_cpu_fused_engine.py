"""The engine with the CPU fused ops (compiler/kernels/cpu_fused.py) and oneDNN projections still equals
transformers' greedy `generate` token for token, on every tiny architecture (GLM's interleaved
partial rotary included), and the fused ops really ran."""

from __future__ import annotations

import pytest

from engine.layers.layernorm import RMSNorm
from engine.layers.mlp import MLP
from engine.layers.rotary import RotaryEmbedding
from tests.support.engine import ARCHS
from tests.support.glm import GLM_CONFIGS
from tests.support.hf_reference import GREEDY, MAX_TOKENS, _prompts, hf_greedy


def _fused_llm(make_llm, model, tmp_path_factory, **settings):
    """An eager engine (no compiled attention: the fused ops alone differ from test_engine_vs_hf)
    switched to the fused ops as the CPU warm-up does."""
    llm = make_llm(model, max_num_seqs=16, kv_cache_dtype="float32", **settings)  # (exact: float32 KV)
    model_module = llm.engine.core.runner.model
    model_module.use_cpu_fused_ops(tmp_path_factory.getbasetemp() / "kiln-cache" / "compile")
    switched = [m for m in model_module.modules() if isinstance(m, (RMSNorm, RotaryEmbedding, MLP))]
    assert switched and all(m.fused for m in switched)
    return llm


def _check(llm, model, label):
    prompts = _prompts(llm.engine.model_config.vocab_size)
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    for i, (out, want) in enumerate(zip(outs, hf_greedy(str(model), prompts, MAX_TOKENS))):
        assert out.outputs[0].token_ids == want, f"{label} prompt {i} (len {len(prompts[i])}) diverged"


@pytest.mark.parametrize("arch", ARCHS)
def test_fused_engine_matches_transformers(arch, tiny_models, make_llm, tmp_path_factory):
    _check(_fused_llm(make_llm, tiny_models[arch], tmp_path_factory), tiny_models[arch], arch)


@pytest.mark.parametrize("name", sorted(GLM_CONFIGS))
def test_fused_engine_matches_transformers_glm(name, make_llm, tmp_path_factory):
    from engine.models.tiny_model import make_tiny_model

    model = make_tiny_model(
        tmp_path_factory.mktemp(name),
        arch="llama",
        seed=11,
        overrides=dict(GLM_CONFIGS[name], partial_rotary_factor=0.5, attention_bias=True, rope_scaling=None),
    )
    _check(_fused_llm(make_llm, model, tmp_path_factory), model, name)


def test_fused_chunked_prefill_and_prefix_cache(tiny_llama, make_llm, tmp_path_factory):
    """Mixed prefill chunks and decodes in one step, and prefix-cache hits, through the fused ops."""
    _check(_fused_llm(make_llm, tiny_llama, tmp_path_factory, max_num_batched_tokens=32), tiny_llama, "chunked")


def test_a_fused_library_that_cannot_build_leaves_the_eager_ops(make_llm, tiny_llama, monkeypatch, tmp_path, caplog):
    """No compiler (the build raises): the engine still starts, with the eager norms / RoPE / SiLU
    and no decoder stack, one warning says why, the build is not retried, and the tokens are
    transformers' own."""
    import logging

    from compiler.kernels import cpu_fused

    builds = []

    def broken(path):
        builds.append(path)
        raise RuntimeError("no C++ compiler")

    lib = cpu_fused.FusedOpsLibrary()
    lib._build = broken
    lib.library_path = lambda cache_dir: tmp_path / "never-built.so"  # (the session's cache may hold a built one)
    monkeypatch.setattr(cpu_fused, "FUSED", lib)
    with caplog.at_level(logging.INFO):
        llm = make_llm(enforce_eager=False, max_num_seqs=16, kv_cache_dtype="float32")  # (warm-up loads the fused ops)
        model = llm.engine.core.runner.model
        model.use_cpu_fused_ops(tmp_path)  # (a second try: not rebuilt, not logged again)
    assert len(builds) == 1 and "no C++ compiler" in lib.error and not lib.ready
    assert caplog.text.count("CPU fused ops unavailable (RuntimeError: no C++ compiler)") == 1
    assert "CPU decoder stack: off (the fused CPU ops are not loaded)" in caplog.text
    assert not any(m.fused for m in model.modules() if isinstance(m, (RMSNorm, RotaryEmbedding, MLP)))
    assert model.cpu_stack is None
    _check(llm, tiny_llama, "eager ops after a failed build")
