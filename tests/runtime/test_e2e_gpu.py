"""End to end: an engine with a GPU's default settings gives the reference engine's greedy tokens.

  cutlass_v1, cutlass_v2 (gpu)  the CUTLASS backend (decode v1 / prefill mma, and v2 / wgmma) in
                                bfloat16, against the torch backend
  cpu                           the same driver in CI: the CPU backend (compiled C++ decode
                                attention), float32, against the eager torch reference
The engine under test runs with overlap scheduling on (a GPU's default) and chunked prefill at a
small budget, so chunks attend to a cached prefix through the kernels and steps mix decode rows
(decode kernel) with a prompt chunk (prefill kernel); the reference runs serially, unchunked.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine import SamplingParams

KERNEL_CACHE = Path(__file__).resolve().parents[2] / "build" / "kernels"

# case -> (settings of the engine under test, settings of the reference)
CASES = {
    "cpu": (
        dict(device="cpu", dtype="float32", attention_backend="torch", enforce_eager=False),
        dict(device="cpu", dtype="float32", attention_backend="torch", enforce_eager=True),
    ),
    "cutlass_v1": (
        dict(
            device="cuda",
            dtype="bfloat16",
            attention_backend="cutlass",
            decode_kernel="v1",
            prefill_kernel="mma",
            enforce_eager=True,
        ),
        dict(device="cuda", dtype="bfloat16", attention_backend="torch", enforce_eager=True),
    ),
    "cutlass_v2": (
        dict(
            device="cuda",
            dtype="bfloat16",
            attention_backend="cutlass",
            decode_kernel="v2",
            prefill_kernel="wgmma",
            enforce_eager=True,
        ),
        dict(device="cuda", dtype="bfloat16", attention_backend="torch", enforce_eager=True),
    ),
}


@pytest.fixture(scope="module")
def tiny_d64(tmp_path_factory):
    from engine.models.tiny_model import make_tiny_model

    # head_dim 64: a size the kernels are built for (the default tiny model uses 32).
    return make_tiny_model(
        tmp_path_factory.mktemp("d64"),
        arch="qwen2",
        seed=5,
        overrides=dict(
            hidden_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=64, intermediate_size=512
        ),
    )


def _run(model_dir, prompts, **kw):
    from compiler.kernels.build import build_kernels, find_nvcc
    from compiler.kernels.loader import missing_variants
    from compiler.kernels.manifest import load_manifest
    from engine.entrypoints.llm import LLM

    if kw["attention_backend"] == "cutlass":
        missing = missing_variants(KERNEL_CACHE, list(load_manifest()))
        if missing and find_nvcc() is not None:
            build_kernels(KERNEL_CACHE, missing, progress=False)
    llm = LLM(str(model_dir), kernel_cache_dir=str(KERNEL_CACHE), num_gpu_blocks=512, **kw)
    assert llm.engine.core.backend.name == kw["attention_backend"]
    assert llm.engine.core.async_scheduling is kw["async_scheduling"]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False)
    llm.engine.core.check_integrity()
    assert llm.engine.core.is_idle_and_free()
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize(
    "case",
    ["cpu", pytest.param("cutlass_v1", marks=pytest.mark.gpu), pytest.param("cutlass_v2", marks=pytest.mark.gpu)],
)
def test_backend_matches_the_reference_greedy(tiny_d64, case):
    tested, reference = CASES[case]
    g = torch.Generator().manual_seed(0)
    lengths = [1, 15, 16, 17, 40, 100, 257, 600]
    prompts = [torch.randint(5, 500, (n,), generator=g).tolist() for n in lengths]
    # The tested engine first: on a GPU its ops must exist without the torch backend having run
    # (every kiln:: op is registered by compiler/kernels/ops.py, imported by engine.layers.attention).
    got = _run(
        tiny_d64, prompts, max_num_batched_tokens=128, async_scheduling=True, enable_chunked_prefill=True, **tested
    )
    ref = _run(tiny_d64, prompts, max_num_batched_tokens=1024, async_scheduling=False, **reference)
    assert all(a[0] == b[0] for a, b in zip(ref, got)), "first tokens differ"
    same = sum(a == b for a, b in zip(ref, got))
    # bf16 rounding can flip a near-tie late in a sequence; more than one such flip is a bug.
    assert same >= len(prompts) - 1, f"only {same}/{len(prompts)} sequences identical"
