"""A served engine with the step_timeline setting writes one line per step, with the documented
fields and the output side's delays filled in; the CPU takes the latency target."""

from __future__ import annotations

import asyncio
import json

from engine.config.settings import EngineSettings
from engine.core.params import SamplingParams
from engine.core.sched.step_timeline import FIELDS
from engine.runtime.async_engine import AsyncEngine
from engine.runtime.llm_engine import LLMEngine


def test_a_served_engine_writes_its_steps(tiny_llama, tmp_path):
    path = tmp_path / "served.jsonl"
    settings = EngineSettings(
        model=str(tiny_llama),
        device="cpu",
        enforce_eager=True,
        max_model_len=128,
        num_gpu_blocks=64,
        max_num_seqs=4,
        step_timeline=path,
        target_itl_ms=50.0,
    )
    engine = AsyncEngine(LLMEngine.from_settings(settings), idle_poll_s=0.05).start()
    try:

        async def main():
            params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
            for prompt in ("The quick brown fox", "A kiln is"):
                async for _ in engine.generate(prompt, params):
                    pass

        asyncio.run(main())
    finally:
        engine.shutdown()
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert lines and all(list(line) == list(FIELDS) for line in lines)
    ran = [line for line in lines if line["kind"] != "idle"]
    assert sum(line["decode_seqs"] for line in ran) == 2 * 7  # (the first token of each comes with its prompt)
    assert all(line["model_ms"] > 0 for line in ran)
    assert any(line["output_ms"] is not None and line["loop_ms"] is not None for line in ran)
    assert engine.engine.core.scheduler.step_budget is not None  # (the CPU takes the target)
