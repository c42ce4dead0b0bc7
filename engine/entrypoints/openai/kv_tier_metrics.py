"""The KV tiers' metrics (`kiln:kv_tier_*`, docs/kv_tiers.md): per tier (host, disk, remote) the
blocks found and not found, bytes loaded and written, time spent loading, evictions and bad
records; for the engine the requests that waited for a load and how long, and the blocks
loaded and saved. Every series exists from the start (zero with the tiers off), so dashboards
and alerts never see a missing series."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge

TIERS = ("host", "disk", "remote")
# name -> (TierStats field, help)
PER_TIER = {
    "kv_tier_hits": ("hits", "KV blocks found intact in the tier"),
    "kv_tier_misses": ("misses", "KV blocks looked for in the tier and not there"),
    "kv_tier_bytes_in": ("bytes_in", "KV bytes loaded from the tier"),
    "kv_tier_bytes_out": ("bytes_out", "KV bytes written to the tier"),
    "kv_tier_load_seconds": ("load_seconds", "seconds spent reading blocks found in the tier"),
    "kv_tier_evictions": ("evictions", "KV blocks the tier dropped for capacity"),
    "kv_tier_errors": ("errors", "corrupt or unreadable KV records (recomputed) and failed writes"),
}
# name -> (TierCounters field, help)
ENGINE = {
    "kv_tier_requests_loaded": ("requests_held", "requests that waited for a load from the KV tiers"),
    "kv_tier_load_wait_seconds": ("load_wait_seconds", "seconds requests waited for their KV tier loads, summed"),
    "kv_tier_blocks_loaded": ("blocks_loaded", "KV blocks loaded into the cache from the tiers"),
    "kv_tier_blocks_saved": ("blocks_saved", "KV blocks queued to the tiers as they left use"),
}


class KVTierMetrics:
    def __init__(self, registry: CollectorRegistry, model_name: str) -> None:
        self._prev: dict[str, float] = {}
        self._tier: dict[str, dict[str, Counter]] = {}
        for name, (_, doc) in PER_TIER.items():
            family = Counter(f"kiln:{name}", doc, ["model_name", "tier"], registry=registry)
            self._tier[name] = {t: family.labels(model_name, t) for t in TIERS}
        self._engine = {
            name: Counter(f"kiln:{name}", doc, ["model_name"], registry=registry).labels(model_name)
            for name, (_, doc) in ENGINE.items()
        }
        blocks = Gauge(
            "kiln:kv_tier_blocks",
            "KV blocks a local tier holds (host, disk)",
            ["model_name", "tier"],
            registry=registry,
        )
        self._blocks = {t: blocks.labels(model_name, t) for t in TIERS}

    def update(self, kv_tiers) -> None:
        """Move the counters by what the engine's KV tiers (engine/runtime/kv_tiers.py) did since."""
        if kv_tiers is None:
            return
        for tier in kv_tiers.store.tiers:
            for name, (attr, _) in PER_TIER.items():
                self._advance(f"{name}:{tier.name}", getattr(tier.stats, attr), self._tier[name][tier.name])
            if tier.local:
                self._blocks[tier.name].set(len(tier))
        for name, (attr, _) in ENGINE.items():
            self._advance(name, getattr(kv_tiers.counters, attr), self._engine[name])

    def _advance(self, key: str, total: float, counter: Counter) -> None:
        delta = total - self._prev.get(key, 0)
        if delta > 0:
            counter.inc(delta)
            self._prev[key] = total
