"""What speculative decoding the engine runs (the speculative_* settings, engine/config/settings.py)."""

from __future__ import annotations

from dataclasses import dataclass

# A draft token of a scheduled step that the device proposes inside the step's launch (a draft
# model's or an EAGLE head's): the host learns its value with the step's results.
DRAFT = -2

METHODS = ("ngram", "draft_model", "eagle", "eagle3")


@dataclass(frozen=True)
class SpecDecodeConfig:
    num_speculative_tokens: int
    method: str = "ngram"
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 2
    # Cost of one drafted position relative to a plain decode step, for the per-sequence draft
    # length (engine/spec_decode/sched/draft_length.py); a draft model's or head's few layers.
    draft_cost: float = 0.1

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"speculative method {self.method!r} is not one of {', '.join(METHODS)}")

    @property
    def device_drafts(self) -> bool:
        """Drafts come from a model run inside the step's launch (not known when it is scheduled)."""
        return self.method != "ngram"
