"""oneDNN's blocked weight copies for GEMM rows (engine/worker/cpu_gemm_weights.py, engine/layers/linear.py):
the rule, the kernel-level agreement with F.linear, and an engine with them giving the same greedy tokens."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from compiler.kernels import cpu_linear
from engine.worker.cpu_gemm_weights import gemm_weights_choice

GB = 10**9


@pytest.mark.parametrize(
    "setting, dtype, amx, keep",
    [
        ("auto", torch.bfloat16, True, True),
        ("auto", torch.bfloat16, False, False),
        ("auto", torch.float32, True, True),
        ("auto", torch.float32, False, False),
        ("on", torch.float32, False, True),
        ("on", torch.bfloat16, False, True),
        ("off", torch.bfloat16, True, False),
        ("on", torch.float16, True, False),
    ],
)
def test_choice(setting, dtype, amx, keep):
    chosen, why = gemm_weights_choice(setting, dtype, 1 * GB, amx, 16 * GB)
    assert chosen is keep and why


def test_choice_leaves_memory_alone():
    """A copy larger than a quarter of the free memory is not made, whatever the setting."""
    keep, why = gemm_weights_choice("on", torch.bfloat16, 5 * GB, True, 16 * GB)
    assert not keep and "free" in why
    with pytest.raises(ValueError, match="cpu_gemm_packed_weights"):
        gemm_weights_choice("always", torch.bfloat16, GB, True, 16 * GB)


def test_auto_keeps_only_a_small_copy():
    """auto: a 1B bf16 model's copy (2.5 GB) with 12 GB free is not kept (memory wins, issue 40), a
    135M model's (0.27 GB) is; `on` still keeps the large one."""
    assert not gemm_weights_choice("auto", torch.bfloat16, 2.5 * GB, True, 12 * GB)[0]
    assert gemm_weights_choice("auto", torch.bfloat16, 0.27 * GB, True, 12 * GB)[0]
    assert gemm_weights_choice("on", torch.bfloat16, 2.5 * GB, True, 12 * GB)[0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear_reads_the_copy_for_gemm_rows(dtype):
    """Rows above the kernels' limit go through the packed copy (a new oneDNN shape is recorded) and
    agree with F.linear; decode rows still take the plain weight."""
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(96, 80, generator=gen).to(dtype)
    b = torch.randn(96, generator=gen).to(dtype)
    packed = cpu_linear.pack_for_gemm(w)
    if packed is None:
        pytest.skip(f"oneDNN cannot pack {dtype} weights on this CPU")
    tol = {torch.float32: 1e-4, torch.bfloat16: 2e-2}[dtype]
    with torch.inference_mode():
        for rows in (1, 7, 31, 32, 33, 50, 100, 130):
            x = torch.randn(rows, 80, generator=gen).to(dtype)
            cpu_linear.SHAPES.shapes.clear()
            got = cpu_linear.linear(x, w, b, packed)
            ref = F.linear(x.float(), w.float(), b.float())
            assert got.shape == (rows, 96) and got.dtype == dtype
            torch.testing.assert_close(got.float(), ref, rtol=tol, atol=tol * 10)
            assert bool(cpu_linear.SHAPES.shapes) == (rows >= cpu_linear.MIN_ONEDNN_ROWS)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_engine_with_copies_gives_the_same_tokens(tiny_llama, dtype):
    """cpu_gemm_packed_weights=on against off: the same greedy tokens and close logprobs, prompts long
    enough for the GEMM path (more rows than the kernels take), the copies really made."""
    from engine.core.params import SamplingParams
    from engine.entrypoints.llm import LLM
    from tests.support.engine import assert_engine_clean

    settings = dict(device="cpu", dtype=dtype, max_model_len=256, max_num_seqs=8, max_num_batched_tokens=256)
    on, off = (LLM(str(tiny_llama), cpu_gemm_packed_weights=s, **settings) for s in ("on", "off"))
    copies = [m for m in on.engine.core.model.modules() if getattr(m, "gemm_weight", None) is not None]
    if not copies:
        pytest.skip(f"oneDNN cannot pack {dtype} weights on this CPU")
    assert on.engine.core.model.gemm_head is not None
    assert off.engine.core.model.gemm_head is None
    assert not [m for m in off.engine.core.model.modules() if getattr(m, "gemm_weight", None) is not None]
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 200, (n,), generator=gen).tolist() for n in (5, 40, 90, 7)]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=1)
    a, b = (llm.generate(prompts, params, use_tqdm=False) for llm in (on, off))
    tol = 1e-3 if dtype == "float32" else 5e-2
    for x, y in zip(a, b):
        assert x.outputs[0].token_ids == y.outputs[0].token_ids
        for tok, ex, ey in zip(x.outputs[0].token_ids, x.outputs[0].logprobs, y.outputs[0].logprobs):
            assert abs(_value(ex[tok]) - _value(ey[tok])) < tol
    for llm in (on, off):
        assert_engine_clean(llm.engine)


def _value(logprob) -> float:
    return getattr(logprob, "logprob", logprob)
