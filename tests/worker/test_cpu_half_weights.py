"""The "half" post-load weight work (engine/layers/linear.py): a float32 model's projections that hold only fp16 / bf16
values keep two bytes, others stay float32, and the engine's greedy tokens and logprobs do not
change (the kernels widen the 2-byte values exactly; a prefill's GEMM widens them per call)."""

from __future__ import annotations

import torch

from engine import SamplingParams
from engine.layers.linear import exact_half
from tests.support.engine import assert_engine_clean


def test_exact_half_picks_a_dtype_that_holds_every_value():
    w = torch.randn(8, 16)
    assert exact_half(w) is None  # random float32 values: neither 2-byte dtype holds them
    assert exact_half(w.half().float()).dtype == torch.float16
    bf = w.bfloat16().float() * 2.0**20  # bf16 values, most out of fp16's range
    assert exact_half(bf).dtype == torch.bfloat16
    assert torch.equal(exact_half(bf).float(), bf)


def test_gguf_f16_in_float32_keeps_two_bytes_and_the_same_tokens(tiny_llama, tmp_path):
    """An F16 GGUF run in float32: every projection and the LM head keep float16 (the head as a
    copy), the decoder stack runs them, and greedy tokens and logprobs (prompts long enough for the
    GEMM path too) equal the float32 copy's."""
    from engine.entrypoints.llm import LLM
    from tests.support.gguf_writer import write_gguf

    path = write_gguf(tiny_llama, tmp_path / "m-F16.gguf", "F16")
    settings = dict(device="cpu", dtype="float32", max_model_len=256, max_num_seqs=8, max_num_batched_tokens=256)
    half, full = (LLM(str(path), cpu_half_weights=on, **settings) for on in (True, False))
    dtypes = {m.weight.dtype for m in half.engine.core.model.quantizable_linears().values()}
    assert dtypes == {torch.float16}
    assert {m.weight.dtype for m in full.engine.core.model.quantizable_linears().values()} == {torch.float32}
    assert half.engine.core.model.cpu_stack is not None
    # the LM head too: a 2-byte copy for decode rows beside the float32 table (embedding, GEMM rows)
    assert half.engine.core.model.half_head is not None and half.engine.core.model.half_head.dtype == torch.float16
    assert full.engine.core.model.half_head is None
    assert half.engine.core.model.embed_tokens.weight.dtype == torch.float32
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 200, (n,), generator=gen).tolist() for n in (5, 40, 90, 7)]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=2)
    a, b = (llm.generate(prompts, params, use_tqdm=False) for llm in (half, full))
    for x, y in zip(a, b):
        assert x.outputs[0].token_ids == y.outputs[0].token_ids
        assert x.outputs[0].logprobs == y.outputs[0].logprobs
    for llm in (half, full):
        assert_engine_clean(llm.engine)
