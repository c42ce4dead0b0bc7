"""The app in-process (httpx ASGI transport) on a tiny engine: 503s for a full queue and a dead loop."""

from __future__ import annotations

import asyncio
import threading
import time

import httpx
import pytest

from tests.support.server import app_states, slow_steps


@pytest.fixture
def app_state(tiny_llama):
    yield from app_states(tiny_llama, max_model_len=128, num_gpu_blocks=64, max_num_seqs=1, max_waiting_requests=1)


async def _wait_until(pred, timeout=10.0):
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.01)


def _assert_error(resp: httpx.Response, status: int, code: str) -> None:
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["code"] == code


def test_503_when_waiting_queue_is_full(app_state):
    state, app = app_state()
    sched = state.engine.engine.core.scheduler
    body = {"prompt": "Hello", "max_tokens": 100, "ignore_eos": True}

    async def main():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as http:
            first = asyncio.ensure_future(http.post("/v1/completions", json=body))
            await _wait_until(lambda: len(sched.running) == 1)
            second = asyncio.ensure_future(http.post("/v1/completions", json=body))
            await _wait_until(lambda: len(sched.waiting) == 1)
            _assert_error(await http.post("/v1/completions", json=body), 503, "overloaded")
            _assert_error(
                await http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}]}),
                503,
                "overloaded",
            )
            # the queued requests are unaffected
            for task in (first, second):
                resp = await task
                assert resp.status_code == 200 and resp.json()["usage"]["completion_tokens"] == 100

    asyncio.run(main())


def test_dead_engine_loop_gives_503_and_fails_streams(app_state):
    state, app = app_state(max_num_seqs=4, max_waiting_requests=8)
    boom = threading.Event()
    real_step = state.engine.engine.core.step

    def step():
        if boom.is_set():
            raise RuntimeError("injected failure")
        return real_step()

    state.engine.engine.core.step = step

    async def main():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as http:
            assert (await http.get("/health")).status_code == 200
            pending = asyncio.ensure_future(
                http.post(
                    "/v1/completions", json={"prompt": "Hello", "max_tokens": 100, "ignore_eos": True, "stream": True}
                )
            )
            await _wait_until(lambda: state.engine.engine.core.pool.num_in_use > 0)
            boom.set()
            streamed = await pending
            assert streamed.status_code == 200  # headers were sent before the failure
            events = [e for e in streamed.text.split("\n\n") if e]
            assert events[-1] == "data: [DONE]" and '"engine_dead"' in events[-2]
            _assert_error(await http.get("/health"), 503, "engine_dead")
            _assert_error(await http.post("/v1/completions", json={"prompt": "hi"}), 503, "engine_dead")

    asyncio.run(main())
    assert state.engine.crashed
    # The running-requests gauge does not keep its last value after the loop died.
    assert 'kiln:num_requests_running{model_name="m"} 0.0' in state.metrics.render().decode()


def test_request_timeout_aborts_and_frees(app_state):
    state, app = app_state(server={"request_timeout": 0.3}, max_num_seqs=4, max_waiting_requests=8)
    slow_steps(state, 0.01)
    body = {"prompt": "Hello", "max_tokens": 100, "ignore_eos": True}

    async def main():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as http:
            _assert_error(await http.post("/v1/completions", json=body), 504, "timeout")
            streamed = await http.post("/v1/completions", json={**body, "stream": True})
            events = [e for e in streamed.text.split("\n\n") if e]
            assert events[-1] == "data: [DONE]" and '"code": "timeout"' in events[-2]
            assert len(events) > 3  # some tokens streamed before the deadline
            fast = await http.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 3})
            assert fast.status_code == 200
        await _wait_until(lambda: state.engine.engine.core.is_idle_and_free())

    asyncio.run(main())


def test_chat_prompt_logprobs_and_bad_value(app_state):
    """vLLM's prompt_logprobs on chat: a top-level list, one entry per prompt token; out of range: 400."""
    state, app = app_state()
    msgs = [{"role": "user", "content": "Hi there"}]

    async def main():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as http:
            ok = await http.post("/v1/chat/completions", json={"messages": msgs, "max_tokens": 2, "prompt_logprobs": 1})
            bad = await http.post(
                "/v1/chat/completions", json={"messages": msgs, "max_tokens": 2, "prompt_logprobs": 21}
            )
            return ok, bad

    ok, bad = asyncio.run(main())
    assert ok.status_code == 200, ok.text
    body = ok.json()
    entries = body["prompt_logprobs"]
    assert entries[0] is None and len(entries) == body["usage"]["prompt_tokens"]
    for e in entries[1:]:
        assert 1 <= len(e) <= 2 and all(v["logprob"] <= 0 and isinstance(v["decoded_token"], str) for v in e.values())
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "prompt_logprobs", bad.text


def test_models_retrieve_with_the_openai_client(tiny_llama):
    """`client.models.retrieve(id)` (GET /v1/models/{id}): the served model under each of its names,
    a 404 the client maps to NotFoundError otherwise."""
    import openai

    from tests.support.engine import served

    async def main(client):
        got = [await client.models.retrieve(name) for name in ("m", "alias")]
        with pytest.raises(openai.NotFoundError):
            await client.models.retrieve("nope")
        return got

    with served(tiny_llama, {"served_model_name": ["m", "alias"]}) as (state, http, client):
        got = asyncio.run(main(client))
    assert [m.id for m in got] == ["m", "m"] and got[0].owned_by == "kiln"
