"""How much GPU memory the KV cache may take: run one forward at the largest batch the engine will
schedule, read the peak it allocated, and leave gpu_memory_utilization of the device minus that
peak and whatever other processes hold."""

from __future__ import annotations

import torch

from engine.layers.attention.base import AttentionMetadata


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
