"""AsyncEngine: the background step loop, per-request delta streams, aborts, a dead loop."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from engine.config.settings import EngineSettings
from engine.core.admission_rules import InvalidRequestError
from engine.core.params import SamplingParams
from engine.runtime.async_engine import AsyncEngine
from engine.runtime.errors import EngineDeadError, QueueFullError
from engine.runtime.llm_engine import LLMEngine
from tests.support.engine import assert_engine_clean


@pytest.fixture
def make_engine(tiny_llama):
    made: list[AsyncEngine] = []

    def _make(**overrides) -> AsyncEngine:
        settings = dict(
            model=str(tiny_llama),
            device="cpu",
            enforce_eager=True,
            max_model_len=128,
            num_gpu_blocks=64,
            max_num_seqs=8,
        )
        settings.update(overrides)
        engine = AsyncEngine(LLMEngine.from_settings(EngineSettings(**settings)), idle_poll_s=0.05).start()
        made.append(engine)
        return engine

    yield _make
    for engine in made:
        engine.shutdown()
        assert_engine_clean(engine.engine)


def wait_until(pred, timeout=10.0):
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def greedy(max_tokens=10, **kw) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, **kw)


async def collect(engine: AsyncEngine, prompt, params, request_id=None):
    text, tokens, finish = "", [], None
    async for delta in engine.generate(prompt, params, request_id):
        assert len(delta.outputs) <= 1
        for c in delta.outputs:
            text += c.text
            tokens += c.token_ids
            assert finish is None, "output after the finish"
            finish = c.finish_reason
    return text, tokens, finish


def test_concurrent_streams_match_offline(make_engine, make_llm):
    engine = make_engine()
    prompts = ["The quick brown fox", "Hello, world!", "A kiln is", "Paged attention"]

    async def main():
        return await asyncio.gather(*(collect(engine, p, greedy(12)) for p in prompts))

    results = asyncio.run(main())
    offline = make_llm(max_model_len=128, num_gpu_blocks=64).generate(prompts, greedy(12), use_tqdm=False)
    for (text, tokens, finish), ref in zip(results, offline):
        assert tokens == ref.outputs[0].token_ids and text == ref.outputs[0].text and finish == "length"
    wait_until(lambda: engine.engine.core.is_idle_and_free())


def test_abort_frees_blocks_at_next_step(make_engine):
    engine = make_engine()

    async def main():
        gen = engine.generate("The quick brown fox", greedy(100))
        got = 0
        async for _ in gen:
            got += 1
            if got == 3:
                break
        assert engine.engine.core.pool.num_in_use > 0
        await gen.aclose()  # the reader goes away: the request is aborted
        await asyncio.to_thread(wait_until, lambda: engine.engine.core.is_idle_and_free())  # loop still open

    asyncio.run(main())
    assert engine.is_alive
    assert engine.engine.core.num_generation_tokens_total < 100  # cut short, not run to its end


def test_invalid_request_rejected_without_disturbing_others(make_engine):
    engine = make_engine()

    async def main():
        good = asyncio.ensure_future(collect(engine, "Hello", greedy(20)))
        with pytest.raises(InvalidRequestError) as info:
            await engine.add_request("word " * 200, greedy(4))  # longer than max_model_len
        assert info.value.param == "prompt"
        with pytest.raises(InvalidRequestError):
            await engine.add_request([10**9], greedy(4))
        return await good

    text, tokens, finish = asyncio.run(main())
    assert len(tokens) == 20 and finish == "length"


def test_slow_reader_never_blocks_the_loop(make_engine):
    """A reader that stops reading holds no engine progress back, and its deltas coalesce."""
    engine = make_engine()

    async def main():
        slow = await engine.add_request("Hello", greedy(30))
        fast = await collect(engine, "A kiln is", greedy(30))
        await asyncio.to_thread(wait_until, lambda: slow.finished)  # finished while nobody read it
        deltas = [d async for d in slow]
        assert len(deltas) == 1 and len(deltas[0].outputs[0].token_ids) == 30  # one coalesced delta
        return fast

    assert len(asyncio.run(main())[1]) == 30


def test_queue_limit_and_dead_loop(make_engine):
    engine = make_engine(max_num_seqs=1, max_waiting_requests=1)
    boom = threading.Event()
    real_step = engine.engine.core.step

    def step():
        if boom.is_set():
            raise RuntimeError("GPU on fire")
        return real_step()

    engine.engine.core.step = step

    async def main():
        running = await engine.add_request("Hello", greedy(100))
        await asyncio.to_thread(wait_until, lambda: len(engine.engine.core.scheduler.running) == 1)
        waiting = await engine.add_request("Hello again", greedy(100))  # max_num_seqs=1: it waits
        with pytest.raises(QueueFullError):
            await engine.add_request("one too many", greedy(4))
        boom.set()
        for stream in (running, waiting):
            with pytest.raises(EngineDeadError):
                async for _ in stream:
                    pass
        with pytest.raises(EngineDeadError):
            await engine.add_request("after death", greedy(4))

    asyncio.run(main())
    assert not engine.is_alive and engine.crashed


def test_start_gives_the_starting_threads_openmp_team_back(make_engine, monkeypatch):
    """The step thread is to be the process's one OpenMP team (engine/worker/cpu_threads.py): start()
    has the thread that built the engine give its team back, before the step thread runs."""
    from engine.runtime import async_engine

    calls = []
    monkeypatch.setattr(async_engine, "release_openmp_team", lambda: calls.append(threading.current_thread()))
    engine = make_engine()
    assert calls == [threading.current_thread()]
    _, tokens, finish = asyncio.run(collect(engine, "hello", greedy(4)))
    assert len(tokens) == 4 and finish == "length"
