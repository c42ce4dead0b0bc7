"""The KV cache's companions at start-up (EngineBuilder's, engine/runtime/builder.py): an fp8
cache's K/V scales, and the CPU swap space that preemption by swap moves blocks to."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from engine.config.settings import EngineSettings
from engine.core.kv.block_pool import BlockPool
from engine.core.kv.swap_space import SwapSpace
from engine.layers.kv_cache import KVCache, KVScales
from engine.models.loader.kv_scales import read_kv_scales

logger = logging.getLogger(__name__)


def set_kv_scales(
    s: EngineSettings, cache: KVCache, backend: Any, model_dir: Path, num_layers: int, num_blocks: int
) -> None:
    """An fp8 cache's K/V scales: calibrated on the first prompt (calculate_kv_scales), else the
    checkpoint's k_scale / v_scale, else 1.0; handed to the attention backend."""
    if cache.scales is None:
        if s.calculate_kv_scales:
            logger.warning("calculate_kv_scales applies to an fp8 KV cache only (kv_cache_dtype=fp8): ignored")
        return
    from engine.models.loader.model_loader import safetensors_files

    found = None
    if model_dir.is_dir() and s.load_format != "dummy" and any(model_dir.glob("*.safetensors")):
        found = read_kv_scales(safetensors_files(model_dir), num_layers)
    if found is not None:
        cache.set_scales(found)
    source = (
        "calibrated on the first prompt (calculate_kv_scales)"
        if s.calculate_kv_scales
        else "from the checkpoint"
        if found is not None
        else "1.0 (the checkpoint has none)"
    )
    logger.info("KV cache: fp8 e4m3, %d blocks, K/V scales %s", num_blocks, source)
    backend.use_kv_scales(KVScales(cache.scales, calibrate=s.calculate_kv_scales))


def make_swap_space(
    s: EngineSettings, pool: BlockPool, caches: list[KVCache], per_block: int, pinned: bool
) -> tuple[SwapSpace | None, Any]:
    """The CPU block pool for preemption by swap and the swapper that moves every cache's blocks
    (the target's, and a draft's with the same ids); (None, None) in recompute mode or with no
    swap space."""
    if s.preemption_mode == "recompute" or s.swap_space_gb <= 0:
        return None, None
    num_cpu = int(s.swap_space_gb * (1 << 30) // per_block)
    if num_cpu < 1:
        logger.warning(
            "swap_space_gb=%s holds no KV block of %d bytes: preempting by recompute only",
            s.swap_space_gb,
            per_block,
        )
        return None, None
    from engine.worker.block_swapper import BlockSwapper, SwapGroup

    swappers = [BlockSwapper(cache.tensor, num_cpu) for cache in caches]
    swapper = swappers[0] if len(swappers) == 1 else SwapGroup(swappers)
    swap_space = SwapSpace(pool, num_cpu, bytes_per_block=per_block)
    logger.info(
        "swap space: %d CPU blocks (%.2f GiB%s), preemption mode %s",
        num_cpu,
        num_cpu * per_block / (1 << 30),
        ", pinned" if pinned else "",
        s.preemption_mode,
    )
    return swap_space, swapper
