"""compiler/kernels/cpu_linear.py: float32 projections through oneDNN agree with F.linear, and the set of
shapes oneDNN sees (one cached primitive each) stays bounded however many row counts arrive."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from compiler.kernels import cpu_linear
from compiler.kernels.cpu_linear import MIN_ONEDNN_ROWS, SHAPES, linear, row_bucket

pytestmark = pytest.mark.skipif(not cpu_linear._ONEDNN, reason="torch built without oneDNN")


def _rss_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS")


def test_row_bucket_is_small_and_covers():
    buckets = {row_bucket(r) for r in range(1, 8193)}
    assert all(row_bucket(r) >= r for r in range(1, 8193))
    assert all(row_bucket(r) <= max(MIN_ONEDNN_ROWS, r * 3 // 2 + 1) for r in range(1, 8193))  # <= 1/3 padding
    assert len(buckets) <= 2 * 8 + 1, sorted(buckets)  # two per power of two from 32 to 8192


@pytest.mark.parametrize("rows", [1, 31, 32, 33, 49, 65, 97, 300, 1000])
@pytest.mark.parametrize("bias", [False, True])
def test_matches_f_linear(rows, bias):
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 96, generator=g)
    w = torch.randn(160, 96, generator=g)
    b = torch.randn(160, generator=g) if bias else None
    with torch.inference_mode():
        y = linear(x, w, b)
        ref = F.linear(x, w, b)
    assert y.shape == ref.shape and y.is_contiguous()
    torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5)


def test_non_contiguous_rows_and_other_paths():
    x = torch.randn(80, 2 * 64)[:, ::2]  # column stride 2: copied into the padded block
    w = torch.randn(32, 64)
    with torch.inference_mode():
        torch.testing.assert_close(linear(x, w), F.linear(x, w), rtol=1e-5, atol=1e-5)
        xb, wb = x.bfloat16(), w.bfloat16()  # bfloat16: F.linear (torch's own oneDNN path)
        assert torch.equal(linear(xb, wb), F.linear(xb, wb))
    # autograd on: F.linear, gradients flow
    xg = torch.randn(70, 64, requires_grad=True)
    linear(xg, w).sum().backward()
    assert xg.grad is not None


def test_shapes_and_memory_stay_bounded_over_many_row_counts():
    """Every row count 1..400 through two weights: the shapes oneDNN sees are the buckets only, and
    a second pass over the same row counts (a server seeing the same batches again) and a pass over
    new ones inside the buckets add no memory (unbucketed: ~0.6 MB per row count and weight)."""
    ws = [torch.randn(256, 128), torch.randn(128, 256)]
    xs = {r: torch.randn(r, 256) for r in range(1, 401)}
    before = set(SHAPES.shapes)

    def sweep(rows):
        with torch.inference_mode():
            for r in rows:
                for w in ws:
                    linear(xs[r][:, : w.shape[1]], w)

    sweep(range(1, 401, 2))
    expected = {(row_bucket(r), w.shape[1], w.shape[0], False) for r in range(MIN_ONEDNN_ROWS, 401) for w in ws}
    assert SHAPES.shapes - before <= expected and len(expected) <= 2 * 10
    rss = _rss_mb()
    sweep(range(1, 401, 2))
    sweep(range(2, 401, 2))  # row counts never seen, all inside known buckets
    assert SHAPES.shapes - before <= expected
    assert _rss_mb() - rss < 8.0, "oneDNN kept building primitives for new row counts"


def test_warm_buckets_builds_every_bucket_once():
    """Start-up builds every bucket up to the step's token budget: serving then adds no shape."""
    w, w2, b = torch.randn(72, 40), torch.randn(72, 40), torch.randn(72)
    built = cpu_linear.warm_buckets([(w, None, None), (w2, None, None), (w, b, None)], 200)  # w2: w's shape
    buckets = sorted({row_bucket(r) for r in range(1, 201)})
    assert built == 2 * len(buckets) and buckets[-1] >= 200
    assert {(r, 40, 72, bias) for r in buckets for bias in (False, True)} <= SHAPES.shapes
    before = set(SHAPES.shapes)
    with torch.inference_mode():
        for r in range(1, 201):
            linear(torch.randn(r, 40), w)
    assert SHAPES.shapes == before


def test_row_slice_of_a_bucket_sized_tensor_is_not_copied():
    """The sampled rows of the forward's bucket-sized hidden states go to oneDNN as a view of their
    storage (no padded copy); the rows past them, whatever they hold (NaN here), change nothing."""
    g = torch.Generator().manual_seed(3)
    full = torch.randn(48, 64, generator=g)
    full[41:] = float("nan")
    w = torch.randn(96, 64, generator=g)
    x = full[:41]
    with torch.inference_mode():
        y = linear(x, w)
        assert cpu_linear._rows_in_storage(x, 48) is not None
        assert cpu_linear._rows_in_storage(x.clone(), 48) is None  # exactly 41 rows of storage: padded copy
        assert cpu_linear._rows_in_storage(full[:, :32], 48) is None  # not contiguous
        torch.testing.assert_close(y, F.linear(x, w), rtol=1e-5, atol=1e-5)
        assert torch.equal(y, linear(x.clone(), w))  # the same bucket either way: the same bits
