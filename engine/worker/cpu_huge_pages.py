"""A CPU engine's weights on 2 MB transparent huge pages.

A decode step on the CPU streams every weight once (513 MB for SmolLM2 in float32). On 4 KB pages
that is ~125,000 pages a step, each a TLB miss, and in a virtual machine every miss walks two page
tables (the guest's and the host's); on 2 MB pages it is ~250. llama.cpp reads the GGUF file
through the page cache, which the kernel may hold in large folios; kiln copies weights into
anonymous memory, which Linux backs with huge pages only where a range is advised
(transparent_hugepage=madvise, the common default). So once the weights are loaded, the 2 MB
ranges they cover are advised (MADV_HUGEPAGE) and collapsed into huge pages now (MADV_COLLAPSE,
Linux 6.1+: the same virtual addresses, the contents copied once), which leaves every tensor where
it is: nothing that holds a weight (the C++ decoder stack, packed layouts) has to be rebuilt.

The KV cache is left on its pages: collapsing it would copy all of it at every start (0.2 s for
the test model's default cache), and a decode step reads only its live blocks.

Where the kernel says no (older kernels, THP off, no free huge pages), the pages stay as they were
and start-up says so. Measured on SmolLM2 F32, two engines in one process: benchmarks/.
"""

from __future__ import annotations

import ctypes
import logging
import os
from pathlib import Path
from typing import Callable

import torch

logger = logging.getLogger(__name__)

HUGE_PAGE = 2 << 20
MADV_HUGEPAGE = 14
MADV_COLLAPSE = 25
MIN_BYTES = 1 << 20  # tensors smaller than this are left alone (their pages are mostly shared with others)


def _anonymous_mappings() -> list[tuple[int, int]]:
    """[start, end) of this process's private anonymous writable mappings (the heap and mmap'd
    allocations; not files, stacks or special regions)."""
    out = []
    for line in Path("/proc/self/maps").read_text().splitlines():
        fields = line.split()
        name = fields[5] if len(fields) > 5 else ""
        if fields[1].startswith("rw") and fields[1].endswith("p") and name in ("", "[heap]"):
            start, end = fields[0].split("-")
            out.append((int(start, 16), int(end, 16)))
    return out


def huge_ranges(
    tensors: list[torch.Tensor], mappings: list[tuple[int, int]], min_bytes: int = MIN_BYTES
) -> list[tuple[int, int]]:
    """The whole 2 MB pages that the CPU tensors of at least min_bytes touch, merged and cut to the
    anonymous mappings they lie in (a huge page never straddles a mapping's edge)."""
    spans = []
    for t in tensors:
        nbytes = t.untyped_storage().nbytes()
        if t.device.type != "cpu" or nbytes < min_bytes:
            continue
        start = t.untyped_storage().data_ptr()
        spans.append((start // HUGE_PAGE * HUGE_PAGE, -(-(start + nbytes) // HUGE_PAGE) * HUGE_PAGE))
    merged: list[tuple[int, int]] = []
    for a, b in sorted(spans):
        if merged and a <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], b))
        else:
            merged.append((a, b))
    out = []
    for a, b in merged:
        for m0, m1 in mappings:
            lo = max(a, -(-m0 // HUGE_PAGE) * HUGE_PAGE)
            hi = min(b, m1 // HUGE_PAGE * HUGE_PAGE)
            if hi > lo:
                out.append((lo, hi))
    return out


def _anon_huge_bytes() -> int:
    for line in Path("/proc/self/smaps_rollup").read_text().splitlines():
        if line.startswith("AnonHugePages:"):
            return int(line.split()[1]) * 1024
    return 0


def advise_huge_pages(tensors: list[torch.Tensor]) -> None:
    """MADV_HUGEPAGE over `tensors` before anything is written to them (the loader, right after
    allocation): the load's page faults then take 2 MB pages directly, and back_with_huge_pages
    has little left to collapse (a collapse copies: 25 s for a 1B bf16 model's 2.4 GB on a loaded
    2-core machine, issue 40). Silent where the kernel declines: back_with_huge_pages reports."""
    HugePageAdvice()(tensors)


class HugePageAdvice:
    """advise_huge_pages for one load's many allocations (the loader's on_allocated): the mappings
    are read again only when a tensor lies outside those read last (a /proc/self/maps read per
    allocation, ~1 ms with torch's libraries mapped, was ~0.1 s of SmolLM2's 122; issue 40)."""

    def __init__(self) -> None:
        self.mappings: list[tuple[int, int]] | None = None
        self.reads = 0
        self._madvise: Callable[..., int] | None = None

    def __call__(self, tensors: list[torch.Tensor]) -> None:
        try:
            if self.mappings is None or not _inside(tensors, self.mappings):
                self.mappings, self.reads = _anonymous_mappings(), self.reads + 1
        except OSError:
            return
        if self._madvise is None:
            libc = ctypes.CDLL(None, use_errno=True)
            libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
            self._madvise = libc.madvise
        for lo, hi in huge_ranges(tensors, self.mappings):
            self._madvise(lo, hi - lo, MADV_HUGEPAGE)


def _inside(tensors: list[torch.Tensor], mappings: list[tuple[int, int]], min_bytes: int = MIN_BYTES) -> bool:
    """Whether each CPU tensor huge_ranges would advise lies whole inside `mappings` (adjacent ones
    joined: advice splits the mapping it covers part of, and a tensor may span the pieces)."""
    joined: list[tuple[int, int]] = []
    for m0, m1 in sorted(mappings):
        if joined and m0 == joined[-1][1]:
            joined[-1] = (joined[-1][0], m1)
        else:
            joined.append((m0, m1))
    for t in tensors:
        nbytes = t.untyped_storage().nbytes()
        if t.device.type != "cpu" or nbytes < min_bytes:
            continue
        start = t.untyped_storage().data_ptr()
        if not any(m0 <= start and start + nbytes <= m1 for m0, m1 in joined):
            return False
    return True


def back_with_huge_pages(tensors: list[torch.Tensor], what: str) -> int:
    """Advise and collapse the huge pages under `tensors` (see the module doc). Returns the bytes
    newly on huge pages (0 where the kernel declined), and logs the outcome."""
    try:
        mappings = _anonymous_mappings()
        before = _anon_huge_bytes()
    except OSError as e:  # no /proc (not Linux): nothing to do
        logger.info("%s: huge pages not tried (%s)", what, e)
        return 0
    ranges = huge_ranges(tensors, mappings)
    if not ranges:
        return 0
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    failed = set()
    for lo, hi in ranges:
        for advice in (MADV_HUGEPAGE, MADV_COLLAPSE):
            if libc.madvise(lo, hi - lo, advice) != 0:
                failed.add((advice, ctypes.get_errno()))
    after = _anon_huge_bytes()
    gained = after - before
    wanted = sum(hi - lo for lo, hi in ranges)
    held = min(after, wanted)  # (on huge pages already from the load's faults, advise_huge_pages, or now)
    if failed:
        reasons = ", ".join(
            f"{'MADV_COLLAPSE' if a == MADV_COLLAPSE else 'MADV_HUGEPAGE'}: {os.strerror(e)}" for a, e in sorted(failed)
        )
        logger.info(
            "%s: %.0f of %.0f MiB on 2 MB huge pages (the kernel declined some: %s)",
            what,
            held / 2**20,
            wanted / 2**20,
            reasons,
        )
    else:
        logger.info("%s: %.0f of %.0f MiB on 2 MB huge pages", what, held / 2**20, wanted / 2**20)
    return max(gained, 0)
