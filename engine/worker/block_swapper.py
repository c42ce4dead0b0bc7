"""Moving KV blocks between the paged GPU cache and a pinned CPU block pool.

Layouts
  cache  [layers, 2, num_blocks, block_size, kv_heads, head_dim]  (engine/layers/kv_cache.py)
  pool   [num_cpu_blocks, layers, 2, block_size, kv_heads, head_dim]  one contiguous block each
Both are handled *block-major*: `cache.permute(2, 0, 1, 3, 4, 5)` is a strided view whose
dim 0 is the block, so one block of every layer's K and V is `view[i]`.

`swap_blocks(src, dst, mapping, staging)` copies src[s] -> dst[d] for each (s, d):
  * to a contiguous destination (swap-out): one `index_select` gathers up to
    `len(staging)` source blocks into the contiguous staging buffer (on the source's
    device), then each run of consecutive destination ids is one copy (one DMA per run);
  * from a contiguous source (swap-in): each run of consecutive source ids is one copy
    into staging, then one `index_copy_` scatters staging into the destination blocks.
Nothing syncs with the host; CPU-only runs take the same path with CPU tensors.

`BlockSwapper` owns the CPU pool, the staging buffer, and on CUDA a side stream and an
event. Ordering (all on the side stream, so swaps are ordered among themselves):
  launch():  side stream waits for the compute stream (the blocks being read were written by
             earlier steps); swap-outs, then swap-ins, are queued; an event is recorded.
  wait():    the compute stream waits on that event, so the step's copy-on-write copies and
             forward (which may write into blocks a swap-out is still reading, and read blocks
             a swap-in is still writing) run only after every queued copy is done.
The runner calls launch() first and wait() after preparing the step's inputs, so the
copies overlap the host-side preparation. `measurement()` reports how long a finished
launch took (CUDA events, read without blocking; host time on the CPU), for the engine's
swap-or-recompute cost model.
"""

from __future__ import annotations

import time
from typing import Sequence

import torch

from compiler.kernels.kv_quant import byte_view
from engine.worker.host_upload import upload

Mapping = Sequence[tuple[int, int]]


def block_major(cache: torch.Tensor) -> torch.Tensor:
    """[layers, 2, num_blocks, ...] -> a view [num_blocks, layers, 2, ...] (no copy)."""
    return cache.permute(2, 0, 1, *range(3, cache.dim()))


def _runs(ids: list[int]) -> list[tuple[int, int, int]]:
    """(position in ids, first id, length) for each run of consecutive ids."""
    runs: list[tuple[int, int, int]] = []
    start = 0
    for i in range(1, len(ids) + 1):
        if i == len(ids) or ids[i] != ids[i - 1] + 1:
            runs.append((start, ids[start], i - start))
            start = i
    return runs


def _index(ids: list[int], device: torch.device) -> torch.Tensor:
    """Block ids as an int64 tensor on `device`; via pinned memory, so the upload is async."""
    return upload(ids, torch.int64, device)


def swap_blocks(src: torch.Tensor, dst: torch.Tensor, mapping: Mapping | torch.Tensor, staging: torch.Tensor) -> int:
    """Copy blocks src[s] -> dst[d] for (s, d) in mapping (block-major tensors); returns bytes.

    One of src/dst must be contiguous (the CPU pool); `staging` is a contiguous
    [k, *block_shape] buffer on the other one's device, used k blocks at a time.
    Copies are queued on the current stream, non-blocking.
    """
    if isinstance(mapping, torch.Tensor):
        mapping = [tuple(p) for p in mapping.tolist()]
    if not mapping:
        return 0
    if src.shape[1:] != dst.shape[1:] or src.dtype != dst.dtype:
        raise ValueError(
            f"block shapes differ: {tuple(src.shape[1:])} {src.dtype} vs {tuple(dst.shape[1:])} {dst.dtype}"
        )
    src, dst, staging = byte_view(src), byte_view(dst), byte_view(staging)
    cap = staging.shape[0]
    gather = dst.is_contiguous()
    if not gather and not src.is_contiguous():
        raise ValueError("swap_blocks: one side must be the contiguous block pool")
    dev = staging.device
    for lo in range(0, len(mapping), cap):
        chunk = mapping[lo : lo + cap]
        k = len(chunk)
        src_ids = [s for s, _ in chunk]
        dst_ids = [d for _, d in chunk]
        if gather:
            index = _index(src_ids, dev)
            torch.index_select(src, 0, index, out=staging[:k])
            for pos, first, n in _runs(dst_ids):
                dst[first : first + n].copy_(staging[pos : pos + n], non_blocking=True)
        else:
            for pos, first, n in _runs(src_ids):
                staging[pos : pos + n].copy_(src[first : first + n], non_blocking=True)
            index = _index(dst_ids, dev)
            dst.index_copy_(0, index, staging[:k])
    return len(mapping) * src[0].numel() * src.element_size()


