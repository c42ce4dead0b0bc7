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


def _serve(tiny_llama, path, **extra) -> tuple[list[dict], AsyncEngine]:
    settings = EngineSettings(
        model=str(tiny_llama),
        device="cpu",
        enforce_eager=True,
        max_model_len=128,
        num_gpu_blocks=64,
        max_num_seqs=4,
        step_timeline=path,
        **extra,
    )
    engine = AsyncEngine(LLMEngine.from_settings(settings), idle_poll_s=0.05).start()
    try:

        async def one(prompt):
            params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
            return [d async for d in engine.generate(prompt, params)]

        async def main():
            return await asyncio.gather(one("The quick brown fox"), one("A kiln is"))

        asyncio.run(main())
    finally:
        engine.shutdown()
    return [json.loads(line) for line in path.read_text().splitlines()], engine


def test_a_served_engine_writes_its_steps(tiny_llama, tmp_path):
    lines, engine = _serve(tiny_llama, tmp_path / "served.jsonl", target_itl_ms=50.0)
    assert lines and all(list(line) == list(FIELDS) for line in lines)
    ran = [line for line in lines if line["kind"] != "idle"]
    assert sum(line["decode_seqs"] for line in ran) == 2 * 7  # (the first token of each comes with its prompt)
    assert all(line["model_ms"] > 0 for line in ran)
    assert any(line["output_ms"] is not None and line["loop_ms"] is not None for line in ran)
    assert engine.engine.core.scheduler.step_budget is not None  # (the CPU takes the target)


def test_steps_wait_for_their_outputs_when_asked(tiny_llama, tmp_path):
    """step_waits_for_outputs: each step begins after the previous one's outputs reached the event
    loop (its end + output_ms + loop_ms), as the timeline records it."""
    lines, _ = _serve(tiny_llama, tmp_path / "gated.jsonl", step_waits_for_outputs=True)
    ran = [line for line in lines if line["kind"] != "idle"]
    checked = 0
    for prev, cur in zip(ran, ran[1:]):
        if prev["interval_ms"] is None or prev["output_ms"] is None or prev["loop_ms"] is None:
            continue
        end_ms = prev["t"] * 1e3 + prev["interval_ms"] - prev["gap_ms"]
        assert cur["t"] * 1e3 >= end_ms + prev["output_ms"] + prev["loop_ms"] - 0.01
        checked += 1
    assert checked >= 5
