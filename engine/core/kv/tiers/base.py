"""What every tier keeps count of, and what the store asks of a tier."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol


@dataclass
class TierStats:
    """Per-tier counters (the /metrics families kiln:kv_tier_*)."""

    hits: int = 0  # blocks found and verified
    misses: int = 0  # blocks looked for and not there
    bytes_in: int = 0  # bytes loaded from the tier
    bytes_out: int = 0  # bytes written to it
    load_seconds: float = 0.0  # time spent reading hits
    evictions: int = 0  # blocks dropped for capacity
    errors: int = 0  # corrupt or unreadable records, failed writes


class Tier(Protocol):
    name: str  # "host", "disk", "remote"
    local: bool  # a membership check costs no round trip (asked on the step thread)
    stats: TierStats

    def contains(self, key: str) -> bool: ...

    def get(self, key: str) -> bytes | memoryview | None: ...

    def put(self, key: str, record: bytes) -> None: ...

    def discard(self, key: str) -> None: ...

    def close(self) -> None: ...
