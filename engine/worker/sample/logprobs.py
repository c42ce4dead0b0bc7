"""Logprobs on the device, packed for one host copy: the chosen token's logprob and the top N per
sampled row, and the logprobs of a prompt's own tokens (prompt_logprobs)."""

from __future__ import annotations

import torch


def pack_chosen_and_top(logits: torch.Tensor, chosen: torch.Tensor, top_n: int) -> torch.Tensor:
    """Per row: the token `chosen[row]` (-1 kept: a failed row), its logprob, and the top_n
    logprobs with their token ids, packed for one device-to-host copy (float64 holds any token id)."""
    logprobs = logits.float().log_softmax(dim=-1)
    picked = logprobs.gather(1, chosen.clamp(min=0)[:, None])
    columns = [chosen[:, None].double(), picked.double()]
    if top_n > 0:
        top_vals, top_ids = logprobs.topk(top_n, dim=-1)
        columns += [top_vals.double(), top_ids.double()]
    return torch.cat(columns, dim=1)


def unpack_chosen_and_top(
    host: list[list[float]], top_n: int
) -> tuple[list[int], list[float], list[list[float]], list[list[int]]]:
    return (
        [int(r[0]) for r in host],
        [r[1] for r in host],
        [r[2 : 2 + top_n] for r in host],
        [[int(t) for t in r[2 + top_n :]] for r in host],
    )


def _chosen_and_top(
    logits: torch.Tensor, chosen: torch.Tensor, top_n: int
) -> tuple[list[int], list[float], list[list[float]], list[list[int]]]:
    return unpack_chosen_and_top(pack_chosen_and_top(logits, chosen, top_n).tolist(), top_n)


def prompt_token_logprobs(logits: torch.Tensor, targets: list[int], top_n: int) -> list[dict[int, float]]:
    """{token: logprob} per row for a prompt: the top_n tokens and the prompt's own next token
    `targets[row]` (always present, whatever its rank)."""
    _, picked, vals, ids = _chosen_and_top(logits, torch.tensor(targets, device=logits.device), top_n)
    entries = []
    for i, target in enumerate(targets):
        entry = dict(zip(ids[i], vals[i]))
        entry[target] = picked[i]
        entries.append(entry)
    return entries
