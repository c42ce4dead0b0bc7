"""Slow readers (issue 27, item 6): a client that stops reading its stream does not keep its
sequence generating for nobody (aborted after stream_stall_timeout_s, KV blocks freed), what it
has not read is held merged in its stream (not queued step by step), and when it disconnects its
blocks are free within a second. Driven at the ASGI level, so the client's reading is exact."""

from __future__ import annotations

import asyncio
import json
import time

import pytest

from engine.core.outputs import CompletionOutput, RequestOutput
from engine.runtime.request_stream import DeltaBacklog
from tests.support.server import app_states, slow_steps


@pytest.fixture
def app_state(tiny_llama):
    yield from app_states(tiny_llama, max_model_len=1024, num_gpu_blocks=512, max_num_seqs=8)


class StalledClient:
    """A streaming request whose client reads `reads` chunks, then stops reading (its send
    blocks, as a full socket would) until it disconnects."""

    def __init__(self, app, body: dict, reads: int = 3) -> None:
        self.chunks: list[bytes] = []
        self.blocked = asyncio.Event()
        self.gone = asyncio.Event()
        self._reads = reads
        self._sent_body = False
        scope = {
            "type": "http",
            "asgi": {"version": "3.0", "spec_version": "2.3"},
            "http_version": "1.1",
            "method": "POST",
            "scheme": "http",
            "path": "/v1/completions",
            "raw_path": b"/v1/completions",
            "query_string": b"",
            "root_path": "",
            "client": ("127.0.0.1", 50000),
            "server": ("t", 80),
            "headers": [(b"host", b"t"), (b"content-type", b"application/json")],
            "state": {},
        }
        self.task = asyncio.ensure_future(app(scope, self._receive, self._send))
        self._body = json.dumps(body).encode()

    async def _receive(self):
        if not self._sent_body:
            self._sent_body = True
            return {"type": "http.request", "body": self._body, "more_body": False}
        await self.gone.wait()
        return {"type": "http.disconnect"}

    async def _send(self, message) -> None:
        if message["type"] != "http.response.body":
            return
        self.chunks.append(message.get("body", b""))
        if len(self.chunks) >= self._reads:
            self.blocked.set()
            await self.gone.wait()  # the client reads nothing more

    def disconnect(self) -> None:
        self.gone.set()


def _engine_free(state) -> bool:
    return state.engine.engine.core.is_idle_and_free()


async def _until(pred, timeout: float) -> float:
    t0 = time.monotonic()
    while not pred():
        assert time.monotonic() - t0 < timeout, "timed out"
        await asyncio.sleep(0.01)
    return time.monotonic() - t0


LONG = {"prompt": "Hello", "max_tokens": 1000, "ignore_eos": True, "stream": True}


def test_a_client_that_stops_reading_is_aborted_and_its_blocks_freed(app_state):
    state, app = app_state(server={"stream_stall_timeout_s": 0.5})
    slow_steps(state, 0.005)  # 1000 tokens take over 5 s: far longer than the stall timeout

    async def main():
        clients = [StalledClient(app, LONG) for _ in range(6)]
        for c in clients:
            await asyncio.wait_for(c.blocked.wait(), 30)
        blocked_at = time.monotonic()
        await _until(lambda: _engine_free(state), 10)  # aborted while the clients are still connected
        freed_after = time.monotonic() - blocked_at
        assert not any(c.task.done() for c in clients)
        for c in clients:
            c.disconnect()
        await asyncio.wait_for(asyncio.gather(*(c.task for c in clients)), 10)
        return freed_after

    freed_after = asyncio.run(main())
    assert freed_after < 3.0, freed_after


