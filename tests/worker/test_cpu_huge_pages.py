"""engine/worker/cpu_huge_pages.py: which 2 MB pages the weights' advice covers, and that advising
and collapsing leaves every tensor's address and contents as they were."""

from __future__ import annotations

import torch

from engine.worker.cpu_huge_pages import (
    HUGE_PAGE,
    HugePageAdvice,
    _anonymous_mappings,
    back_with_huge_pages,
    huge_ranges,
)

MB = 1 << 20


class _At:
    """A stand-in for a CPU tensor whose storage lies at `ptr` (huge_ranges reads only that)."""

    device = torch.device("cpu")

    def __init__(self, ptr: int, nbytes: int) -> None:
        self.ptr, self.size = ptr, nbytes

    def untyped_storage(self):
        return self

    def data_ptr(self) -> int:
        return self.ptr

    def nbytes(self) -> int:
        return self.size


def test_huge_ranges_merge_round_out_and_stay_inside_the_mappings():
    base = 1000 * HUGE_PAGE
    mappings = [(base - 4096, base + 10 * HUGE_PAGE + 4096), (base + 20 * HUGE_PAGE + 4096, base + 30 * HUGE_PAGE)]
    tensors = [
        _At(base + 100, 3 * MB),  # pages 0-1, merged with the next
        _At(base + 3 * MB, 2 * MB),  # pages 1-2
        _At(base + 6 * HUGE_PAGE, MB // 2),  # too small: left alone
        _At(base + 9 * HUGE_PAGE + 10, 4 * MB),  # pages 9-11, but the mapping ends inside page 10
        _At(base + 20 * HUGE_PAGE + 8192, 3 * MB),  # pages 20-21; the mapping starts inside page 20
    ]
    got = huge_ranges(tensors, mappings)
    assert got == [
        (base, base + 3 * HUGE_PAGE),
        (base + 9 * HUGE_PAGE, base + 10 * HUGE_PAGE),
        (base + 21 * HUGE_PAGE, base + 22 * HUGE_PAGE),
    ]
    assert huge_ranges(tensors, []) == []


def test_advice_keeps_addresses_and_contents():
    g = torch.Generator().manual_seed(0)
    weights = [torch.randn(3 * MB, generator=g), torch.randn(5, 7, generator=g), torch.randn(MB, generator=g)]
    before = [(w.data_ptr(), w.clone()) for w in weights]
    ranges = huge_ranges(weights, _anonymous_mappings())
    assert ranges and all(lo % HUGE_PAGE == 0 and hi % HUGE_PAGE == 0 and hi > lo for lo, hi in ranges)
    gained = back_with_huge_pages(weights, "test weights")  # (0 where the kernel declines: THP off)
    assert gained >= 0
    for w, (ptr, copy) in zip(weights, before):
        assert w.data_ptr() == ptr and torch.equal(w, copy)
    weights[0].add_(1.0)  # still ordinary writable memory
    assert torch.equal(weights[0], before[0][1] + 1.0)


def test_one_advice_reads_the_mappings_again_only_for_a_tensor_outside_them():
    """The loader's on_allocated (one call per packed buffer): the same pages advised as a read of
    /proc/self/maps per call would give, from one read while the tensors lie inside what it read."""
    region = torch.empty(64 * MB, dtype=torch.uint8)  # (real memory, its own mapping: malloc's mmap)
    # (parts 2 MB away from the region's ends: their pages do not depend on its neighbours)
    parts = [_At(region.data_ptr() + (2 + i * 3) * MB + 100, 3 * MB) for i in range(8)]
    advice, advised = HugePageAdvice(), []
    advice._madvise = lambda lo, n, how: advised.append((lo, lo + n)) or 0
    for part in parts:
        advice([part])
    assert advice.reads == 1
    assert advised == [r for part in parts for r in huge_ranges([part], _anonymous_mappings())]
    given = len(advised)
    advice([_At(HUGE_PAGE, 3 * MB)])  # outside every mapping (the first pages are never mapped)
    assert advice.reads == 2 and len(advised) == given
