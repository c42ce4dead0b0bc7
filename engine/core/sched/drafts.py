"""What the scheduler asks of speculative decoding. The runtime builder makes the one
implementation (engine/spec_decode/sched/decoder.py SpecDecoder) and hands it to the Scheduler,
so the core names only this protocol and never imports the spec_decode package."""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from engine.core.kv.allocator import KVAllocator
    from engine.core.request import Sequence


class Drafts(Protocol):
    num_draft_tokens: int
    num_drafts: int
    num_accepted_tokens: int

    def drafts(self, seq: Sequence, budget: int) -> list[int]: ...

    def launched(self, seq: Sequence, k: int) -> None: ...

    def verifying(self, seq: Sequence) -> bool: ...

    def accept_launched(self, seq: Sequence, drafts: list[int], sampled: list[int], kv: KVAllocator) -> None: ...
