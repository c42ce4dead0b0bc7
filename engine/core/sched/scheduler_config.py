"""The scheduler's configuration (engine/runtime/builder.py fills it from the settings)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    block_size: int
    enable_chunked_prefill: bool = True
    preemption_mode: Literal["auto", "swap", "recompute"] = "recompute"
    reserved_blocks_fraction: float = 0.0
    reserved_priority: int = 0
    watermark_fraction: float = 0.01
    eos_token_ids: tuple[int, ...] = ()  # the model's end-of-sequence tokens (a token-level stop)
    # Inter-token target (ms): prefill beside decodes is cut to fit it (engine/core/sched/step_budget.py).
    target_itl_ms: float | None = None
    long_prefill_token_threshold: int = 0  # a prompt's tokens in one step at most (0: the step's budget)
    whole_prompts_first: bool = False  # waiting prompts that fit whole go before running prompts' pieces
    micro_batch_tokens: int = 0  # CPU: a step's rows at most where prefill meets decodes (step_budget.MicroSteps)
    # CPU: prompt rows whose first tokens come together (step_budget.PrefillWave; 0, or not above the budget: off)
    prefill_wave_tokens: int = 0
