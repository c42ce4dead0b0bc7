"""Step features: how the step inputs of model features other than attention are written.

The model reads them through `ForwardContext` (engine/layers/forward_context.py), passed
explicitly through its forward next to the attention metadata (an argument, never module
state). Each feature that needs per-token inputs brings a
`StepFeature`: its own static buffers (host staging + device tensor, allocated once at the
largest step), filled per scheduled sequence and uploaded with the step's other inputs. The
context's tensors are views of those buffers, so a captured CUDA graph reads the values written
in place before each replay, as it does the attention metadata's.

Features today: LoRA (engine/lora/adapters.py: each token's adapter slot).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import torch

from engine.layers.forward_context import ForwardContext

if TYPE_CHECKING:
    from engine.core.sched.scheduler_output import ScheduledSeq


class StepFeature(Protocol):
    field: str  # the ForwardContext field it fills

    def write(self, t: int, n: int, s: "ScheduledSeq") -> None:
        """Host rows [t, t + n) hold the tokens of scheduled sequence s."""

    def write_decode(self, seqs: list["ScheduledSeq"]) -> None:
        """Host row i holds the one token of seqs[i]."""

    def pad(self, t: int, count: int) -> None:
        """Host rows [t, t + count) are padding."""

    def upload(self, num_tokens: int) -> None:
        """Copy the first num_tokens host rows to the device (without blocking)."""

    def view(self, num_tokens: int) -> torch.Tensor:
        """The device buffer's first num_tokens rows (what the forward reads)."""


class StepFeatures:
    """The model's step features, driven together by the step builder."""

    def __init__(self, features: list[StepFeature]) -> None:
        self.features = features

    @classmethod
    def for_model(cls, model: torch.nn.Module, max_tokens: int, device: torch.device) -> "StepFeatures":
        from engine.lora.adapters import lora_step_feature

        return cls([f for f in (lora_step_feature(model, max_tokens, device),) if f is not None])

    def write(self, t: int, n: int, s: "ScheduledSeq") -> None:
        for f in self.features:
            f.write(t, n, s)

    def write_decode(self, seqs: list["ScheduledSeq"]) -> None:
        for f in self.features:
            f.write_decode(seqs)

    def pad(self, t: int, count: int) -> None:
        for f in self.features:
            f.pad(t, count)

    def upload(self, num_tokens: int) -> None:
        for f in self.features:
            f.upload(num_tokens)

    def context(self, num_tokens: int) -> ForwardContext:
        return ForwardContext(**{f.field: f.view(num_tokens) for f in self.features})
