"""Speculative sampling with a draft model's probabilities: drafts sampled from the draft's q,
verified against the target's p so that every output token follows p exactly.

A verify step samples one row per position (the sequence's last token, then each draft). Row j
holds the target's processed distribution p_j (temperature, top-k, top-p, min-p, penalties,
bias: the sampler's own rules) given the sequence and drafts 1..j-1, and draft j+1 was drawn
from the draft's q_j processed by the same rules (engine/worker/sample/distributions.py). Each
row's token is decided on the device, independently of the others:

  * a random request without a seed: the standard rule (Leviathan et al. 2023, Chen et al.
    2023). Accept the draft d with probability min(1, p(d) / q(d)); otherwise the row's token
    is a sample of normalise(max(0, p - q)), which never equals d. The output of an accepted
    prefix and its first rejected row is then distributed exactly as p, position by position,
    with the highest acceptance any rule reaches (1 - total variation between p and q);
  * a seeded request: the draft was raced with the target row's own seeded noise (the
    exponential race of the sampler), and the row's token is the target's own sample: the draft
    is kept when it equals it. The output is plain decoding's token for token (the drafts only
    decide how many positions one step keeps), and acceptance stays near the standard rule's
    when p and q are close (the race couples them);
  * a greedy request: the draft was q's argmax and the token is p's: kept when equal.

The host keeps the drafts up to the first row whose token differs from its draft, plus that
row's token (engine/spec_decode/sched/decoder.py), which is the rule above for every kind of row.
Everything here is tensor work with shapes fixed by the rows: no host synchronisation.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.core.params import SamplingParams
from engine.worker.host_upload import upload
from engine.worker.sample.distributions import exp_noise, processed_probs, race_noise


@dataclass
class DraftRow:
    """One draft position of a sequence, as draft sampling reads it: the request's parameters,
    the sample index and the output position of the token it drafts (which seeds its noise)."""

    params: SamplingParams
    sample_index: int
    num_output_tokens: int

    @property
    def uses_q(self) -> bool:
        """The target row verifies this draft with q (random, unseeded); else by equality."""
        return not self.params.greedy and self.params.seed is None


@dataclass
class DraftProbs:
    """What a verify step's rejection needs for its rows verified with q: the rows (indices into
    the sampler's rows), their draft tokens and the draft's distributions q (rows sum to 1)."""

    rows: torch.Tensor  # int64 [n]
    tokens: torch.Tensor  # int64 [n]
    q: torch.Tensor  # float32 [n, vocab]

    @property
    def num_rows(self) -> int:
        return int(self.rows.shape[0])


def sample_drafts(
    logits: torch.Tensor, rows: list[DraftRow], generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Draft tokens from a draft's logits [n, vocab] (in the target's vocabulary): q's argmax for
    greedy rows, else the exponential race over q with the row's noise (a seeded row's is the
    target row's own). Returns (tokens [n], q [n, vocab] normalised; greedy rows' q is unused, and
    None when every row is greedy)."""
    greedy = [r.params.greedy for r in rows]
    if all(greedy):  # (the common case: one argmax, no distribution)
        return logits.argmax(dim=-1), None
    probs = processed_probs(logits, rows, greedy)
    q = probs / probs.sum(dim=-1, keepdim=True).clamp_min(1e-30)
    tokens = (q / race_noise(q, rows, greedy, generator)).argmax(dim=-1)
    if any(greedy):
        tokens = torch.where(upload(greedy, torch.bool, logits.device), logits.argmax(dim=-1), tokens)
    return tokens, q


def rejection_tokens(p: torch.Tensor, drafts: DraftProbs, generator: torch.Generator) -> torch.Tensor:
    """Each row's token under the standard rule: its draft, accepted with probability
    min(1, p(d) / q(d)), else a sample of normalise(max(0, p - q)). p [n, vocab]: the target's
    processed distributions of drafts.rows (need not be normalised)."""
    p = p / p.sum(dim=-1, keepdim=True).clamp_min(1e-30)
    q = drafts.q
    d = drafts.tokens[:, None]
    p_d = p.gather(1, d).squeeze(1)
    q_d = q.gather(1, d).squeeze(1)
    u = torch.rand(p_d.shape, generator=generator, device=p.device, dtype=p.dtype)
    accept = u * q_d <= p_d  # (u < p/q without dividing: q(d) > 0 for a token q drew)
    residual = (p - q).clamp_min(0.0)
    # p == q up to rounding leaves no residual mass: then p itself is the distribution to draw.
    empty = residual.sum(dim=-1, keepdim=True) <= 0
    residual = torch.where(empty, p, residual)
    noise = exp_noise(residual, generator)
    resampled = (residual / noise).argmax(dim=-1)
    return torch.where(accept, drafts.tokens, resampled)