class BlockSwapper:
    """The CPU block pool plus the stream/event machinery that moves blocks to and from it."""

    def __init__(
        self, cache: torch.Tensor, num_cpu_blocks: int, staging_bytes: int = 128 << 20, pin_memory: bool | None = None
    ) -> None:
        self.device = cache.device
        # An fp8 cache moves as its bytes (uint8): the same copies, and CPU index kernels that
        # have no float8 version work on it.
        cache = byte_view(cache)
        self.gpu = block_major(cache)
        block_shape = tuple(self.gpu.shape[1:])
        self.bytes_per_block = self.gpu[0].numel() * cache.element_size()
        if pin_memory is None:
            pin_memory = self.device.type == "cuda"
        # torch.empty: the pool's pages are touched only when blocks are swapped into them.
        self.cpu = torch.empty((num_cpu_blocks, *block_shape), dtype=cache.dtype, pin_memory=pin_memory)
        cap = max(1, min(num_cpu_blocks, staging_bytes // self.bytes_per_block))
        self.staging = torch.empty((cap, *block_shape), dtype=cache.dtype, device=self.device)
        self.is_cuda = self.device.type == "cuda"
        self.stream = torch.cuda.Stream(device=self.device) if self.is_cuda else None
        self.started = torch.cuda.Event(enable_timing=True) if self.is_cuda else None
        self.done = torch.cuda.Event(enable_timing=True) if self.is_cuda else None
        self._in_flight = False
        self._unmeasured: tuple[int, float] | None = None  # (bytes, seconds; -1 until read off events)
        self.bytes_out = 0
        self.bytes_in = 0

    def launch(self, swap_out: Mapping, swap_in: Mapping) -> None:
        """Queue this step's copies: (gpu, cpu) pairs out, then (cpu, gpu) pairs in."""
        if not swap_out and not swap_in:
            return
        if not self.is_cuda:
            t0 = time.perf_counter()
            moved = self._copy(swap_out, swap_in)
            self._unmeasured = (moved, time.perf_counter() - t0)
            return
        # (a launch not yet measured when the next one starts goes unmeasured)
        compute = torch.cuda.current_stream(self.device)
        self.stream.wait_stream(compute)
        with torch.cuda.stream(self.stream):
            self.started.record(self.stream)
            moved = self._copy(swap_out, swap_in)
            self.done.record(self.stream)
        self._in_flight = True
        self._unmeasured = (moved, -1.0)

    def _copy(self, swap_out: Mapping, swap_in: Mapping) -> int:
        out = swap_blocks(self.gpu, self.cpu, swap_out, self.staging)
        into = swap_blocks(self.cpu, self.gpu, swap_in, self.staging)
        self.bytes_out += out
        self.bytes_in += into
        return out + into

    def measurement(self) -> tuple[int, float] | None:
        """(bytes, seconds) of the last launch, once, if it has finished; never blocks."""
        if self._unmeasured is None:
            return None
        moved, seconds = self._unmeasured
        if seconds < 0:
            if not self.done.query():
                return None
            seconds = self.started.elapsed_time(self.done) / 1e3
        self._unmeasured = None
        return moved, seconds

    def wait(self) -> None:
        """Order the compute stream after every queued copy (no host sync)."""
        if self._in_flight:
            torch.cuda.current_stream(self.device).wait_event(self.done)
            self._in_flight = False

    def synchronize(self) -> None:
        """Block the host until every queued copy is done (tests, benchmarks, shutdown)."""
        if self.is_cuda:
            self.done.synchronize()
            self._in_flight = False


class SwapGroup:
    """Several caches indexed by the same block ids (a target's and its draft model's), each with
    its own BlockSwapper of the same number of CPU blocks: one launch moves a block in all."""

    def __init__(self, swappers: list[BlockSwapper]) -> None:
        self.swappers = swappers

    @property
    def bytes_out(self) -> int:
        return sum(s.bytes_out for s in self.swappers)

    @property
    def bytes_in(self) -> int:
        return sum(s.bytes_in for s in self.swappers)

    def launch(self, swap_out: Mapping, swap_in: Mapping) -> None:
        for s in self.swappers:
            s.launch(swap_out, swap_in)

    def measurement(self) -> tuple[int, float] | None:
        found = [s.measurement() for s in self.swappers]
        if any(m is None for m in found):
            return None
        return sum(m[0] for m in found), sum(m[1] for m in found)

    def wait(self) -> None:
        for s in self.swappers:
            s.wait()

    def synchronize(self) -> None:
        for s in self.swappers:
            s.synchronize()
