"""engine/runtime/builder_cpu.py: a CPU step holds at most CPU_STEP_TOKENS tokens unless
max_num_batched_tokens is set (issue 40: a 2048-token step's float32 activations were the largest
part of a 1B GGUF model's peak above its weights)."""

from __future__ import annotations

from engine.config.settings import EngineSettings
from engine.runtime.builder_cpu import CPU_STEP_TOKENS, step_token_budget


def test_the_cpu_budget_unless_set(monkeypatch):
    assert CPU_STEP_TOKENS == 512
    assert step_token_budget(EngineSettings()) == CPU_STEP_TOKENS
    assert step_token_budget(EngineSettings(max_num_batched_tokens=2048)) == 2048  # (set: as set, even the default)
    assert step_token_budget(EngineSettings(max_num_batched_tokens=64)) == 64
    monkeypatch.setenv("KILN_MAX_NUM_BATCHED_TOKENS", "1024")
    assert step_token_budget(EngineSettings()) == 1024


def test_a_cpu_engine_schedules_with_it(make_llm):
    llm = make_llm(max_model_len=1024)
    assert llm.engine.core.scheduler.config.max_num_batched_tokens == CPU_STEP_TOKENS
    set_ = make_llm(max_model_len=1024, max_num_batched_tokens=1024)
    assert set_.engine.core.scheduler.config.max_num_batched_tokens == 1024