def test_blocks_are_freed_within_a_second_of_the_disconnect(app_state):
    state, app = app_state(server={"stream_stall_timeout_s": 0})  # (never)
    slow_steps(state, 0.002)

    async def main():
        clients = [StalledClient(app, LONG) for _ in range(8)]
        for c in clients:
            await asyncio.wait_for(c.blocked.wait(), 30)
        await asyncio.sleep(1.0)  # they go on generating into their streams, unread
        unread = [s.unread_tokens for job in state.jobs for s in job.streams]
        assert not _engine_free(state)
        t0 = time.monotonic()
        for c in clients:
            c.disconnect()
        freed = await _until(lambda: _engine_free(state), 10)
        await asyncio.wait_for(asyncio.gather(*(c.task for c in clients)), 10)
        return unread, freed, time.monotonic() - t0

    unread, freed, _ = asyncio.run(main())
    assert len(unread) == 8 and max(unread) > 0, unread  # held, merged, in each stream
    assert freed < 1.0, freed


class LateReader(StalledClient):
    """Reads `reads` chunks, stops reading until `resume` is set, then reads everything."""

    def __init__(self, app, body: dict, reads: int = 3) -> None:
        self.resume = asyncio.Event()
        super().__init__(app, body, reads)

    async def _send(self, message) -> None:
        if message["type"] != "http.response.body":
            return
        self.chunks.append(message.get("body", b""))
        if len(self.chunks) == self._reads:
            self.blocked.set()
            await self.resume.wait()

    def usage(self) -> dict:
        events = [json.loads(line[6:]) for line in b"".join(self.chunks).decode().splitlines() if line[6:7] == "{"]
        return [e for e in events if e.get("usage")][-1]["usage"]


def test_a_client_that_does_not_read_pauses_its_own_generation(app_state):
    state, app = app_state(server={"stream_stall_timeout_s": 0, "stream_pause_tokens": 16})  # (no abort)
    slow_steps(state, 0.002)
    sched = state.engine.engine.core.scheduler
    body = {**LONG, "max_tokens": 120, "stream_options": {"include_usage": True}}

    def generated() -> int:
        return sum(s.num_output_tokens for r in sched.requests.values() for s in r.seqs)

    async def main():
        clients = [LateReader(app, body) for _ in range(4)]
        for c in clients:
            await asyncio.wait_for(c.blocked.wait(), 30)
        await _until(lambda: all(r.paused for r in sched.requests.values()), 30)
        await asyncio.sleep(0.2)  # (a step launched as they paused ends)
        before = generated()
        await asyncio.sleep(0.5)  # paused: nothing more is generated for them
        after = generated()
        unread = [s.unread_tokens for job in state.jobs for s in job.streams]
        for c in clients:
            c.resume.set()
        await asyncio.wait_for(asyncio.gather(*(c.task for c in clients)), 60)
        await _until(lambda: _engine_free(state), 10)
        return before, after, unread, [c.usage() for c in clients]

    before, after, unread, usages = asyncio.run(main())
    assert before == after, (before, after)
    assert before < 4 * 120 // 2 and all(16 <= u < 32 for u in unread), (before, unread)  # long before the end
    assert all(u["completion_tokens"] == 120 for u in usages), usages  # resumed, nothing lost


def _delta(text: str, ids: list[int], logprobs=None, finish=None) -> RequestOutput:
    return RequestOutput(
        "r", "p", [1], [CompletionOutput(0, text, ids, None, logprobs, finish)], finished=finish is not None
    )


def test_delta_backlog_merges_in_order_and_keeps_one_delta_as_is():
    one = _delta("a", [1])
    backlog = DeltaBacklog()
    backlog.add(one)
    assert backlog.take() is one
    backlog = DeltaBacklog()
    for i in range(1000):
        backlog.add(_delta(f"<{i}>", [i], logprobs=[{i: -1.0}], finish="length" if i == 999 else None))
    merged = backlog.take()
    c = merged.outputs[0]
    assert c.text == "".join(f"<{i}>" for i in range(1000)) and c.token_ids == list(range(1000))
    assert c.logprobs == [{i: -1.0} for i in range(1000)] and c.finish_reason == "length" and merged.finished
    assert backlog.num_tokens == 1000
