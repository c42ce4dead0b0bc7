"""Quantised layers and checkpoints: drift from the dense model, greedy runs, int4 layouts."""

from __future__ import annotations

import torch

from engine import SamplingParams
from engine.layers.quant.config import QuantConfig
from engine.layers.quant.linear import IntWeightMethod

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


PROMPTS = [[5, 100, 200, 300, 17, 9], [42] * 20, [7], list(range(10, 70))]


def _greedy(llm):
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


def _prompt_logprobs(llm) -> torch.Tensor:
    """The log-probability of each prompt token after the ones before it (teacher forced)."""
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0), use_tqdm=False)
    return torch.tensor([lp[t] for o in outs for t, lp in zip(o.prompt_token_ids, o.prompt_logprobs) if lp])


def _drift(llm, ref) -> float:
    """Mean absolute difference of prompt-token log-probabilities against the reference run."""
    drift = (_prompt_logprobs(llm) - _prompt_logprobs(ref)).abs().mean().item()
    print(f"logprob drift {drift:.4f}")
    return drift


def _layer(
    out: int,
    inp: int,
    group: int,
    sym: bool = True,
    g_idx: torch.Tensor | None = None,
    bias: bool = False,
    seed: int = 0,
) -> torch.nn.Linear:
    """A linear layer in kiln's int4 layout with random levels, scales and zero points."""
    gen = torch.Generator().manual_seed(seed)
    m = torch.nn.Linear(inp, out, bias=bias)
    if bias:
        m.bias.data.normal_(generator=gen)
    method = IntWeightMethod(QuantConfig("int", "gptq", 4, group, sym=sym))
    del m.weight
    m.register_parameter("weight", None)
    method.create(m, "cpu")
    m.quant = method
    groups = m.scales.shape[1]
    m.qweight.copy_(torch.randint(0, 256, m.qweight.shape, generator=gen, dtype=torch.uint8))
    m.scales.copy_((torch.rand(out, groups, generator=gen) * 0.02 + 0.001).half().float())
    m.zeros.fill_(8) if sym else m.zeros.copy_(torch.randint(0, 16, (out, groups), generator=gen, dtype=torch.uint8))
    if g_idx is not None:
        m.g_idx.copy_(g_idx)
        m.act_order = True
    return m


def _act_order_g_idx(inp: int, group: int, seed: int = 1) -> torch.Tensor:
    perm = torch.randperm(inp, generator=torch.Generator().manual_seed(seed))
    g = torch.empty(inp, dtype=torch.int32)
    g[perm] = (torch.arange(inp) // group).to(torch.int32)
    return g


def packed_gguf_layer(formats: tuple[str, ...], sizes: tuple[int, ...], k: int, bias: bool):
    """A Linear in the CPU kernels' layout from random GGUF blocks: one run per (format, rows) part."""
    import numpy as np
    import pytest

    from compiler.kernels import cpu_gemv
    from engine.layers.linear import Linear
    from engine.layers.quant import cpu_packed
    from tests.support.gguf_writer import random_k_blocks

    if not cpu_gemv.GEMV.ensure():
        pytest.skip(f"CPU kernels unavailable: {cpu_gemv.GEMV.error}")
    rng = np.random.default_rng(0)
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    parts = [
        (at, f, torch.from_numpy(random_k_blocks(f, n, k, rng)).reshape(n, -1))
        for at, f, n in zip(starts, formats, sizes)
    ]
    runs, packed = cpu_packed.gguf_runs(parts, k)
    with torch.device("meta"):
        layer = Linear(k, sum(sizes), bias)
    cpu_packed.install(layer, runs, packed, None, float_acts=False)
    layer.quant.gemm_rows = cpu_packed.GEMM_ROWS[False]  # (a fixed crossover, whatever this CPU's default)
    if bias:
        layer.bias = torch.nn.Parameter(torch.randn(sum(sizes)), requires_grad=False)
    return layer
