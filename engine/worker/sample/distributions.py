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

import numpy as np
import torch

from engine.worker.host_upload import upload


def row_seed(seed: int, sample_index: int, position: int) -> int:
    digest = hashlib.blake2b(f"{seed}:{sample_index}:{position}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


def processed_probs(logits: torch.Tensor, rows: Sequence[Any], greedy: list[bool]) -> torch.Tensor:
    """The distribution each row samples from: softmax(logits / temperature) with top-k, top-p and
    min-p applied (greedy rows at temperature 1; masked tokens 0; rows not renormalised). The
    sampler and a draft model's sampling (engine/spec_decode/rejection.py) share it, so a draft's
    q and the target's p are processed alike.

    The rules are a full descending sort's, without the sort on the CPU (sorting a 49k-token row
    costs more there than a small model's decode step):

    * top-k keeps every token whose logit reaches the row's k-th largest: tokens tied with the
      k-th all stay (a row may keep more than k). The k-th value comes from `topk`.
    * top-p keeps the shortest prefix of the descending order whose mass before its last token
      is below top_p (the top token always stays). Among equal probabilities the lower token id
      comes first (a stable sort's order): that decides a tie across the cut. On the CPU the
      prefix is looked for among the top m candidates (`topk`, m growing, a full sort last),
      used once their mass reaches top_p or the rest of the row is 0: the mass is the same
      cumsum over the same leading values, so the cut is the full sort's, bit for bit.
    * min-p drops tokens below min_p times the row's top probability.
    * a row with a NaN logit (NaN probabilities) stays as softmax gives it.
    """
    vocab = logits.shape[1]
    device = logits.device
    temps = [1.0 if g else r.params.temperature for r, g in zip(rows, greedy)]
    if logits.dtype == torch.float32 and all(t == 1.0 for t in temps):
        scaled = logits  # (x / 1 is x: a pass over the vocabulary saved)
    else:
        scaled = logits / upload(temps, torch.float32, device)[:, None]
    top_k = [r.params.top_k if 0 < r.params.top_k < vocab else 0 for r in rows]  # 0: off
    kept_ids = None
    if any(top_k):
        scaled, kept_ids = _apply_top_k(scaled, top_k, own=scaled is not logits)
    probs = scaled.softmax(dim=-1)
    top_p = [r.params.top_p for r in rows]
    min_p = [r.params.min_p for r in rows]
    if all(p >= 1.0 for p in top_p) and all(m <= 0 for m in min_p):
        return probs
    floor = torch.full((len(rows),), -float("inf"), dtype=probs.dtype, device=device)
    ties: list[_Cut] = []
    if any(p < 1.0 for p in top_p):
        ties = _top_p_cuts(probs, top_p, top_k, kept_ids, floor)
    if any(m > 0 for m in min_p):
        # (top-p keeps the top token, so the row's maximum is the same before and after its cut)
        floor = torch.maximum(floor, upload(min_p, torch.float32, device) * probs.amax(dim=-1))
    probs.masked_fill_(probs < floor[:, None], 0.0)  # (probs is softmax's own tensor)
    for cut in ties:
        cut.drop_tied(probs)
    return probs


def _apply_top_k(
    scaled: torch.Tensor, top_k: list[int], own: bool
) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    """Logits below each row's k-th largest set to -inf (rows with k 0 untouched). Also returns the
    k largest logits' ids (topk's columns) and, per row, whether exactly k tokens stay (none past
    them ties the k-th): top-p takes such a row's candidates from there."""
    device = scaled.device
    width = min(max(top_k) + 1, scaled.shape[1])  # one past the largest k: does the next tie the k-th?
    top_vals, top_ids = top_values(scaled, width)
    on = upload([k > 0 for k in top_k], torch.bool, device)[:, None]
    k_col = upload([k - 1 if k else 0 for k in top_k], torch.int64, device)[:, None]
    kth = torch.where(on, top_vals.gather(1, k_col), -float("inf"))
    exact = on & (top_vals.gather(1, k_col + 1) < kth)  # (false for a NaN k-th)
    below = scaled < kth
    # (in place unless scaled is the caller's logits themselves)
    masked = scaled.masked_fill_(below, -float("inf")) if own else scaled.masked_fill(below, -float("inf"))
    return masked, (top_ids, exact[:, 0])


# Block widths of the top-m search, widest first: a row is cut into blocks, and only the m blocks
# with the largest maxima can hold the row's m largest values.
_BLOCKS = (64, 32, 16, 8)


def top_values(x: torch.Tensor, m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`x.topk(m, dim=-1)` (values in descending order, NaN first as topk orders it; the ids of
    equal values in any order), searching only the m blocks with the largest maxima: those maxima
    are m values at least the m-th largest block maximum t, so every value above t lies in those
    blocks and, with them, enough values equal to t. torch's topk on the CPU copies every (value,
    id) of a row first; the blocks' maxima are one vectorised pass. The widest block that leaves at
    most half the row to search is used (none: topk itself)."""
    n, vocab = x.shape
    width = next((b for b in _BLOCKS if vocab % b == 0 and m * b * 2 <= vocab), None)
    if width is None or not x.is_contiguous():
        return x.topk(m, dim=-1)
    tiles = x.view(n, vocab // width, width)
    picked = tiles.amax(dim=-1).topk(m, dim=-1).indices  # [n, m]
    cand = tiles.gather(1, picked[:, :, None].expand(n, m, width)).view(n, m * width)
    top = cand.topk(m, dim=-1)
    col = top.indices
    ids = picked.gather(1, torch.div(col, width, rounding_mode="floor")) * width + col % width
    return top.values, ids


# Candidate counts tried for top-p before the full sort: a trained model's cut at top_p 0.9-0.95 is
# usually within the first few dozen tokens, a flat row's within thousands.
_TOP_P_WIDTHS = (64, 512, 4096)


class _Cut:
    """Top-p cuts of some rows, from the first m values of each row's descending order (the whole
    order where m is the vocabulary, or where the rest of the row is 0 or the mass before the m-th
    reaches top_p): the floor (the last kept probability) and, for a cut inside a run of equal
    probabilities, how many of them stay (the first by token id)."""

    def __init__(self, rows: torch.Tensor, vals: torch.Tensor, p: torch.Tensor) -> None:
        m = vals.shape[1]
        cum = vals.cumsum(dim=-1)
        # the reference's rule: drop a token when the mass before it reaches top_p
        kept = ((cum - vals) < p).sum(dim=-1, keepdim=True).clamp_min(1)  # (0 for a NaN row)
        self.rows = rows
        self.floor = vals.gather(1, kept - 1)
        after = vals.gather(1, kept.clamp_max(m - 1))
        self.split = (kept < m) & (after == self.floor) & (self.floor > 0)  # [r, 1]
        self.keep = kept - (vals > self.floor).sum(dim=-1, keepdim=True)  # tied tokens kept

    def drop_tied(self, probs: torch.Tensor) -> None:
        """Of the tokens equal to the floor, drop all but the first `keep` (in split cuts' rows)."""
        rows, floor, keep = self.rows, self.floor, self.keep
        on_cpu = probs.device.type == "cpu"
        if on_cpu:  # (the rows picked on the host: a split cut is rare)
            pick = self.split[:, 0].nonzero()[:, 0]
            if not len(pick):
                return
            rows, floor, keep = rows[pick], floor[pick], keep[pick]
        sub = probs.index_select(0, rows)
        tied = sub == floor
        if not on_cpu:  # (no host sync: every row, masked)
            tied &= self.split
        probs.index_copy_(0, rows, sub.masked_fill(tied & (tied.cumsum(dim=-1) > keep), 0.0))


def _top_p_cuts(
    probs: torch.Tensor,
    top_p: list[float],
    top_k: list[int],
    kept_ids: tuple[torch.Tensor, torch.Tensor] | None,
    floor: torch.Tensor,
) -> list[_Cut]:
    """Each top-p row's cut: its floor written into `floor`, the cuts returned (for ties)."""
    device = probs.device
    vocab = probs.shape[1]
    p_all = upload(top_p, torch.float32, device)[:, None]
    cuts: list[_Cut] = []

    def cut(index: torch.Tensor, vals: torch.Tensor) -> None:
        c = _Cut(index, vals, p_all.index_select(0, index))
        floor.index_copy_(0, index, c.floor[:, 0])
        cuts.append(c)

    left = [i for i, p in enumerate(top_p) if p < 1.0]
    if device.type != "cpu":  # a sort is cheap there, a host sync to pick rows is not
        index = upload(left, torch.int64, device)
        cut(index, probs.index_select(0, index).sort(dim=-1, descending=True, stable=True).values)
        return cuts
    if kept_ids is not None:
        # A top-k row that keeps exactly k tokens is 0 past them: its candidates are those k.
        ids, exact_rows = kept_ids
        exact = exact_rows.tolist()
        rows = [i for i in left if exact[i]]
        if rows:
            index = upload(rows, torch.int64, device)
            cand = probs.index_select(0, index).gather(1, ids.index_select(0, index))
            past_k = (
                torch.arange(ids.shape[1], device=device)[None, :]
                >= upload([top_k[i] for i in rows], torch.int64, device)[:, None]
            )
            cut(index, cand.masked_fill(past_k, 0.0).sort(dim=-1, descending=True).values)
            left = [i for i in left if not exact[i]]
    for width in (*(w for w in _TOP_P_WIDTHS if w < vocab), vocab):
        if not left:
            break
        index = upload(left, torch.int64, device)
        sub = probs if len(left) == len(top_p) else probs.index_select(0, index)
        if width == vocab:
            cut(index, sub.sort(dim=-1, descending=True).values)
            break
        vals = top_values(sub, width)[0]
        # Enough candidates: the mass before the last reaches top_p (the last is cut), or the rest
        # of the row is 0 (where the cut falls among zeros changes nothing), or the row is NaN.
        cum_before_last = vals.cumsum(dim=-1)[:, -1] - vals[:, -1]
        p = p_all.index_select(0, index)[:, 0]
        enough = ((vals[:, -1] == 0) | vals[:, 0].isnan() | (cum_before_last >= p)).tolist()
        done = [j for j, e in enumerate(enough) if e]
        if done:
            cut(upload([left[j] for j in done], torch.int64, device), vals[done])
        left = [left[j] for j, e in enumerate(enough) if not e]
    return cuts


# The smallest uniform kept: -log of it (17.3) bounds the noise, so a draw of exactly 0 (one in 2^24
# per token, a few per thousand rows of a 49k vocabulary) cannot exclude a token from the race.
_TINY_UNIFORM = 2.0**-25


def exp_noise(like: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """Exp(1) samples shaped like `like`, as -log(U) (torch's exponential_ draws each value on its
    own on the CPU: ~14 ms for 16 rows of a 49k vocabulary on one core, a quarter of a decode step)."""
    u = _uniform_(torch.empty_like(like, dtype=torch.float32), generator=generator)
    return _neg_log(u).to(like.dtype)


def _uniform_(u: torch.Tensor, generator: torch.Generator | None = None, seed: int | None = None) -> torch.Tensor:
    """Fill float32 `u` with U(0, 1) draws from `generator`, or from the stream `seed` names. On the
    CPU the draws come from numpy's PCG64 (seeded by one draw from `generator` when no seed is given):
    torch's uniform_ there runs a Mersenne twister value by value (~5 ms for 16 rows of a 49k
    vocabulary, PCG64 ~1.3)."""
    if u.device.type == "cpu":
        rng = np.random.Generator(np.random.PCG64(_draw_seed(generator) if seed is None else seed))
        rng.random(out=u.numpy(), dtype=np.float32)
    else:
        u.uniform_(generator=generator if seed is None else torch.Generator(device=u.device).manual_seed(seed))
    return u


def _draw_seed(generator: torch.Generator | None) -> int:
    return int(torch.randint(0, 2**62, (1,), generator=generator))


def _neg_log(u: torch.Tensor) -> torch.Tensor:
    return u.clamp_min_(_TINY_UNIFORM).log_().neg_()


def race_noise(
    probs: torch.Tensor, rows: Sequence[Any], greedy: list[bool], generator: torch.Generator
) -> torch.Tensor:
    """Exp(1) noise for the exponential race (argmax of probs / noise samples probs): from
    `generator`, except a seeded row's, drawn from its own stream seeded by (seed, sample index,
    output position). A draft sampled with its row's seeded noise picks the target's own
    token whenever it can (the two share the race): seeded output is plain decoding's.

    A seeded row's uniforms are drawn in place into the batch's, and the log taken once for all
    rows; a batch of seeded rows only draws nothing from `generator`."""
    seeded = [i for i, r in enumerate(rows) if r.params.seed is not None and not greedy[i]]
    if not seeded:
        return exp_noise(probs, generator)
    u = torch.empty_like(probs, dtype=torch.float32)
    if len(seeded) < len(rows):  # (every row, the seeded too: the others' draws stay as they were)
        _uniform_(u, generator=generator)
    for i in seeded:
        r = rows[i]
        _uniform_(u[i], seed=row_seed(r.params.seed, r.sample_index, r.num_output_tokens))
    return _neg_log(u).to(probs.dtype)
