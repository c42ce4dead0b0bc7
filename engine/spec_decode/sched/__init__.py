"""Speculative decoding on the scheduler's side (no torch, nothing from engine/worker): what drafts
a sequence gets and which of them a verify step keeps. The device side is the rest of
engine/spec_decode/ (draft model, EAGLE heads, acceptance of sampled drafts)."""

from engine.spec_decode.sched.config import SpecDecodeConfig
from engine.spec_decode.sched.decoder import SpecDecoder
from engine.spec_decode.sched.draft_length import DraftLengthPlanner
from engine.spec_decode.sched.ngram import NgramProposer, find_draft

__all__ = [
    "DraftLengthPlanner",
    "NgramProposer",
    "SpecDecodeConfig",
    "SpecDecoder",
    "find_draft",
]
