"""The remote tier: block records in a Redis/Valkey server that replicas on several machines share.

Keys are `<prefix><key>` (the key already holds the model fingerprint). The server's own memory
limit and eviction policy (maxmemory, allkeys-lru) bound it; an optional TTL ages records out.
Every call is a network round trip: the store asks it only off the step thread.
"""

from __future__ import annotations

from engine.core.kv.tiers.base import TierStats
from engine.core.kv.tiers.resp import RespClient


class RemoteTier:
    name = "remote"
    local = False

    def __init__(self, url: str, prefix: str = "kiln:kv:", ttl_seconds: int = 0, timeout: float = 5.0) -> None:
        self.client = RespClient(url, timeout)
        self.prefix = prefix.encode()
        self.ttl_seconds = ttl_seconds
        self.stats = TierStats()
        self.client.command("PING")  # (a wrong address fails at start, not at the first request)

    def _k(self, key: str) -> bytes:
        return self.prefix + key.encode()

    def contains(self, key: str) -> bool:
        return bool(self.client.command("EXISTS", self._k(key)))

    def get(self, key: str) -> bytes | None:
        return self.client.command("GET", self._k(key))

    def put(self, key: str, record: bytes) -> None:
        if self.ttl_seconds:
            self.client.command("SET", self._k(key), record, "EX", self.ttl_seconds)
        else:
            self.client.command("SET", self._k(key), record)
        self.stats.bytes_out += len(record)

    def discard(self, key: str) -> None:
        self.client.command("DEL", self._k(key))

    def close(self) -> None:
        self.client.close()
