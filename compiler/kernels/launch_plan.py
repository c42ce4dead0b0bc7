"""How one paged-attention call becomes kernel launches: pure Python over ints (no torch, no CUDA).

Three decisions live here so they can be unit-tested on any machine:

- which rows go to which kernel: in a mixed step the leading `num_decodes` sequences (one
  query token each; the scheduler puts decodes first) take the decode kernel, the rest the
  prefill kernel (`plan_attention_launches`);
- grid limits: a grid's z (and the combine kernel's y) dimension holds at most 65,535
  sequences, so larger launches are cut into chunks;
- split-KV sizing: how many splits each (sequence, kv-head slice) gets so that the launch
  fills whole waves of the GPU (`plan_decode_splits`), given how many CTAs of the decode
  kernel fit on one SM (`ctas_per_sm_from_resources` from ptxas's report, or the driver's
  occupancy query on a GPU).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

GRID_Z_MAX = 65535  # CUDA's limit on gridDim.y and gridDim.z

# Hopper (sm_90) per-SM limits used to derive occupancy from ptxas's resource report.
SM90_REGISTERS_PER_SM = 65536
SM90_MAX_THREADS_PER_SM = 2048
SM90_MAX_CTAS_PER_SM = 32
SM90_SHARED_BYTES_PER_SM = 228 * 1024
SM90_SHARED_RESERVED_PER_CTA = 1024
REGISTER_ALLOCATION_UNIT = 256  # registers are allocated per warp in units of 256


@dataclass(frozen=True)
class Launch:
    """One kernel launch over sequences [seq_start, seq_start + num_seqs).

    zero_tail: this launch also zeroes the padding rows after the last sequence's tokens
    (only the last launch of a call does; the others must leave later rows alone).
    """

    kind: str  # "decode" or "prefill"
    seq_start: int
    num_seqs: int
    zero_tail: bool = False


def decode_rows(num_seqs: int, max_query_len: int, num_decodes: int) -> int:
    """How many leading sequences take the decode kernel: all of them when every sequence has
    at most one query token, else the `num_decodes` one-token sequences the scheduler put first."""
    if max_query_len <= 1:
        return num_seqs
    return max(0, min(int(num_decodes), num_seqs))


def chunk_ranges(start: int, count: int, limit: int = GRID_Z_MAX) -> list[tuple[int, int]]:
    """[start, start + count) cut into (start, n) pieces of at most `limit` sequences."""
    if limit < 1:
        raise ValueError(f"chunk limit must be >= 1, got {limit}")
    return [(s, min(limit, start + count - s)) for s in range(start, start + count, limit)]


@functools.lru_cache(maxsize=4096)  # called per layer per step with few distinct arguments
def plan_attention_launches(
    num_seqs: int, max_query_len: int, num_decodes: int = 0, grid_limit: int = GRID_Z_MAX
) -> tuple[Launch, ...]:
    """The launches of one paged-attention call, in stream order: decode chunks, then prefill chunks."""
    nd = decode_rows(num_seqs, max_query_len, num_decodes)
    launches = [Launch("decode", s, n) for s, n in chunk_ranges(0, nd, grid_limit)]
    launches += [Launch("prefill", s, n) for s, n in chunk_ranges(nd, num_seqs - nd, grid_limit)]
    if launches:
        last = launches[-1]
        launches[-1] = Launch(last.kind, last.seq_start, last.num_seqs, zero_tail=True)
    return tuple(launches)


def ctas_per_sm_from_resources(
    registers: int, threads: int, shared_bytes: int = 0, launch_bound_min_ctas: int = 0
) -> int:
    """Resident CTAs per SM on sm_90 for a kernel of `registers` per thread, `threads` per CTA
    and `shared_bytes` of shared memory (static + dynamic): the CPU-side twin of the driver's
    cuOccupancyMaxActiveBlocksPerMultiprocessor, used where no GPU answers."""
    if threads < 1:
        raise ValueError("threads must be >= 1")
    warps = -(-threads // 32)
    per_warp = -(-max(registers, 1) * 32 // REGISTER_ALLOCATION_UNIT) * REGISTER_ALLOCATION_UNIT
    by_regs = SM90_REGISTERS_PER_SM // (per_warp * warps)
    by_threads = SM90_MAX_THREADS_PER_SM // (warps * 32)
    limit = min(by_regs, by_threads, SM90_MAX_CTAS_PER_SM)
    if shared_bytes > 0:
        limit = min(limit, SM90_SHARED_BYTES_PER_SM // (shared_bytes + SM90_SHARED_RESERVED_PER_CTA))
    return max(limit, 0)


CTA_OVERHEAD_TOKENS = 64  # a split's fixed cost (query load, partial write, merge) in streamed tokens


def plan_decode_splits(
    work_items: int,
    context_tokens: int,
    ctas_per_sm: int,
    num_sms: int,
    min_tokens_per_split: int,
    max_splits: int,
    cta_overhead_tokens: int = CTA_OVERHEAD_TOKENS,
) -> int:
    """Splits per (sequence, kv-head slice) for a decode launch of `work_items` such pairs over
    up to `context_tokens` tokens each.

    A launch of C CTAs on W = ctas_per_sm * num_sms resident slots runs ceil(C / W) waves, each
    CTA streaming context / s tokens plus a fixed cost: the time is proportional to
    ceil(work * s / W) * (context / s + overhead). The plan takes the s in [1, cap] that
    minimises it (whole or nearly whole waves), the smallest such s on ties. cap: `max_splits`, and no split shorter
    than `min_tokens_per_split` (the kernels derive each sequence's live split count the same way).
    """
    if work_items < 1:
        return 1
    wave = max(1, ctas_per_sm) * max(1, num_sms)
    cap = max(1, min(max_splits, -(-max(context_tokens, 1) // max(1, min_tokens_per_split))))
    best, best_cost = 1, None
    for s in range(1, cap + 1):
        cost = -(-work_items * s // wave) * (context_tokens / s + cta_overhead_tokens)
        if best_cost is None or cost < best_cost * (1 - 1e-9):
            best, best_cost = s, cost
    return best


def wave_efficiency(ctas: int, ctas_per_sm: int, num_sms: int) -> float:
    """Fraction of the launched waves' slots that hold a CTA."""
    wave = max(1, ctas_per_sm) * max(1, num_sms)
    return ctas / (-(-ctas // wave) * wave)
