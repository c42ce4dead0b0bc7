"""Draft models distilled on the CPU from the target's own outputs: a small Llama trained from
scratch (distill_draft_model), or one cut from the target's own layers (distill_from_target), both
over a draft vocabulary. The checkpoint is an HF Llama directory, so kiln and other runtimes load it.
EAGLE heads are engine/training/eagle_training.py's.

The data (token sequences and the target's top-k next-token labels over them) comes from the
caller (`kiln make-draft-model`, engine/entrypoints/cli/make_draft.py, generates it with kiln).
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

import torch
from torch import nn

from engine.training.eagle_head import rope_theta
from engine.training.loop_helpers import load_target, lr_schedule, padded, shuffled_batches


def distill_draft_model(
    target: str,
    corpus: list[dict],
    out: Path,
    layers: int = 4,
    hidden: int = 256,
    draft_vocab: int = 8192,
    epochs: int = 6,
    batch: int = 8,
    lr: float = 3e-3,
    seed: int = 0,
    log=print,
) -> Path:
    """A small Llama trained from scratch on the target's own outputs: sequence-level
    distillation (the target's answers are the text) with the target's own next-token
    distribution at every answer position as the label (its top-k log-probabilities from the
    corpus, build_labelled_corpus; cross-entropy against them), which teaches far more per token
    than the sampled token alone.

    The loss is a softmax over the draft vocabulary (draft_vocabulary: the LM head is most of the
    cost of a training step), in bfloat16 autocast; the LM head is untied from the embeddings,
    its rows of other tokens are zero, and draft_vocab.json tells kiln to evaluate only the
    draft vocabulary's rows (engine/models/draft.py)."""
    import transformers

    from engine.models.loader.model_loader import load_tokenizer

    torch.manual_seed(seed)
    tokenizer = load_tokenizer(target)
    teacher = load_target(target)
    tc = teacher.config
    embed = teacher.get_input_embeddings().weight.detach().clone()
    del teacher
    head_dim = 64 if hidden % 64 == 0 else hidden // 4
    heads = hidden // head_dim
    config = transformers.LlamaConfig(
        vocab_size=tc.vocab_size,
        hidden_size=hidden,
        intermediate_size=3 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=max(1, heads // 2),
        head_dim=head_dim,
        max_position_embeddings=tc.max_position_embeddings,
        rope_theta=rope_theta(tc.to_dict()),
        rms_norm_eps=tc.rms_norm_eps,
        tie_word_embeddings=False,
        bos_token_id=tc.bos_token_id,
        eos_token_id=tc.eos_token_id,
        pad_token_id=getattr(tc, "pad_token_id", None),
        torch_dtype="float32",
    )
    model = transformers.LlamaForCausalLM(config)
    vocab_ids = draft_vocabulary(corpus, draft_vocab, tc.vocab_size)
    lookup = _column_lookup(vocab_ids, tc.vocab_size)
    with torch.no_grad():  # the target's embeddings on their leading principal directions, both ends
        centred = embed - embed.mean(0)
        _, _, vh = torch.linalg.svd(centred[vocab_ids], full_matrices=False)
        proj = centred @ vh[:hidden].T
        proj = proj * (0.02 / proj[vocab_ids].std())
        model.get_input_embeddings().weight.copy_(proj)
        head = model.get_output_embeddings().weight
        head.zero_()
        head[vocab_ids] = proj[vocab_ids]
    log(
        f"  draft: {layers} layers of width {hidden} from scratch, draft vocabulary {len(vocab_ids)}, "
        f"{len(corpus)} answers, {_labelled_positions(corpus)} labelled positions"
    )
    t0 = time.perf_counter()
    loss_value = _distill(
        model,
        lambda h: h @ model.lm_head.weight[vocab_ids].T,
        corpus,
        lookup,
        len(vocab_ids),
        epochs,
        batch,
        lr,
        0.01,
        seed,
        log,
    )
    model.eval()
    with torch.no_grad():
        unseen = torch.ones(tc.vocab_size, dtype=torch.bool)
        unseen[vocab_ids] = False
        model.lm_head.weight[unseen] = 0.0
    how = {"init": "scratch", "layers": layers, "hidden_size": hidden}
    trained = {"epochs": epochs, "lr": lr, "batch": batch, "final_loss": loss_value}
    return _save_draft(out, model, tokenizer, vocab_ids, target, corpus, how, trained, t0)


def _column_lookup(vocab_ids: torch.Tensor, vocab: int) -> torch.Tensor:
    """Token id -> its column among the draft vocabulary's (-100: not in it)."""
    lookup = torch.full((vocab,), -100, dtype=torch.int64)
    lookup[vocab_ids] = torch.arange(len(vocab_ids))
    return lookup


def _labelled_positions(corpus: list[dict]) -> int:
    return sum(len(c["top_ids"]) for c in corpus)


def _save_draft(
    out: Path, model, tokenizer, vocab_ids: torch.Tensor, target: str, corpus: list[dict], how: dict, trained: dict, t0
) -> Path:
    """The draft as kiln loads it (an HF Llama directory with the target's tokenizer and
    draft_vocab.json) and kiln_training.json: how it was made (`how`, `trained`) from what."""
    from engine.models.draft import DRAFT_VOCAB_FILE

    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    (out / DRAFT_VOCAB_FILE).write_text(json.dumps({"token_ids": vocab_ids.tolist()}))
    record = {
        "target": str(target),
        "method": "draft_model",
        **how,
        "draft_vocab": len(vocab_ids),
        "answers": len(corpus),
        "labelled_positions": _labelled_positions(corpus),
        **trained,
        "train_seconds": round(time.perf_counter() - t0),
    }
    (out / "kiln_training.json").write_text(json.dumps(record, indent=2))
    return out


def _distill(
    model,
    logits_of,
    corpus: list[dict],
    lookup: torch.Tensor,
    width: int,
    epochs: int,
    batch: int,
    lr: float,
    weight_decay: float,
    seed: int,
    log,
) -> float:
    """Train model's trainable parameters to match the corpus's labels (cross-entropy against
    the target's distribution at every answer position, over `width` draft-vocabulary columns;
    logits_of(hidden) gives the draft's logits there). Returns the last batch's loss."""
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay)
    sched = lr_schedule(opt, epochs * math.ceil(len(corpus) / batch))
    gen = torch.Generator().manual_seed(seed)
    model.train()
    t0, loss_value = time.perf_counter(), float("nan")
    for epoch in range(epochs):
        for idx in shuffled_batches(len(corpus), batch, gen):
            entries = [corpus[i] for i in idx.tolist()]
            ids, _ = padded([c["ids"].tolist() for c in entries])
            n = ids.shape[1]
            want = torch.zeros(len(entries), n, width)
            valid = torch.zeros(len(entries), n)
            for row, c in enumerate(entries):  # position t predicts token t + 1: answers from prompt - 1
                a, at = len(c["top_ids"]), c["prompt"] - 1
                want[row, at : at + a] = _answer_labels(c, lookup, width)
                valid[row, at : at + a] = 1.0
            with torch.autocast("cpu", dtype=torch.bfloat16):
                logits = logits_of(model.model(input_ids=ids).last_hidden_state)
            loss = -((want * logits.float().log_softmax(-1)).sum(-1) * valid).sum() / valid.sum()
            opt.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            sched.step()
            loss_value = float(loss.detach())
        log(f"  epoch {epoch + 1}/{epochs}: loss {loss_value:.3f} ({time.perf_counter() - t0:.0f}s)")
    model.eval()
    return loss_value


# ---- a draft model cut from the target itself ----
def draft_vocabulary(corpus: list[dict], size: int, vocab: int) -> torch.Tensor:
    """The token ids a draft proposes from (ascending): the ones the corpus's answers and the
    target's labels use, most frequent first, then the lowest ids not yet in (a BPE tokenizer's
    earliest merges, its commonest pieces), up to `size` (every id when size >= vocab)."""
    if size >= vocab:
        return torch.arange(vocab)
    counts = torch.zeros(vocab, dtype=torch.int64)
    for c in corpus:
        counts += torch.bincount(c["ids"][c["prompt"] :].long(), minlength=vocab)
        counts += torch.bincount(c["top_ids"].flatten().long(), minlength=vocab)
    ranked = counts.argsort(descending=True, stable=True)
    chosen = ranked[: min(size, int((counts > 0).sum()))]
    fill = torch.ones(vocab, dtype=torch.bool)
    fill[chosen] = False
    rest = fill.nonzero().flatten()[: size - len(chosen)]
    return torch.cat([chosen, rest]).sort().values


def cut_layers(model, layers: list[int]):
    """The target (a transformers Llama) with only `layers` (in order), sharing nothing with it."""
    import copy

    n = model.config.num_hidden_layers
    if not layers or any(not 0 <= i < n for i in layers) or sorted(set(layers)) != list(layers):
        raise ValueError(f"draft layers must be ascending, distinct target layers in 0..{n - 1}, got {layers}")
    draft = copy.deepcopy(model)
    draft.model.layers = nn.ModuleList(draft.model.layers[i] for i in layers)
    for j, layer in enumerate(draft.model.layers):
        layer.self_attn.layer_idx = j
    draft.config.num_hidden_layers = len(layers)
    if getattr(draft.config, "layer_types", None) is not None:
        draft.config.layer_types = [draft.config.layer_types[i] for i in layers]
    return draft


def _answer_labels(c: dict, lookup: torch.Tensor, width: int) -> torch.Tensor:
    """[A, width] the target's next-token distribution at each answer position of corpus entry
    c (its top-k, renormalised over the draft vocabulary's columns)."""
    p = c["top_lp"].float().exp()
    cols = lookup[c["top_ids"].long()]
    keep = cols >= 0
    out = torch.zeros(len(p), width)
    rows = torch.arange(len(p))[:, None].expand_as(cols)
    out[rows[keep], cols[keep]] = p[keep]
    return out / out.sum(-1, keepdim=True).clamp_min(1e-9)


def distill_from_target(
    target: str,
    corpus: list[dict],
    out: Path,
    layers: list[int],
    draft_vocab: int = 8192,
    frozen: int = 0,
    epochs: int = 2,
    batch: int = 16,
    lr: float = 5e-4,
    seed: int = 0,
    log=print,
) -> Path:
    """A draft model cut from the target: its embeddings (and tied LM head), final norm and the
    decoder layers `layers`, the layers (but the first `frozen`, kept exactly the target's: its
    lower layers are a good feature extractor already, and a frozen prefix costs no backward)
    and norm then trained to match the target's next-token
    distribution (its top-k log-probabilities from the corpus, cross-entropy against them) at every
    answer position of the corpus, over the draft vocabulary (draft_vocabulary), which the draft
    then proposes from (draft_vocab.json, engine/models/draft.py). The embeddings stay the
    target's (frozen), so the checkpoint is a plain Llama of the target's width that any runtime
    loads (and llama.cpp converts)."""
    from engine.models.loader.model_loader import load_tokenizer

    torch.manual_seed(seed)
    teacher = load_target(target)
    vocab = teacher.config.vocab_size
    model = cut_layers(teacher, layers)
    del teacher
    ids_vocab = draft_vocabulary(corpus, draft_vocab, vocab)
    lookup = _column_lookup(ids_vocab, vocab)
    model.get_input_embeddings().weight.requires_grad_(False)
    if model.get_output_embeddings() is not None:
        model.get_output_embeddings().weight.requires_grad_(False)
    for layer in model.model.layers[:frozen]:
        layer.requires_grad_(False)
    head = model.get_output_embeddings().weight
    log(
        f"  draft: target layers {layers} ({frozen} frozen), draft vocabulary {len(ids_vocab)}, "
        f"{sum(p.numel() for p in model.parameters() if p.requires_grad)} trained parameters, {len(corpus)} answers, "
        f"{_labelled_positions(corpus)} labelled positions"
    )
    t0 = time.perf_counter()
    loss_value = _distill(
        model, lambda h: h @ head[ids_vocab].T, corpus, lookup, len(ids_vocab), epochs, batch, lr, 0.0, seed, log
    )
    model.eval()
    for p in model.parameters():
        p.requires_grad_(False)
    how = {"init": "target", "target_layers": list(layers), "frozen_layers": frozen}
    trained = {"epochs": epochs, "lr": lr, "batch": batch, "final_loss": loss_value}
    return _save_draft(out, model, load_tokenizer(target), ids_vocab, target, corpus, how, trained, t0)
