"""processed_probs (engine/worker/sample/distributions.py) against the full-sort implementation it
replaced, kept as the reference (tests/support/full_sort_probs.py): on random logits with ties,
-inf and NaN entries, for every combination of temperature / top-k / top-p / min-p in one mixed
batch, the kept sets and the probabilities are equal bit for bit on the CPU (the same softmax,
and the same cumsum over the same leading values of the descending order). The reference's sort
is stable: among equal probabilities the lower token id comes first, the documented tie rule."""

from __future__ import annotations

import collections
import itertools
from types import SimpleNamespace

import pytest
import torch
from torch.overrides import TorchFunctionMode

from engine.core.params import SamplingParams
from engine.worker.sample import distributions
from engine.worker.sample.distributions import processed_probs, top_values
from tests.support.full_sort_probs import full_sort_probs as reference_probs


def _row(**params) -> SimpleNamespace:
    return SimpleNamespace(params=SamplingParams(**params))


def _assert_same(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape
    nan = want.isnan()
    assert torch.equal(got.isnan(), nan)
    diff = (got != want) & ~nan
    assert not diff.any(), f"rows differ: {diff.any(dim=-1).nonzero()[:, 0].tolist()}"


def _logits(n: int, vocab: int, gen: torch.Generator) -> torch.Tensor:
    """Rows of several kinds, cycling: peaked, flat (a cut in the thousands), coarse (ties
    everywhere), with -inf entries, a NaN entry, a +inf entry, all -inf, all equal."""
    base = torch.randn(n, vocab, generator=gen)
    out = torch.empty(n, vocab)
    for i in range(n):
        kind = i % 8
        row = base[i]
        if kind == 0:
            row = row * 4  # peaked
        elif kind == 1:
            row = row * 0.05  # flat
        elif kind == 2:
            row = (row * 2).round() / 2  # coarse: runs of equal logits
        elif kind == 3:
            row = row * 3
            row[torch.rand(vocab, generator=gen) < 0.5] = -float("inf")
        elif kind == 4:
            row = row.clone()
            row[7] = float("nan")
        elif kind == 5:
            row = row.clone()
            row[3] = float("inf") if i % 16 == 5 else -float("inf")
        elif kind == 6:
            row = torch.full((vocab,), -float("inf")) if i % 16 == 6 else (row * 0.5).round()
        else:
            row = torch.zeros(vocab) if i % 16 == 7 else row
        out[i] = row
    return out


_COMBOS = list(
    itertools.product(
        (0.0, 0.7, 1.0, 1.5),  # temperature (0: greedy, processed at temperature 1)
        (-1, 1, 5, 40, 600, 10**6),  # top_k
        (1.0, 0.3, 0.9, 0.95, 0.999),  # top_p
        (0.0, 0.05, 0.3),  # min_p
    )
)


@pytest.mark.parametrize("vocab", [300, 5000, 8192])  # (8192: whole blocks, top_values' search)
def test_matches_the_full_sort_on_every_combination(vocab):
    gen = torch.Generator().manual_seed(vocab)
    rows = [_row(temperature=t, top_k=k, top_p=p, min_p=m) for t, k, p, m in _COMBOS]
    greedy = [r.params.greedy for r in rows]
    logits = _logits(len(rows), vocab, gen)
    _assert_same(processed_probs(logits, rows, greedy), reference_probs(logits, rows, greedy))


def test_matches_the_full_sort_on_bfloat16_logits():
    gen = torch.Generator().manual_seed(1)
    rows = [_row(temperature=t, top_k=k, top_p=p, min_p=m) for t, k, p, m in _COMBOS[::3]]
    greedy = [r.params.greedy for r in rows]
    logits = _logits(len(rows), 700, gen).to(torch.bfloat16)
    _assert_same(processed_probs(logits, rows, greedy), reference_probs(logits, rows, greedy))


class _CountOps(TorchFunctionMode):
    def __init__(self) -> None:
        super().__init__()
        self.calls: collections.Counter = collections.Counter()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if name == "topk":
            self.calls[("topk", args[1] if len(args) > 1 else kwargs.get("k"))] += 1
        elif name == "sort":
            self.calls[("sort", args[0].shape[1])] += 1
        return func(*args, **kwargs)


def test_top_p_widens_its_candidates_only_as_far_as_the_cut_needs():
    """Rows whose cut lies within 64, 512 and 4096 candidates and one past them: each width is
    searched once, the full sort is the last resort, and the result is the full sort's."""
    vocab = 6001  # (not a multiple of a block width: topk itself, counted below)
    widths = distributions._TOP_P_WIDTHS
    assert widths == (64, 512, 4096)
    logits = torch.full((5, vocab), -30.0)
    for i, n in enumerate((10, 300, 3000, 5500)):
        logits[i, :n] = torch.linspace(0.0, 0.1, n)  # a plateau of n tokens holding ~all the mass
    logits[4] = torch.randn(vocab, generator=torch.Generator().manual_seed(0)) * 5  # peaked
    rows = [_row(top_p=0.9) for _ in range(5)]
    counter = _CountOps()
    with counter:
        got = processed_probs(logits, rows, [False] * 5)
    assert counter.calls == {("topk", 64): 1, ("topk", 512): 1, ("topk", 4096): 1, ("sort", vocab): 1}, counter.calls
    _assert_same(got, reference_probs(logits, rows, [False] * 5))
    for i, n in enumerate((10, 300, 3000, 5500)):
        assert 0.85 * n <= int((got[i] > 0).sum()) <= 0.95 * n


def test_top_k_with_top_p_reads_its_candidates_from_top_k():
    """A top-k row without a tie past its k-th: one topk over the logits serves top-p too."""
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(4, 2001, generator=gen) * 2
    rows = [_row(top_k=40, top_p=0.95, min_p=0.05, temperature=0.8) for _ in range(4)]
    counter = _CountOps()
    with counter:
        got = processed_probs(logits, rows, [False] * 4)
    assert counter.calls == {("topk", 41): 1, ("sort", 41): 1}, counter.calls
    _assert_same(got, reference_probs(logits, rows, [False] * 4))


def test_tie_rules():
    """top-k keeps every token tied with the k-th; a top-p cut inside a run of equal
    probabilities keeps the run's lowest token ids."""
    logits = torch.tensor([[0.0, 2.0, 1.0, 2.0, 1.0, 1.0, -1.0]])
    kept = processed_probs(logits, [_row(top_k=3)], [False])[0] > 0
    assert kept.tolist() == [False, True, True, True, True, True, False]  # k=3: the 1.0s tie the 3rd
    flat = torch.zeros(1, 10)  # ten tokens of 0.1: the mass before the 5th is 0.4 (< 0.45), before the 6th 0.5
    kept = processed_probs(flat, [_row(top_p=0.45)], [False])[0] > 0
    assert kept.tolist() == [True] * 5 + [False] * 5
    run = torch.tensor([[5.0, 0.0, 3.0, 3.0, 0.0, 3.0, 3.0, 3.0]])  # a cut inside the run of 3.0s
    for p in (0.5, 0.9, 0.99):
        got = processed_probs(run, [_row(top_p=p)], [False])
        _assert_same(got, reference_probs(run, [_row(top_p=p)], [False]))
    kept = processed_probs(run, [_row(top_p=0.9)], [False])[0] > 0
    assert kept.tolist() == [True, False, True, True, False, True, True, False]  # 4 of the 5 3.0s


@pytest.mark.parametrize("m", [1, 5, 41, 64])
def test_top_values_is_topk(m):
    """The block search gives topk's values bit for bit (NaN first) and ids that hold them."""
    gen = torch.Generator().manual_seed(m)
    x = _logits(16, 64 * 160, gen)
    x[9, :300] = 5.0  # a run of equal maxima across blocks: more ties than m
    x[10, ::64] = float("nan")  # a NaN in every block
    got, ids = top_values(x, m)
    want = x.topk(m, dim=-1).values
    assert torch.equal(got.isnan(), want.isnan()) and torch.equal(got.nan_to_num(), want.nan_to_num())
    assert torch.equal(x.gather(1, ids).nan_to_num(), got.nan_to_num())
    assert all(len(set(r)) == m for r in ids.tolist())


def test_race_noise_of_seeded_rows_depends_on_their_seed_only():
    """A seeded row's noise is a function of (seed, sample index, output position) alone, whatever
    the batch and its generator; the other rows get the batch generator's noise as if no row were
    seeded; a batch of seeded rows leaves the batch generator untouched. All of it Exp(1)-shaped."""
    vocab = 1000
    probs = torch.rand(4, vocab)
    rows = [_row(seed=5), _row(), _row(seed=9), _row()]
    for r, i in zip(rows, range(4)):
        r.sample_index, r.num_output_tokens = i, 3 + i
    noise = distributions.race_noise(probs, rows, [False] * 4, torch.Generator().manual_seed(1))
    plain = distributions.exp_noise(probs, torch.Generator().manual_seed(1))
    assert torch.equal(noise[[1, 3]], plain[[1, 3]])
    alone = distributions.race_noise(probs[:2], [rows[2], rows[0]], [False, False], torch.Generator().manual_seed(7))
    assert torch.equal(alone, noise[[2, 0]])
    assert not torch.equal(noise[0], noise[2]) and not torch.equal(noise[0], plain[0])
    gen = torch.Generator().manual_seed(1)
    before = gen.get_state()
    distributions.race_noise(probs[:2], [rows[0], rows[2]], [False, False], gen)
    assert torch.equal(gen.get_state(), before)
    big = distributions.exp_noise(torch.empty(200, vocab), torch.Generator().manual_seed(3))
    assert float(big.min()) > 0 and abs(float(big.mean()) - 1.0) < 0.01 and abs(float(big.var()) - 1.0) < 0.03
