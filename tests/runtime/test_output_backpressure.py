"""A slow consumer never grows AsyncEngine's memory without limit and loses nothing: a slow output
thread makes the step thread wait (bounded queue), a stalled event loop gets merged deltas."""

from __future__ import annotations

import asyncio
import time

from engine.config.settings import EngineSettings
from engine.core.outputs import CompletionOutput, RequestOutput
from engine.core.params import SamplingParams
from engine.runtime.async_engine import AsyncEngine
from engine.runtime.llm_engine import LLMEngine
from engine.runtime.request_stream import LoopMailbox, RequestStream
from tests.support.engine import assert_engine_clean

SETTINGS = dict(device="cpu", enforce_eager=True, max_model_len=128, num_gpu_blocks=64, max_num_seqs=8)
PROMPTS = ["The quick brown fox", "Hello, world!"]
PARAMS = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)


class _SlowListener:
    """Takes 20 ms per step on the output thread and records how full the outbox was."""

    def __init__(self) -> None:
        self.engine: AsyncEngine | None = None
        self.max_queued = 0

    def on_step(self, engine, outputs, now) -> None:
        self.max_queued = max(self.max_queued, self.engine._outbox.qsize())
        time.sleep(0.02)


async def _read(engine: AsyncEngine, prompt: str, stall_s: float = 0.0) -> tuple[list[int], str, int]:
    ids, text, items = [], "", 0
    async for delta in engine.generate(prompt, PARAMS):
        if items == 0 and stall_s:
            time.sleep(stall_s)  # block the whole event loop: nothing is delivered meanwhile
        items += 1
        ids += delta.outputs[0].token_ids
        text += delta.outputs[0].text
    return ids, text, items


def _run(engine: AsyncEngine, stall_s: float = 0.0):
    engine.start()
    try:

        async def main():
            return await asyncio.gather(*(_read(engine, p, stall_s) for p in PROMPTS))

        return asyncio.run(main())
    finally:
        engine.shutdown()


def test_slow_output_thread_holds_the_step_thread_and_drops_nothing(tiny_llama, make_llm):
    want = make_llm(**SETTINGS).generate(PROMPTS, PARAMS, use_tqdm=False)
    listener = _SlowListener()
    engine = AsyncEngine(
        LLMEngine.from_settings(EngineSettings(model=str(tiny_llama), **SETTINGS)),
        listener=listener,
        idle_poll_s=0.05,
        max_pending_steps=2,
    )
    listener.engine = engine
    got = _run(engine)
    for (ids, text, _), ref in zip(got, want):
        assert ids == list(ref.outputs[0].token_ids) and text == ref.outputs[0].text
    assert listener.max_queued <= 2  # never more than the bound waiting for the output thread
    assert engine.backpressure_waits > 0 and engine.backpressure_seconds > 0  # the step thread waited
    assert_engine_clean(engine.engine)


def test_stalled_event_loop_gets_merged_deltas(tiny_llama, make_llm, monkeypatch):
    want = make_llm(**SETTINGS).generate(PROMPTS, PARAMS, use_tqdm=False)
    deliveries = []
    deliver = LoopMailbox._deliver

    def counted(self):
        deliveries.append(self.pending)
        deliver(self)

    monkeypatch.setattr(LoopMailbox, "_deliver", counted)
    engine = AsyncEngine(LLMEngine.from_settings(EngineSettings(model=str(tiny_llama), **SETTINGS)), idle_poll_s=0.05)
    got = _run(engine, stall_s=1.0)
    for (ids, text, items), ref in zip(got, want):
        assert ids == list(ref.outputs[0].token_ids) and text == ref.outputs[0].text
        assert items < 30  # steps merged while the loop was blocked
    # One callback per delivery, each taking at most one item per stream: never a backlog per step.
    assert all(n <= len(PROMPTS) for n in deliveries) and len(deliveries) < 60
    assert_engine_clean(engine.engine)


def _out(text: str, ids: list[int], finished: bool = False) -> RequestOutput:
    return RequestOutput(
        "r",
        "",
        [],
        [CompletionOutput(0, text, ids, None, None, finish_reason="length" if finished else None)],
        finished=finished,
    )


def test_mailbox_merges_per_stream_and_schedules_one_callback():
    loop = asyncio.new_event_loop()
    try:
        calls = []
        schedule = loop.call_soon_threadsafe
        loop.call_soon_threadsafe = lambda fn, *a: calls.append(fn) or schedule(fn, *a)
        stream = RequestStream("r", loop)
        box = LoopMailbox(loop)
        for i in range(100):
            assert box.post([(stream, _out(f"t{i} ", [i], finished=i == 99))]) == []
        assert len(calls) == 1 and box.pending == 1  # one callback, one merged item
        loop.run_until_complete(asyncio.sleep(0))
        assert box.pending == 0
        merged = loop.run_until_complete(stream.__anext__())
        assert merged.finished and merged.outputs[0].token_ids == list(range(100))
        assert merged.outputs[0].text == "".join(f"t{i} " for i in range(100))
    finally:
        loop.close()
    assert box.post([(stream, _out("late", [1]))]) == [stream]  # a closed loop: its reader is gone
    assert box.pending == 0


def test_mailbox_reports_a_loop_closed_with_its_callback_queued():
    loop = asyncio.new_event_loop()
    stream = RequestStream("r", loop)
    box = LoopMailbox(loop)
    assert box.post([(stream, _out("a", [1]))]) == []  # callback queued, never run
    loop.close()
    assert box.post([(stream, _out("b", [2]))]) == [stream]  # not left waiting for a dead loop
    assert box.pending == 0
