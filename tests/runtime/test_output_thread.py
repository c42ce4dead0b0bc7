"""The server's AsyncEngine detokenises, finds stop strings and builds RequestOutputs on its output
thread, never on the step thread; the results equal the offline (inline) path; a stop string found
there still finishes the sequence in the scheduler and frees its blocks."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from engine.config.settings import EngineSettings
from engine.core.params import SamplingParams
from engine.runtime.async_engine import AsyncEngine
from engine.runtime.llm_engine import LLMEngine
from tests.support.engine import assert_engine_clean

SETTINGS = dict(device="cpu", enforce_eager=True, max_model_len=128, num_gpu_blocks=64, max_num_seqs=8)
PROMPTS = ["The quick brown fox", "Hello, world!", "A kiln is", "Paged attention"]


async def _collect(engine: AsyncEngine, prompt, params):
    choices: dict[int, dict] = {}
    async for delta in engine.generate(prompt, params):
        for c in delta.outputs:
            acc = choices.setdefault(c.index, {"text": "", "ids": [], "lps": [], "finish": None, "stop": None})
            assert acc["finish"] is None, "output after the finish"
            acc["text"] += c.text
            acc["ids"] += c.token_ids
            acc["lps"] += c.logprobs or []
            acc["finish"], acc["stop"] = c.finish_reason, c.stop_reason
    return [choices[i] for i in sorted(choices)]


def _offline(out):
    return [
        {
            "text": c.text,
            "ids": list(c.token_ids),
            "lps": list(c.logprobs or []),
            "finish": c.finish_reason,
            "stop": c.stop_reason,
        }
        for c in sorted(out.outputs, key=lambda c: c.index)
    ]


def _without_lps(choices_per_prompt):
    return [[{k: v for k, v in c.items() if k != "lps"} for c in choices] for choices in choices_per_prompt]


def test_text_is_built_off_the_step_thread_and_equals_offline(tiny_llama, make_llm):
    offline = make_llm(**SETTINGS)
    ref = offline.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True), use_tqdm=False)
    stops = [r.outputs[0].text[4:6] for r in ref]  # each hit a few tokens in
    params = [
        SamplingParams(temperature=0, max_tokens=20, stop=[stops[0]], ignore_eos=True),
        SamplingParams(
            temperature=0, max_tokens=20, stop=[stops[1]], include_stop_str_in_output=True, ignore_eos=True, logprobs=2
        ),
        SamplingParams(n=2, temperature=1.0, seed=3, max_tokens=12, stop=[stops[2]]),
        SamplingParams(temperature=0, max_tokens=20, stop=[stops[3]], min_tokens=8),
    ]
    want = [_offline(o) for o in offline.generate(PROMPTS, params, use_tqdm=False)]
    assert want[0][0]["finish"] == "stop" and want[1][0]["finish"] == "stop"

    engine = AsyncEngine(LLMEngine.from_settings(EngineSettings(model=str(tiny_llama), **SETTINGS)), idle_poll_s=0.05)
    threads: set[str] = set()
    detok = engine._output_side.outputs.detokenizer
    step = detok.step

    def recorded(state):
        threads.add(threading.current_thread().name)
        return step(state)

    detok.step = recorded
    inline = []  # the engine's inline output side (LLMEngine.step's) must not run: the step thread keeps no text
    engine.engine.outputs.process = lambda updates: inline.append(updates)
    engine.start()
    try:

        async def main():
            return await asyncio.gather(*(_collect(engine, p, q) for p, q in zip(PROMPTS, params)))

        got = asyncio.run(main())
        # Tokens, text and stops exactly; logprobs to float32 rounding: the server's batches form
        # as requests arrive, and another batch shape may take another matmul path.
        assert _without_lps(got) == _without_lps(want)
        for g, w in zip(got, want):
            for gc, wc in zip(g, w):
                assert [set(d) for d in gc["lps"]] == [set(d) for d in wc["lps"]]
                for gd, wd in zip(gc["lps"], wc["lps"]):
                    assert gd == pytest.approx(wd, abs=1e-4)
        assert threads == {"kiln-outputs"} and not inline
        deadline = time.monotonic() + 10
        while not engine.engine.core.is_idle_and_free():  # the stop strings' sequences were finished there too
            assert time.monotonic() < deadline, "blocks still held after the streams ended"
            time.sleep(0.01)
    finally:
        engine.shutdown()
    assert_engine_clean(engine.engine)
