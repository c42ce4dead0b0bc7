"""Greedy agreement of int4_kernel="packed" (a float32 model's int4 layers on torch's packed kernel, bf16
activations around it) with the float32 reference path (dequantise on the fly), on tiny int4
checkpoints written by tests/support/quant_checkpoints.py: 20 prompts x 32 greedy tokens each, and the mean
prompt-token log-probability drift. Recorded in benchmarks/2026-11-30.md, quantmoe.

    PYTHONPATH=. python tools/int4_packed_agreement.py
"""

import tempfile
from pathlib import Path

import torch

from engine import SamplingParams
from engine.entrypoints.llm import LLM
from engine.models.tiny_model import make_tiny_model
from tests.layers.test_quant_formats import _drift
from tests.support.quant_checkpoints import write_quantized

root = Path(tempfile.mkdtemp())
greedy = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
gen = torch.Generator().manual_seed(0)
prompts = [torch.randint(5, 200, (int(n),), generator=gen).tolist() for n in torch.randint(1, 40, (20,), generator=gen)]
for arch, fmt, opts in [
    ("llama", "gptq", dict(bits=4, group_size=32, act_order=True)),
    ("qwen2", "awq", dict(bits=4, group_size=64, sym=False)),
    ("qwen3_moe", "gptq", dict(bits=4, group_size=32)),
    ("mixtral", "ct", dict(bits=4, group_size=32)),
]:
    src = make_tiny_model(root / arch, arch=arch, seed=3)
    q, _ = write_quantized(src, root / f"{arch}-q", fmt, **opts)
    fast = LLM(str(q), device="cpu", enforce_eager=True, int4_kernel="packed")
    ref = LLM(str(q), device="cpu", enforce_eager=True, int4_kernel="reference")
    a = [o.outputs[0].token_ids for o in fast.generate(prompts, greedy, use_tqdm=False)]
    b = [o.outputs[0].token_ids for o in ref.generate(prompts, greedy, use_tqdm=False)]
    prefix = sum(next((i for i, (p, r) in enumerate(zip(x, y)) if p != r), len(x)) for x, y in zip(a, b))
    same = sum(x == y for x, y in zip(a, b))
    print(
        f"{arch} {fmt} {opts}: {same}/20 sequences identical, {prefix}/{20 * 32} tokens before the first divergence; "
        f"prompt-logprob drift packed vs reference {_drift(fast, ref):.4f}"
    )
