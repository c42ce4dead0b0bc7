"""The target's pass over the corpus, computed once and cached (Teacher): its next-token
distributions (soft labels), final hidden states and the hidden states EAGLE-3 reads."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import torch

from engine.training.loop_helpers import load_target


@dataclass
class Teacher:
    """What the target says over the corpus, computed once (transformers, float32) and cached:
    per sequence its next-token distribution at every position (top-k ids and probabilities,
    soft labels for distillation), its final hidden states (EAGLE's features) and the hidden
    states entering the layers EAGLE-3 reads, side by side; plus its config, embeddings and LM head."""

    config: dict
    embed: torch.Tensor
    lm_head: torch.Tensor
    aux_layers: tuple[int, ...]
    top_ids: list[torch.Tensor]  # [T, k] int32
    top_p: list[torch.Tensor]  # [T, k] float16
    final: list[torch.Tensor]  # [T, H] bfloat16
    aux: list[torch.Tensor]  # [T, len(aux_layers) * H] bfloat16


@torch.no_grad()
def teacher_pass(target: str, seqs: list[list[int]], cache: Path | None = None, top_k: int = 32, log=print) -> Teacher:
    if cache is not None and cache.is_file():
        return Teacher(**torch.load(cache, weights_only=False))
    model = load_target(target)
    config = model.config.to_dict()
    config.setdefault("head_dim", model.config.hidden_size // model.config.num_attention_heads)
    n = config["num_hidden_layers"]
    aux = (2, n // 2, n - 3) if n >= 6 else (0, n // 2, n - 1)
    t0 = time.perf_counter()
    top_ids, top_p, final, aux_h = [], [], [], []
    for ids in seqs:
        out = model(input_ids=torch.tensor([ids]), output_hidden_states=True)
        top = out.logits[0].float().log_softmax(-1).topk(top_k, dim=-1)
        top_ids.append(top.indices.to(torch.int32))
        top_p.append(top.values.exp().to(torch.float16))
        hs = out.hidden_states
        final.append(hs[-1][0].to(torch.bfloat16))
        aux_h.append(torch.cat([hs[i] for i in aux], dim=-1)[0].to(torch.bfloat16))
    log(f"  the target over {len(seqs)} sequences in {time.perf_counter() - t0:.0f}s")
    teacher = Teacher(
        config,
        model.get_input_embeddings().weight.detach().clone(),
        model.get_output_embeddings().weight.detach().clone(),
        aux,
        top_ids,
        top_p,
        final,
        aux_h,
    )
    if cache is not None:
        cache.parent.mkdir(parents=True, exist_ok=True)
        torch.save(teacher.__dict__, cache)
    return teacher


def soft_labels(teacher: Teacher, i: int, start: int, n: int, lookup: torch.Tensor, width: int) -> torch.Tensor:
    """[n, width] the target's distribution over the next token at positions start..start+n-1 of
    sequence i, on the columns `lookup` maps token ids to (ids it maps to -100 are dropped),
    renormalised; zero rows past the sequence's end."""
    out = torch.zeros(n, width)
    ids, p = teacher.top_ids[i][start : start + n].long(), teacher.top_p[i][start : start + n].float()
    cols = lookup[ids]
    keep = cols >= 0
    rows = torch.arange(len(ids))[:, None].expand_as(ids)
    out[rows[keep], cols[keep]] = p[keep]
    return out / out.sum(-1, keepdim=True).clamp_min(1e-9)
