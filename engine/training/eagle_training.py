"""EAGLE and EAGLE-3 heads trained on the target's hidden states (engine/training/teacher.py's
Teacher), their labels the target's own next-token distributions; the head's modules are
engine/training/eagle_head.py."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from engine.training.eagle_head import TrainableEagle, eagle_config, save_eagle
from engine.training.loop_helpers import lr_schedule, padded, shuffled_batches
from engine.training.teacher import Teacher, soft_labels


def train_eagle_for(
    target: str,
    corpus: list[tuple[list[int], int]],
    teacher: Teacher,
    out: Path,
    version: int,
    epochs: int = 4,
    draft_vocab: int = 8192,
    seed: int = 0,
    layers: int = 1,
    batch: int = 8,
    lr: float = 1e-3,
    unroll: int = 1,
    log=print,
) -> Path:
    """An EAGLE (version 1) or EAGLE-3 head trained on the target's hidden states over the corpus,
    its labels the target's own next-token distributions (EAGLE-3 over its draft vocabulary: the
    corpus's most frequent tokens)."""
    torch.manual_seed(seed)
    tcfg = teacher.config
    embed, lm_head = teacher.embed, teacher.lm_head
    seqs = [ids for ids, _ in corpus]
    counts = torch.bincount(torch.tensor([t for s in seqs for t in s]), minlength=len(embed))
    frequent = counts.argsort(descending=True)[: min(draft_vocab, len(embed))].sort().values
    config = eagle_config(tcfg, version, len(frequent) if version == 3 else 0, layers)
    config["eagle_aux_hidden_state_layer_ids"] = list(teacher.aux_layers) if version == 3 else None
    if version == 1:
        del config["eagle_aux_hidden_state_layer_ids"]
    head = TrainableEagle(config, version, embed, lm_head, tcfg["hidden_size"], len(teacher.aux_layers))
    if version == 3:
        head.set_draft_vocab(frequent)
    vocab = frequent  # the tokens the loss scores (EAGLE: a subset of the target head, for speed)
    lookup = torch.full((len(embed),), -100, dtype=torch.int64)
    lookup[vocab] = torch.arange(len(vocab))
    feats = teacher.final if version == 1 else teacher.aux
    gen = torch.Generator().manual_seed(seed)
    params = [p for p in head.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    sched = lr_schedule(opt, epochs * math.ceil(len(seqs) / batch))
    head.train()
    loss_value, t0 = float("nan"), time.perf_counter()
    for epoch in range(epochs):
        for idx in shuffled_batches(len(seqs), batch, gen):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = _head_loss(head, teacher, idx.tolist(), seqs, feats, vocab, lookup, unroll)
            opt.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            sched.step()
            loss_value = float(loss.detach()) / (unroll + 1)
        log(f"  epoch {epoch + 1}/{epochs}: loss {loss_value:.3f} ({time.perf_counter() - t0:.0f}s)")
    head.eval()
    save_eagle(head, out)
    (out / "kiln_training.json").write_text(
        json.dumps(
            {
                "target": str(target),
                "method": f"eagle{version}",
                "answers": len(seqs),
                "tokens": sum(map(len, seqs)),
                "epochs": epochs,
                "unroll": unroll,
                "final_loss": loss_value,
            },
            indent=2,
        )
    )
    return out


def _head_loss(
    head: TrainableEagle, teacher: Teacher, idx: list[int], seqs, feats, vocab, lookup, unroll
) -> torch.Tensor:
    """Pass 0 reads the target's features; pass d reads the head's own outputs of pass d - 1
    (row s: the chain seeded at position s, now at s + d). Each pass scores the token it drafts
    against the target's distribution there (EAGLE: over the `vocab` rows of the target's LM
    head; EAGLE-3: its draft vocabulary) and EAGLE the feature it predicts."""
    ids, lengths = padded([seqs[i] for i in idx])
    b, n = ids.shape
    f = torch.zeros(b, n, feats[idx[0]].shape[-1])
    final = torch.zeros(b, n, teacher.final[idx[0]].shape[-1])
    for row, i in enumerate(idx):
        f[row, : len(feats[i])] = feats[i].float()
        final[row, : len(teacher.final[i])] = teacher.final[i].float()
    t = n - 2  # rows s = 0..n-3: read token s + 1, predict token s + 2
    positions = torch.arange(t)[None].expand(b, t)
    caches = [[] for _ in range(max(1, len(getattr(head, "layers", [None]))))]
    h = None
    loss = torch.zeros(())
    for depth in range(unroll + 1):
        src = F.pad(ids[:, 1 + depth : 1 + depth + t], (0, depth))[:, :t]
        h = head.step(src, f[:, :t] if depth == 0 else h, positions + depth, caches)
        # the token at s + 2 + depth: the target's distribution at position s + 1 + depth
        want = torch.stack([soft_labels(teacher, i, 1 + depth, t, lookup, len(vocab)) for i in idx])
        valid = ((torch.arange(t)[None] + 2 + depth) < lengths[:, None]).float()
        logits = (h @ head.target_head[vocab].T if head.version == 1 else head.logits(h)).float()
        loss = loss - ((want * logits.log_softmax(-1)).sum(-1) * valid).sum() / valid.sum()
        if head.version == 1:
            feat = F.pad(final[:, 1 + depth : 1 + depth + t], (0, 0, 0, depth))[:, :t]
            fvalid = ((torch.arange(t)[None] + 1 + depth) < lengths[:, None])[..., None]
            loss = loss + 10.0 * F.smooth_l1_loss((h * fvalid).float(), feat * fvalid)
    return loss
