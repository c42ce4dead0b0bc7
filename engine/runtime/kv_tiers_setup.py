"""The KV tiers an engine's settings ask for (kv_offloading_size, kv_disk_path, kv_remote_url), built
once at start-up: the model's fingerprint, the tiers in order host -> disk -> remote, the store and
its link to the pool and the scheduler (engine/runtime/kv_tiers.py)."""

from __future__ import annotations

import logging
import time
from importlib import metadata
from pathlib import Path

import torch

from engine.config.settings import EngineSettings
from engine.core.kv.block_pool import BlockPool
from engine.core.kv.tiers import block_record
from engine.core.kv.tiers.base import Tier
from engine.core.kv.tiers.disk import DiskTier
from engine.core.kv.tiers.fingerprint import model_fingerprint
from engine.core.kv.tiers.remote import RemoteTier
from engine.core.kv.tiers.store import TierStore
from engine.core.sched.scheduler import Scheduler
from engine.runtime.kv_tiers import KVTiers
from engine.runtime.pinned_host_tier import host_tier
from engine.worker.kv_block_io import KVBlockIO

logger = logging.getLogger(__name__)

# Settings that change the numbers a prefill writes into the cache: part of the fingerprint, so KV
# computed under one of them is never served under another.
NUMERIC_SETTINGS = (
    "dtype",
    "kv_cache_dtype",
    "block_size",
    "load_format",
    "seed",
    "quantization",
    "gguf_dequantize",
    "int4_kernel",
    "cpu_quant_activations",
    "cpu_half_weights",
    "cpu_decoder_stack",
    "cpu_compile_forward",
    "attention_backend",
    "prefill_kernel",
    "decode_kernel",
    "enforce_eager",
)


def _kiln_version() -> str:
    try:
        return metadata.version("kiln-serve")
    except metadata.PackageNotFoundError:
        return "unknown"


def kv_fingerprint(
    settings: EngineSettings,
    model_dir: Path,
    cache: torch.Tensor,
    scales: torch.Tensor | None,
    dtype: torch.dtype,
    device: torch.device,
) -> bytes:
    facts = {name: getattr(settings, name, None) for name in NUMERIC_SETTINGS}
    facts |= {
        "resolved_dtype": str(dtype),
        "kv_element": str(cache.dtype),
        "kv_layout": [cache.shape[0], cache.shape[1], *cache.shape[3:]],  # (all but the block count)
        "kv_scales": scales.tolist() if scales is not None else None,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else device.type,
        "kiln": _kiln_version(),
        "torch": torch.__version__,
    }
    if settings.tokenizer:
        facts["tokenizer"] = model_fingerprint(Path(settings.tokenizer), {}).hex()
    return model_fingerprint(model_dir, facts)


def build_kv_tiers(
    settings: EngineSettings,
    model_dir: Path,
    cache: torch.Tensor,
    scales: torch.Tensor | None,
    dtype: torch.dtype,
    device: torch.device,
    pool: BlockPool,
    scheduler: Scheduler,
) -> KVTiers | None:
    if not settings.kv_tiers_enabled:
        return None
    t0 = time.perf_counter()
    fingerprint = kv_fingerprint(settings, model_dir, cache, scales, dtype, device)
    io = KVBlockIO(cache)
    tiers: list[Tier] = []
    if settings.kv_offloading_size is not None:
        tiers.append(host_tier(int(settings.kv_offloading_size * (1 << 30)), device))
    if settings.kv_disk_path is not None:
        # A whole record's size: the parent is a 16-byte digest, or the root (none, or an adapter's).
        lo = block_record.record_size(None, settings.block_size, io.bytes_per_block)
        tiers.append(
            DiskTier(settings.kv_disk_path, fingerprint.hex(), int(settings.kv_disk_size_gb * 1e9), (lo, lo + 64))
        )
    if settings.kv_remote_url is not None:
        tiers.append(RemoteTier(settings.kv_remote_url))
    store = TierStore(tiers, fingerprint, io.bytes_per_block)
    logger.info(
        "KV tiers: %s; model fingerprint %s; %d bytes a block (%.2f s)",
        " -> ".join(t.name for t in tiers),
        fingerprint.hex()[:16],
        io.bytes_per_block,
        time.perf_counter() - t0,
    )
    return KVTiers(store, io, pool, scheduler)
