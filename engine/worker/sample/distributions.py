"""The distribution a row samples from, and the noise it samples with: shared by the sampler
(engine/worker/sample/sampler.py) and draft sampling (engine/spec_decode/rejection.py), so a
draft's q and the target's p are processed by the same rules and, for seeded requests, raced
with the same noise.

A row (the sampler's SampleRow, or a draft position's) is read for `params`, `sample_index` and
`num_output_tokens` (the output position of the token it samples).
"""

from __future__ import annotations

import hashlib
from typing import Any, Sequence

import torch

from engine.worker.host_upload import upload


def row_seed(seed: int, sample_index: int, position: int) -> int:
    digest = hashlib.blake2b(f"{seed}:{sample_index}:{position}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


def processed_probs(logits: torch.Tensor, rows: Sequence[Any], greedy: list[bool]) -> torch.Tensor:
    """The distribution each row samples from: softmax(logits / temperature) with top-k, top-p and
    min-p applied (greedy rows at temperature 1; masked tokens 0; rows not renormalised). The
    sampler and a draft model's sampling (engine/spec_decode/rejection.py) share it, so a draft's
    q and the target's p are processed alike."""
    vocab = logits.shape[1]
    device = logits.device
    temp = upload([1.0 if g else r.params.temperature for r, g in zip(rows, greedy)], torch.float32, device)[:, None]
    scaled = logits / temp
    top_k = [r.params.top_k if r.params.top_k > 0 else vocab for r in rows]
    if any(k < vocab for k in top_k):
        k_tensor = upload(top_k, torch.int64, device)[:, None].clamp(max=vocab)
        sorted_desc = scaled.sort(dim=-1, descending=True).values
        kth = sorted_desc.gather(1, k_tensor - 1)
        scaled = scaled.masked_fill(scaled < kth, -float("inf"))
    probs = scaled.softmax(dim=-1)
    top_p = [r.params.top_p for r in rows]
    if any(p < 1.0 for p in top_p):
        p_tensor = upload(top_p, torch.float32, device)[:, None]
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        cum = sorted_probs.cumsum(dim=-1)
        # Drop a token when the mass before it already reaches top_p (the top token always stays).
        drop_sorted = (cum - sorted_probs) >= p_tensor
        drop = torch.zeros_like(drop_sorted).scatter(1, order, drop_sorted)
        probs = probs.masked_fill(drop, 0.0)
    min_p = [r.params.min_p for r in rows]
    if any(m > 0 for m in min_p):
        m_tensor = upload(min_p, torch.float32, device)[:, None]
        probs = probs.masked_fill(probs < m_tensor * probs.max(dim=-1, keepdim=True).values, 0.0)
    return probs


# The smallest uniform kept: -log of it (17.3) bounds the noise, so a draw of exactly 0 (one in 2^24
# per token, a few per thousand rows of a 49k vocabulary) cannot exclude a token from the race.
_TINY_UNIFORM = 2.0**-25


def exp_noise(like: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """Exp(1) samples shaped like `like`, as -log(U): torch's exponential_ draws each value on its
    own on the CPU (~14 ms for 16 rows of a 49k vocabulary on one core, a quarter of a decode step),
    uniform_ is vectorised (~2.5 ms with the log)."""
    u = torch.empty_like(like, dtype=torch.float32).uniform_(generator=generator)
    return u.clamp_min_(_TINY_UNIFORM).log_().neg_().to(like.dtype)


def race_noise(
    probs: torch.Tensor, rows: Sequence[Any], greedy: list[bool], generator: torch.Generator
) -> torch.Tensor:
    """Exp(1) noise for the exponential race (argmax of probs / noise samples probs): from
    `generator`, except a seeded row's, drawn from its own generator seeded by (seed, sample
    index, output position). A draft sampled with its row's seeded noise picks the target's own
    token whenever it can (the two share the race): seeded output is plain decoding's."""
    noise = exp_noise(probs, generator)
    for i, r in enumerate(rows):
        if r.params.seed is not None and not greedy[i]:
            gen = torch.Generator(device=probs.device).manual_seed(
                row_seed(r.params.seed, r.sample_index, r.num_output_tokens)
            )
            noise[i] = exp_noise(noise[i], gen)
    return noise
