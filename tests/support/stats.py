"""Statistical checks of samplers."""

from __future__ import annotations

import torch


def chi_square_p(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """p-value of Pearson's chi-square test of `counts` against `probs` (cells expecting fewer
    than 5 samples are pooled into one)."""
    counts = counts.double().flatten()
    expected = probs.double().flatten() / probs.sum() * counts.sum()
    if bool((counts[expected == 0] > 0).any()):
        return 0.0  # a sample where the distribution has no mass
    big = expected >= 5
    obs = torch.cat([counts[big], counts[~big].sum()[None]])
    exp = torch.cat([expected[big], expected[~big].sum()[None]])
    keep = exp > 0
    obs, exp = obs[keep], exp[keep]
    stat = ((obs - exp) ** 2 / exp).sum()
    dof = len(obs) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64), stat / 2))
