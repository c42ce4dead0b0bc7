"""transformers' greedy decoding on the same weights: the reference kiln is compared with."""

from __future__ import annotations

import random

import torch

from engine import SamplingParams

NUM_PROMPTS = 16


MAX_TOKENS = 12


def _prompts(vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    lengths = [1, 2, 15, 16, 17, 31, 32, 33, 64, 100, 127, 128, 150, 199, 200, 7]
    assert len(lengths) == NUM_PROMPTS
    return [[rng.randrange(5, vocab) for _ in range(n)] for n in lengths]


_hf_cache: dict[str, list[list[int]]] = {}


def hf_greedy(model_dir, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """transformers' greedy continuation of each prompt (one at a time: no padding effects)."""
    key = f"{model_dir}:{max_tokens}:{hash(tuple(map(tuple, prompts)))}"
    if key not in _hf_cache:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        outs = []
        with torch.no_grad():
            for p in prompts:
                ids = torch.tensor([p])
                gen = model.generate(
                    ids,
                    attention_mask=torch.ones_like(ids),
                    max_new_tokens=max_tokens,
                    min_new_tokens=max_tokens,
                    do_sample=False,
                    eos_token_id=None,
                    pad_token_id=0,
                )
                outs.append(gen[0, len(p) :].tolist())
        _hf_cache[key] = outs
    return _hf_cache[key]


GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
