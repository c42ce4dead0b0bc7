"""Start-up sizing of the KV cache and of the context length it can serve.

Plain functions over ints, so the rules are tested without building an engine:

- the block count comes from an explicit `num_gpu_blocks`, or from a byte budget
  (`kv_cache_memory_gb` on the CPU; on a GPU, what `gpu_memory_utilization` leaves after a
  profiled forward);
- the context length: an explicit `max_model_len` must fit in the cache (one sequence alone may
  use every block) or start-up fails naming the setting that gives the cache more room on this
  device; with none given, the model's full context is used when it fits, and otherwise the
  largest context that does, rounded down to whole blocks, with a log line saying so (what
  llama.cpp does with `-c 0` and vLLM with a `max_model_len` of `auto`/`-1`).
"""

from __future__ import annotations

import logging

logger = logging.getLogger(__name__)

GIB = 1 << 30


def budget_setting(device_type: str, explicit_blocks: bool) -> str:
    """The setting that gives the KV cache more room on this device."""
    if explicit_blocks:
        return "num_gpu_blocks"
    return "kv_cache_memory_gb" if device_type == "cpu" else "gpu_memory_utilization"


def blocks_from_budget(budget_bytes: float, bytes_per_block: int, device_type: str) -> int:
    """KV blocks (the null block included) that fit in a byte budget; at least 2 or an error."""
    blocks = int(max(budget_bytes, 0) // bytes_per_block)
    if blocks < 2:
        raise ValueError(f"the KV cache gets {budget_bytes / (1 << 20):.0f} MiB, not enough for 2 blocks of "
                         f"{bytes_per_block} bytes: raise {budget_setting(device_type, False)}")
    return blocks


def tokens_per_sequence(num_blocks: int, block_size: int) -> int:
    """The longest context one sequence can hold: every block but the null block."""
    return (num_blocks - 1) * block_size


def fit_max_model_len(requested: int | None, model_limit: int, num_blocks: int, block_size: int,
                      bytes_per_block: int, device_type: str, explicit_blocks: bool) -> int:
    """The context length to serve: `requested` (already checked against the model's limit)
    if it fits, else an error naming the setting to raise; with none requested, the model's
    limit or the largest whole-block context that fits."""
    capacity = tokens_per_sequence(num_blocks, block_size)
    want = model_limit if requested is None else requested
    if want <= capacity:
        return want
    setting = budget_setting(device_type, explicit_blocks)
    if requested is None:
        logger.warning("the model's full context (%d tokens) does not fit the KV cache (%d blocks of %d tokens): "
                       "serving a context of %d tokens (max_model_len); raise %s for more", model_limit,
                       num_blocks - 1, block_size, capacity, setting)
        return capacity
    needed_blocks = -(-requested // block_size) + 1
    if explicit_blocks:
        how = f"num_gpu_blocks to at least {needed_blocks - 1}"
    elif device_type == "cpu":
        how = f"kv_cache_memory_gb to at least {needed_blocks * bytes_per_block / GIB:.2f}"
    else:
        how = "gpu_memory_utilization"
    raise ValueError(f"max_model_len ({requested}) is larger than the KV cache can hold ({capacity} tokens in "
                     f"{num_blocks - 1} blocks of {block_size}); raise {how}, or lower max_model_len "
                     f"(or leave it unset: kiln then serves the largest context that fits)")
