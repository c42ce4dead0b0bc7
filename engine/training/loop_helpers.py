"""What every trainer under engine/training/ shares: the target as a transformers model, padded
id batches, the learning-rate schedule (warm-up, then linear decay) and a shuffled batch order."""

from __future__ import annotations

from pathlib import Path

import torch


def load_target(target: str):
    """The target as a transformers model (a GGUF file dequantised), in float32, for its hidden
    states and weights."""
    from transformers import AutoModelForCausalLM

    path = Path(target)
    if path.suffix == ".gguf":
        model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    else:
        model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    return model.eval()


def padded(seqs: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """[B, T] ids padded with 0, and each row's length."""
    longest = max(len(x) for x in seqs)
    ids = torch.zeros(len(seqs), longest, dtype=torch.int64)
    for i, x in enumerate(seqs):
        ids[i, : len(x)] = torch.tensor(x)
    return ids, torch.tensor([len(x) for x in seqs])


def lr_schedule(opt, total: int):
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda i: min(1.0, (i + 1) / 20) * max(0.05, 1 - i / total))


def shuffled_batches(n: int, batch: int, gen: torch.Generator):
    order = torch.randperm(n, generator=gen)
    for i in range(0, n, batch):
        yield order[i : i + batch]
