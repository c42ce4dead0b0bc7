"""Speculative decoding on the scheduler's side (no torch): what drafts a sequence gets and which
of them a verify step keeps. The device side: engine/worker/spec/ (draft model, EAGLE heads) and
engine/worker/sample/rejection.py (acceptance of sampled drafts)."""

from engine.core.sched.spec.config import DRAFT, METHODS, SpecDecodeConfig
from engine.core.sched.spec.decoder import SpecDecoder, accepted_prefix
from engine.core.sched.spec.draft_length import DraftLengthPlanner
from engine.core.sched.spec.ngram import NgramProposer, find_draft

__all__ = ["DRAFT", "METHODS", "DraftLengthPlanner", "NgramProposer", "SpecDecodeConfig", "SpecDecoder",
           "accepted_prefix", "find_draft"]
