"""The device half of the request kinds (engine/core/request_kinds.py): what a kind takes from a
step's hidden states once the forward ran, for the plan its `plan()` made while the step was built.

    ScorePrompt  logprobs of the prompt's own tokens (and the top N) at the planned rows
    Pool         the planned rows' hidden states, summed (mean pooling) or the last one
"""

from __future__ import annotations

from typing import Any

import torch

from engine.core.request_kinds import Pool, ScorePrompt, Task
from engine.worker.sample.logprobs import prompt_token_logprobs

# Prompt logprobs: logits are computed for at most this many prompt rows at a time (each row is
# a vocabulary of float32; a whole chunk's at once could take gigabytes).
PROMPT_LOGPROB_ROWS = 256


def read_task(task: Task, model, hidden: torch.Tensor, plan: Any) -> Any:
    """What `task` takes from this step's hidden states, for its plan; the host records it."""
    if isinstance(task, ScorePrompt):
        return _prompt_logprobs(task, model, hidden, plan)
    if isinstance(task, Pool):
        return _pooled(task, hidden, plan)
    raise TypeError(f"{type(task).__name__} reads nothing from the hidden states")


def _prompt_logprobs(
    task: ScorePrompt, model, hidden: torch.Tensor, plan: tuple[int, int, list[int]]
) -> tuple[int, list[dict[int, float]]]:
    row, first, targets = plan
    entries: list[dict[int, float]] = []
    for lo in range(0, len(targets), PROMPT_LOGPROB_ROWS):
        chunk = targets[lo : lo + PROMPT_LOGPROB_ROWS]
        logits = model.compute_logits(hidden[row + lo : row + lo + len(chunk)])
        entries += prompt_token_logprobs(logits, chunk, task.top_n)
    return first, entries


def _pooled(task: Pool, hidden: torch.Tensor, plan: tuple[int, int, int, bool]) -> tuple[Any, int, int, bool]:
    row, rows, start, final = plan
    chunk = hidden[row : row + rows].float()
    if task.pooling.pooling_type == "mean":
        return chunk.sum(dim=0), rows, start, final
    return chunk[-1], 1, start, final
