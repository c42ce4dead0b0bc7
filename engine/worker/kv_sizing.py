"""Start-up sizing of the KV cache and of the context length it can serve: every rule in one place.

Plain functions over ints, so the rules are tested without building an engine (and the two that
measure the machine: `cpu_kv_bytes` reads the free memory, `free_gpu_bytes_after_profile` runs a
profiled forward):

- the block count comes from an explicit `num_gpu_blocks`, or from a byte budget: on a GPU,
  what `gpu_memory_utilization` leaves after a profiled forward; on the CPU `kv_cache_memory_gb`
  when set, else `cpu_kv_budget` below: a share of the memory actually free once the weights
  are loaded (/proc/meminfo's MemAvailable, or less where a cgroup limit leaves less), no more
  than every sequence at the full context needs;
- the context length: an explicit `max_model_len` must fit in the cache (one sequence alone may
  use every block) or start-up fails naming the setting that gives the cache more room on this
  device; with none given, the model's full context is used when it fits, and otherwise the
  largest context that does, rounded down to whole blocks, with a log line saying so (what
  llama.cpp does with `-c 0` and vLLM with a `max_model_len` of `auto`/`-1`).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any

import torch

from engine.config.settings import EngineSettings
from engine.layers.attention.base import AttentionMetadata

logger = logging.getLogger(__name__)

GIB = 1 << 30
MIB = 1 << 20

# The CPU default: this share of the memory left free after the weights, once the headroom below
# is set aside. The rest stays with the page cache, other processes and the allocator's slack:
# a KV cache its sequences fill takes every byte of it (its pages are touched as tokens arrive).
CPU_KV_SHARE = 0.5
# Set aside before the share: the OS, the HTTP server, tokenizer threads, oneDNN's primitives.
CPU_HEADROOM = 1 * GIB
# Never less than this (kiln's fixed default before the budget followed the free memory).
CPU_KV_FLOOR = GIB // 4
# A cgroup memory limit at or above this means none (cgroup v1 writes ~2**63 for "no limit").
_NO_LIMIT = 1 << 60


def budget_setting(device_type: str, explicit_blocks: bool) -> str:
    """The setting that gives the KV cache more room on this device."""
    if explicit_blocks:
        return "num_gpu_blocks"
    return "kv_cache_memory_gb" if device_type == "cpu" else "gpu_memory_utilization"


def blocks_from_budget(budget_bytes: float, bytes_per_block: int, device_type: str) -> int:
    """KV blocks (the null block included) that fit in a byte budget; at least 2 or an error."""
    blocks = int(max(budget_bytes, 0) // bytes_per_block)
    if blocks < 2:
        raise ValueError(
            f"the KV cache gets {budget_bytes / (1 << 20):.0f} MiB, not enough for 2 blocks of "
            f"{bytes_per_block} bytes: raise {budget_setting(device_type, False)}"
        )
    return blocks


def tokens_per_sequence(num_blocks: int, block_size: int) -> int:
    """The longest context one sequence can hold: every block but the null block."""
    return (num_blocks - 1) * block_size


def fit_max_model_len(
    requested: int | None,
    model_limit: int,
    num_blocks: int,
    block_size: int,
    bytes_per_block: int,
    device_type: str,
    explicit_blocks: bool,
) -> int:
    """The context length to serve: `requested` (already checked against the model's limit)
    if it fits, else an error naming the setting to raise; with none requested, the model's
    limit or the largest whole-block context that fits."""
    capacity = tokens_per_sequence(num_blocks, block_size)
    want = model_limit if requested is None else requested
    if want <= capacity:
        return want
    setting = budget_setting(device_type, explicit_blocks)
    if requested is None:
        logger.warning(
            "the model's full context (%d tokens) does not fit the KV cache (%d blocks of %d tokens): "
            "serving a context of %d tokens (max_model_len); raise %s for more",
            model_limit,
            num_blocks - 1,
            block_size,
            capacity,
            setting,
        )
        return capacity
    needed_blocks = -(-requested // block_size) + 1
    if explicit_blocks:
        how = f"num_gpu_blocks to at least {needed_blocks - 1}"
    elif device_type == "cpu":
        how = f"kv_cache_memory_gb to at least {needed_blocks * bytes_per_block / GIB:.2f}"
    else:
        how = "gpu_memory_utilization"
    raise ValueError(
        f"max_model_len ({requested}) is larger than the KV cache can hold ({capacity} tokens in "
        f"{num_blocks - 1} blocks of {block_size}); raise {how}, or lower max_model_len "
        f"(or leave it unset: kiln then serves the largest context that fits)"
    )


# ---- the CPU default budget: from the memory actually free --------------------------------------
@dataclass(frozen=True)
class FreeMemory:
    """Bytes this process can still take, and where that figure came from (for the log line)."""

    bytes: int
    source: str


def parse_meminfo(text: str) -> int | None:
    """MemAvailable of /proc/meminfo's text, in bytes (None when absent: kernels before 3.14)."""
    for line in text.splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return None


def cgroup_headroom(limit: int | None, usage: int | None, inactive_file: int = 0) -> int | None:
    """What a cgroup memory limit still leaves: limit - (usage - inactive page cache, which the
    kernel reclaims before it counts against the limit). None where there is no limit."""
    if limit is None or usage is None or limit >= _NO_LIMIT:
        return None
    return max(limit - max(usage - inactive_file, 0), 0)


def _read_int(path: str) -> int | None:
    try:
        with open(path) as f:
            text = f.read().strip()
    except OSError:
        return None
    return None if text == "max" or not text.lstrip("-").isdigit() else int(text)


def _stat_value(path: str, keys: tuple[str, ...]) -> int:
    try:
        with open(path) as f:
            values = dict(line.split()[:2] for line in f if line.strip())
    except (OSError, ValueError):
        return 0
    return next((int(values[k]) for k in keys if k in values), 0)


def _cgroup_dirs() -> list[tuple[str, str]]:
    """(version, directory) of this process's memory cgroup, its own path first, then the mount's
    root (a container usually sees its own cgroup there)."""
    own_v1 = own_v2 = ""
    try:
        with open("/proc/self/cgroup") as f:
            for line in f:
                _, controllers, path = line.rstrip("\n").split(":", 2)
                if controllers == "":
                    own_v2 = path
                elif "memory" in controllers.split(","):
                    own_v1 = path
    except (OSError, ValueError):
        pass
    dirs: list[tuple[str, str]] = []
    for version, root, own in (("v2", "/sys/fs/cgroup", own_v2), ("v1", "/sys/fs/cgroup/memory", own_v1)):
        for d in ([os.path.join(root, own.lstrip("/"))] if own.strip("/") else []) + [root]:
            if d not in (x for _, x in dirs):
                dirs.append((version, d))
    return dirs


def read_free_memory() -> FreeMemory | None:
    """The memory this process can still take: MemAvailable, or what its cgroup's limit leaves
    where that is less. None where neither can be read (not Linux)."""
    try:
        with open("/proc/meminfo") as f:
            available = parse_meminfo(f.read())
    except OSError:
        available = None
    best = FreeMemory(available, "MemAvailable") if available is not None else None
    for version, d in _cgroup_dirs():
        if version == "v2":
            left = cgroup_headroom(
                _read_int(f"{d}/memory.max"),
                _read_int(f"{d}/memory.current"),
                _stat_value(f"{d}/memory.stat", ("inactive_file",)),
            )
        else:
            left = cgroup_headroom(
                _read_int(f"{d}/memory.limit_in_bytes"),
                _read_int(f"{d}/memory.usage_in_bytes"),
                _stat_value(f"{d}/memory.stat", ("total_inactive_file", "inactive_file")),
            )
        if left is not None:
            if best is None or left < best.bytes:
                best = FreeMemory(left, f"the cgroup memory limit ({d})")
            break
    return best


def activation_bytes(
    max_num_batched_tokens: int,
    max_num_seqs: int,
    hidden: int,
    intermediate: int,
    qkv_width: int,
    vocab: int,
    element_size: int,
) -> int:
    """A generous bound on one step's activations: a few hidden-sized tensors, the q/k/v and
    gate/up outputs for every token of the step, and float32 logits (plus their softmax) of every
    sampled row."""
    per_token = (4 * hidden + 2 * intermediate + intermediate + qkv_width) * element_size
    return 2 * max_num_batched_tokens * per_token + 2 * max_num_seqs * vocab * 4


def cpu_kv_budget(free_bytes: int, activations: int, needed_bytes: int, ranks: int = 1) -> tuple[int, str]:
    """The CPU KV cache's default size in bytes (per rank), and why, in words.

    free_bytes: what the process can still take with its weights loaded; activations: a step's
    working memory; needed_bytes: the cache every sequence at the full context would fill (more
    would never be used); ranks: processes sharing the free memory (tensor parallelism).
    CPU_KV_SHARE of what is free after activations and CPU_HEADROOM, split over the ranks, at most
    needed_bytes, at least CPU_KV_FLOOR."""
    spare = free_bytes - activations - CPU_HEADROOM
    share = int(max(spare, 0) * CPU_KV_SHARE) // max(ranks, 1)
    of = f"{CPU_KV_SHARE:.0%} of the {free_bytes / GIB:.1f} GiB free after the weights"
    of += f" less {(activations + CPU_HEADROOM) / GIB:.1f} GiB for activations and the OS"
    if ranks > 1:
        of += f", split over {ranks} ranks"
    if share >= needed_bytes:
        return needed_bytes, f"what every sequence at the full context needs (less than {of})"
    if share < CPU_KV_FLOOR:
        return min(CPU_KV_FLOOR, needed_bytes), f"the {CPU_KV_FLOOR / GIB:.2f} GiB floor: memory is short ({of})"
    return share, of


# ---- the CPU budget in bytes (kv_cache_memory_gb, or the share above of what is free) ----
def cpu_kv_bytes(
    settings: EngineSettings,
    cfg: Any,  # engine/models/config.py ModelConfig (its shape fields)
    per_block: int,
    max_model_len: int,
    token_budget: int,
    dtype: torch.dtype,
) -> float:
    """The budget in bytes, logged with the blocks and tokens it holds and why."""
    s = settings
    if s.kv_cache_memory_gb is not None:
        budget, why = s.kv_cache_memory_gb * GIB, "kv_cache_memory_gb"
    else:
        blocks_per_seq = -(-max_model_len // s.block_size)
        needed = (s.max_num_seqs * blocks_per_seq + 1) * per_block
        free = read_free_memory()
        if free is None:
            budget, why = CPU_KV_FLOOR, "the floor: this system does not say how much memory is free"
        else:
            width = (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim
            activations = activation_bytes(
                token_budget,
                s.max_num_seqs,
                cfg.hidden_size,
                cfg.intermediate_size or cfg.hidden_size,
                width,
                cfg.vocab_size,
                torch.finfo(dtype).bits // 8,
            )
            budget, why = cpu_kv_budget(free.bytes, activations, needed, s.tensor_parallel_size)
            why += f" ({free.source}); set kv_cache_memory_gb to choose"
    blocks = int(budget // per_block)
    logger.info(
        "KV cache on the CPU: %.2f GiB, %d blocks = %d tokens: %s",
        budget / GIB,
        blocks,
        max(blocks - 1, 0) * s.block_size,
        why,
    )
    return budget


# ---- the GPU budget: what a profiled forward leaves of gpu_memory_utilization ----
def free_gpu_bytes_after_profile(
    model,
    dummy_cache: torch.Tensor,
    num_tokens: int,
    max_num_seqs: int,
    gpu_memory_utilization: float,
    device: torch.device,
) -> float:
    """`model` runs `num_tokens` tokens (none writes the cache: every slot is -1) and computes the
    logits of `max_num_seqs` of them, on a two-block `dummy_cache`."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    n = num_tokens
    ids = torch.zeros(n, dtype=torch.int64, device=device)
    meta = AttentionMetadata(
        slot_mapping=torch.full((n,), -1, dtype=torch.int64, device=device),
        query_start_loc=torch.arange(n + 1, dtype=torch.int32, device=device),
        seq_lens=torch.zeros(n, dtype=torch.int32, device=device),
        block_tables=torch.zeros(n, 1, dtype=torch.int32, device=device),
        max_query_len=1,
        max_seq_len=1,
    )
    with torch.inference_mode():
        hidden = model(ids, ids, dummy_cache, meta)
        model.compute_logits(hidden[:max_num_seqs])
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated()
    del hidden
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info()
    used_by_others = total - free - torch.cuda.memory_reserved()
    return total * gpu_memory_utilization - used_by_others - peak
