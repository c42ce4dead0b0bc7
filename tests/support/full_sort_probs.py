"""The full-sort sampling rules, kept as the reference processed_probs
(engine/worker/sample/distributions.py) must equal: kiln's implementation before it searched top
candidates instead of sorting, with the sort made stable (among equal probabilities the lower token
id first: the tie rule) and top_p 1 off in every batch. tests/worker/test_processed_probs.py checks against it and
tools/bench_sampler.py times it as the baseline."""

from __future__ import annotations

from typing import Any, Sequence

import torch


def full_sort_probs(logits: torch.Tensor, rows: Sequence[Any], greedy: list[bool]) -> torch.Tensor:
    vocab = logits.shape[1]
    temp = torch.tensor([1.0 if g else r.params.temperature for r, g in zip(rows, greedy)], dtype=torch.float32)
    scaled = logits / temp.to(logits.device)[:, None]
    top_k = [r.params.top_k if r.params.top_k > 0 else vocab for r in rows]
    if any(k < vocab for k in top_k):
        k_tensor = torch.tensor(top_k, device=logits.device)[:, None].clamp(max=vocab)
        sorted_desc = scaled.sort(dim=-1, descending=True, stable=True).values
        kth = sorted_desc.gather(1, k_tensor - 1)
        scaled = scaled.masked_fill(scaled < kth, -float("inf"))
    probs = scaled.softmax(dim=-1)
    top_p = [r.params.top_p for r in rows]
    if any(p < 1.0 for p in top_p):
        # (top_p 1 is off: the old code compared its rows too, and cut their tails wherever the
        # mass before a token rounded up to 1, but only in a batch with a top-p row)
        off = [p if p < 1.0 else float("inf") for p in top_p]
        p_tensor = torch.tensor(off, dtype=torch.float32, device=logits.device)[:, None]
        sorted_probs, order = probs.sort(dim=-1, descending=True, stable=True)
        cum = sorted_probs.cumsum(dim=-1)
        # Drop a token when the mass before it already reaches top_p (the top token always stays).
        drop_sorted = (cum - sorted_probs) >= p_tensor
        drop = torch.zeros_like(drop_sorted).scatter(1, order, drop_sorted)
        probs = probs.masked_fill(drop, 0.0)
    min_p = [r.params.min_p for r in rows]
    if any(m > 0 for m in min_p):
        m_tensor = torch.tensor(min_p, dtype=torch.float32, device=logits.device)[:, None]
        probs = probs.masked_fill(probs < m_tensor * probs.max(dim=-1, keepdim=True).values, 0.0)
    return probs


def torch_uniform_race_noise(
    probs: torch.Tensor, rows: Sequence[Any], greedy: list[bool], generator: torch.Generator
) -> torch.Tensor:
    """The race's noise as kiln drew it before numpy's PCG64 (main at 1ae5d20): -log(U) from torch's
    uniform_ for the batch, each seeded row's again from its own torch generator. The baseline
    tools/bench_sampler.py times."""
    from engine.worker.sample.distributions import row_seed

    def exp_noise(like: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
        u = torch.empty_like(like, dtype=torch.float32).uniform_(generator=gen)
        return u.clamp_min_(2.0**-25).log_().neg_().to(like.dtype)

    noise = exp_noise(probs, generator)
    for i, r in enumerate(rows):
        if r.params.seed is not None and not greedy[i]:
            gen = torch.Generator(device=probs.device).manual_seed(
                row_seed(r.params.seed, r.sample_index, r.num_output_tokens)
            )
            noise[i] = exp_noise(noise[i], gen)
    return noise
