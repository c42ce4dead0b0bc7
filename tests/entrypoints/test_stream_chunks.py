"""The streamed chunks' hot path: a chunk's text is json.dumps of the whole chunk (its constant
head serialised once per job), and a job's reads end with ShuttingDown when the server ends it,
whether it reads one stream directly or several at once."""

from __future__ import annotations

import asyncio
import json

import pytest

from engine.core.outputs import CompletionOutput, RequestOutput
from engine.core.params import SamplingParams
from engine.entrypoints.openai.jobs import ChunkEvents, Job, ShuttingDown
from engine.runtime.request_stream import RequestStream


class _Fmt:
    chunk_object = "chat.completion.chunk"

    def first_chunks(self, job):
        return [{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}]

    def stream_choice(self, job, ch, idx, pidx, c, delta, first):
        return {"index": idx, "delta": {"content": c.text}, "logprobs": None, "finish_reason": c.finish_reason}


class _Gen:
    def __init__(self, include_usage: bool, continuous_usage: bool) -> None:
        self.include_usage, self.continuous_usage = include_usage, continuous_usage


def _delta(text: str, ids: list[int], finished: bool = False) -> RequestOutput:
    out = CompletionOutput(0, text, ids, None, None, finish_reason="length" if finished else None)
    return RequestOutput("r", None, [1, 2], [out], finished)


@pytest.mark.parametrize("include_usage,continuous", [(False, False), (True, False), (True, True)])
def test_chunk_text_is_json_dumps_of_the_whole_chunk(include_usage, continuous):
    job = Job('chatcmpl-"é\\', "chat", [], 1, [None], SamplingParams(), num_prompt_tokens=3)
    events = ChunkEvents(_Fmt(), 'model "ü" \n', _Gen(include_usage, continuous))  # type: ignore[arg-type]
    opening = events.opening(job)
    base = events.base
    usage = {"usage": job.usage()} if continuous else {"usage": None} if include_usage else {}
    first = {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
    assert opening == [f"data: {json.dumps({**base, 'choices': [first], **usage})}\n\n"]
    for text in ("Hello", ' "quoted" \\ \u2028 😀', ""):
        job.num_completion_tokens += 1
        usage = {"usage": job.usage()} if continuous else usage
        choice = {"index": 0, "delta": {"content": text}, "logprobs": None, "finish_reason": None}
        delta = _delta(text, [5])
        got = events.choice(job, None, 0, 0, delta.outputs[0], delta, False)  # type: ignore[arg-type]
        assert got == [f"data: {json.dumps({**base, 'choices': [choice], **usage})}\n\n"]


@pytest.mark.parametrize("num_streams", [1, 2])
def test_ending_a_job_ends_its_reader_with_shutting_down(num_streams):
    async def main():
        loop = asyncio.get_running_loop()
        streams = [RequestStream(f"r{i}", loop) for i in range(num_streams)]
        job = Job("cmpl-1", "completion", streams, 1, [None] * num_streams, SamplingParams())
        got: list[tuple[int, str]] = []

        async def read():
            async for pidx, delta in job.deltas():
                got.append((pidx, delta.outputs[0].text))

        reader = asyncio.ensure_future(read())
        for i, s in enumerate(streams):
            s._push(_delta(f"a{i}", [1]))
        await asyncio.sleep(0.01)
        assert sorted(got) == [(i, f"a{i}") for i in range(num_streams)]
        job.end()  # (the server's drain, on the loop)
        with pytest.raises(ShuttingDown):
            await asyncio.wait_for(reader, 5)
        streams[0]._push(_delta("late", [2]))  # a read after the end still ends
        with pytest.raises(ShuttingDown):
            await anext(job.deltas())

    asyncio.run(main())
