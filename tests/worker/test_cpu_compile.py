"""The CPU compile strategy: eager forward + the C++ paged attention built ahead of time; start-up
covers what serving runs (no compile during the first requests); warm starts load, not build."""

from __future__ import annotations

import pytest
import torch

from compiler.compilation.capture import compile_count
from compiler.kernels.cpu_attention import KERNEL, CpuAttentionKernel, cpu_flags
from engine.config.settings import EngineSettings
from engine.core.params import SamplingParams
from engine.runtime.llm_engine import LLMEngine
from tests.support.engine import assert_engine_clean, run_checked
from tests.support.prebuilt_kernels import prebuilt_dir

COMMON = dict(device="cpu", max_num_seqs=8, num_gpu_blocks=96, max_model_len=256, max_num_batched_tokens=64)


@pytest.fixture(scope="module")
def nothing_prebuilt(tmp_path_factory):
    """The package's prebuilt folder empty (a checkout's holds `make venv`'s libraries, found before
    any cache): these tests are of the compile cache, what a machine the install did not cover uses.
    (tests/compiler/test_cpu_prebuild.py: a start after the install step compiles nothing.)"""
    with prebuilt_dir(tmp_path_factory.mktemp("prebuilt")) as folder:
        yield folder


@pytest.fixture(scope="module")
def engines(tiny_llama, nothing_prebuilt):
    # The session's kiln cache (conftest): other CPU engines and servers of the session reuse the build.
    eager = LLMEngine.from_settings(EngineSettings(model=str(tiny_llama), enforce_eager=True, **COMMON))
    compiled = LLMEngine.from_settings(EngineSettings(model=str(tiny_llama), **COMMON))
    return eager, compiled


@pytest.fixture(scope="module")
def compile_cache(engines):
    return engines[1].settings.resolved_compile_cache_dir()


def _requests(engine, seed: int, n: int) -> list[tuple[list[int], int]]:
    g = torch.Generator().manual_seed(seed)
    vocab = engine.model_config.vocab_size
    out = []
    for i in range(n):
        length = int(torch.randint(1, 70, (1,), generator=g))
        out.append((torch.randint(3, vocab, (length,), generator=g).tolist(), 3 + (i * 5) % 17))
    return out


def _serve(engine, reqs, staggered: bool) -> dict[str, list[int]]:
    """Greedy outputs; staggered: requests arrive one per step (batch 1, then mixed steps)."""
    params = lambda n: SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, detokenize=False)  # noqa: E731
    done = {}
    pending = list(enumerate(reqs))
    while pending or engine.core.has_unfinished_requests():
        for _ in range(1 if staggered else len(pending)):
            if pending:
                i, (prompt, n) = pending.pop(0)
                engine.add_request(prompt, params(n), request_id=f"q{i}")
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
    done.update({k: v.outputs[0].token_ids for k, v in run_checked(engine).items()})
    return done


def test_cpu_default_compiles_only_the_attention(engines):
    _, compiled = engines
    assert compiled.core.runner.forward_fn == compiled.core.model.forward  # eager forward
    assert compiled.core.backend.compiled_cpu_decode
    assert compiled.core.compile_seconds > 0
    assert compiled.settings.resolved_compile_cache_dir() == KERNEL.cache_dir
    assert KERNEL.library_path().is_file()
    assert KERNEL.library_path().is_relative_to(KERNEL.cache_dir / "cpu-attention")


def test_no_compile_during_the_first_requests_and_outputs_equal_eager(engines):
    eager, compiled = engines
    graphs, builds = compile_count(), KERNEL.builds
    reqs = _requests(compiled, seed=3, n=10)
    got = _serve(compiled, reqs, staggered=True)  # batch 1 first, then growing mixed batches
    got_batch = _serve(compiled, [(p, n) for p, n in reqs[:6]], staggered=False)
    assert compile_count() == graphs, "Dynamo compiled during serving"
    assert KERNEL.builds == builds, "the attention kernel was built during serving"
    want = _serve(eager, reqs, staggered=True)
    assert got == want
    assert got_batch == {k: want[k] for k in got_batch}
    assert_engine_clean(compiled)


def test_warm_start_loads_without_building(compile_cache):
    fresh = CpuAttentionKernel()
    fresh.configure(compile_cache)
    fresh.load()
    assert fresh.builds == 0
    assert fresh.library_path() == KERNEL.library_path()


def test_cache_key_follows_the_cpu_capability_not_the_build_machine():
    """One build serves every layout, thread count, max_model_len and pool size; the flags come
    from torch's CPU capability (never -march=native), which is part of the key."""
    assert "-march=native" not in " ".join(cpu_flags())
    assert "-mavx512f" in cpu_flags("AVX512") and "-mavx512f" not in cpu_flags("AVX2")
    assert not any(f.startswith("-mavx") for f in cpu_flags("DEFAULT"))
    assert len({CpuAttentionKernel.key(c) for c in ("AVX512", "AVX2", "DEFAULT")}) == 3
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert CpuAttentionKernel.key() == KERNEL.key()
    finally:
        torch.set_num_threads(before)
