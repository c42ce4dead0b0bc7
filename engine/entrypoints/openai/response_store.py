"""Stored responses (the Responses API's `store`, read back by `previous_response_id`, GET and
DELETE /v1/responses/{id}): in memory, bounded in count, bytes and age, the oldest dropped
first, and each visible only to the API key that made it.

The owner is a hash of the key the client presented (Authorization: Bearer or x-api-key; none
is its own owner), so clients that share a server but not a key never see each other's turns.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable


def owner_of(key: str) -> str:
    return hashlib.sha256(key.encode("utf-8", "surrogatepass")).hexdigest()


@dataclass
class StoredResponse:
    owner: str
    created: float
    body: dict[str, Any]  # the response as GET returns it
    items: list[dict[str, Any]]  # the turn's input items, earlier turns' first, then its output
    size: int  # bytes, as counted against the bound


class ResponseStore:
    def __init__(
        self,
        max_entries: int = 1000,
        max_bytes: int = 64 << 20,
        max_age_s: float = 3600.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.max_entries, self.max_bytes, self.max_age_s, self.clock = max_entries, max_bytes, max_age_s, clock
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()  # oldest first
        self.bytes = 0

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, response_id: str, owner: str, body: dict[str, Any], items: list[dict[str, Any]]) -> bool:
        """Store one response; False (not stored) when it alone is over the byte bound (or none
        are kept)."""
        size = len(json.dumps(body)) + len(json.dumps(items))
        if size > self.max_bytes or self.max_entries == 0:
            return False
        self._drop(response_id)
        self._entries[response_id] = StoredResponse(owner, self.clock(), body, items, size)
        self.bytes += size
        self._expire()
        while len(self._entries) > self.max_entries or self.bytes > self.max_bytes:
            self._drop(next(iter(self._entries)))
        return True

    def get(self, response_id: str, owner: str) -> StoredResponse | None:
        """The stored response if it is there, not expired, and the owner's."""
        self._expire()
        entry = self._entries.get(response_id)
        return entry if entry is not None and entry.owner == owner else None

    def delete(self, response_id: str, owner: str) -> bool:
        if self.get(response_id, owner) is None:
            return False
        self._drop(response_id)
        return True

    def _expire(self) -> None:
        oldest = self.clock() - self.max_age_s
        while self._entries and next(iter(self._entries.values())).created < oldest:
            self._drop(next(iter(self._entries)))

    def _drop(self, response_id: str) -> None:
        entry = self._entries.pop(response_id, None)
        if entry is not None:
            self.bytes -= entry.size
