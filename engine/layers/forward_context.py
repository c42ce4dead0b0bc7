"""The per-step forward context: step inputs of model features other than attention, as the model
reads them. Passed explicitly through the model's forward next to the attention metadata (an
argument, never module state); the worker fills it (engine/worker/step_features.py)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class ForwardContext:
    """Per-step feature inputs the model reads; a field is None when its feature is off.

    lora_slots  int64 [num_tokens]  each token's LoRA adapter slot, -1 = the base model (engine/lora/adapters.py)
    """

    lora_slots: torch.Tensor | None = None
