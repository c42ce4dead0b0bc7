"""What the API side may know about the engine (EngineInfo, fixed at start-up) and how it is
doing (EngineStatus, a snapshot)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from engine.runtime.llm_engine import LLMEngine


@dataclass(frozen=True)
class EngineInfo:
    """What the API side may know about the engine: fixed at start-up, read-only, safe from any
    thread (the tokenizer is used by the server's tokenising threads only to read)."""

    model_dir: str
    model_config: Any
    max_model_len: int
    vocab_size: int
    max_num_seqs: int
    block_size: int
    pooling_type: str
    generates: bool  # has a language-model head (completions, chat)
    eos_token_ids: tuple[int, ...]
    tokenizer: Any
    lora_enabled: bool
    generation_defaults: Any  # engine.config.generation_config: sampling defaults from generation_config.json

    @classmethod
    def of(cls, engine: LLMEngine) -> "EngineInfo":
        s = engine.settings
        return cls(
            str(engine.model_dir),
            engine.model_config,
            engine.max_model_len,
            engine.model_config.vocab_size,
            s.max_num_seqs,
            s.block_size,
            s.pooling_type,
            bool(engine.model_config.generates),
            tuple(engine.eos_token_ids),
            engine.tokenizer,
            engine.core.lora is not None,
            engine.generation_defaults,
        )


@dataclass
class EngineStatus:
    alive: bool
    error: str | None
    num_running: int
    num_waiting: int
    num_swapped: int
    num_blocks_in_use: int
    kv_usage: float
    extra: dict[str, Any] = field(default_factory=dict)
