"""Request jobs: one HTTP request's engine streams, read as one (stream mux), with its time
limit, its client's disconnect and the server's shutdown; collected into a body or framed as
server-sent events. What the body and the chunks say is the endpoint's formatter's business
(completions.py, chat.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import time
from dataclasses import dataclass
from typing import Any, AsyncIterator, Protocol

from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from engine.core.outputs import RequestOutput
from engine.core.params import SamplingParams
from engine.entrypoints.openai.errors import (
    RequestFailed,
    engine_failed,
    shutting_down,
    stream_error_body,
    timeout_error,
)
from engine.entrypoints.openai.generation_request import GenerationRequest
from engine.entrypoints.openai.logprobs import LogprobFormat
from engine.entrypoints.openai.reasoning import ReasoningParser
from engine.entrypoints.openai.tool_calls import ToolCall, ToolMode
from engine.entrypoints.openai.tool_parsers.streaming import StreamedCalls
from engine.runtime.admission import AdmittedRequest
from engine.runtime.errors import EngineDeadError
from engine.runtime.request_stream import RequestStream

logger = logging.getLogger("engine.entrypoints.openai")


class ShuttingDown(Exception):
    """The server ended the job (shutdown grace period over)."""


@dataclass
class Choice:
    text: str = ""
    token_ids: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[dict[int, float]] = dataclasses.field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    text_offset: int = 0  # completions logprobs: where the next token's text starts
    streamed: int = 0  # chat with tools or reasoning: chars of the content already sent
    reasoning_sent: int = 0  # chat with a reasoning parser: chars of the reasoning already sent
    call: ToolCall | None = None  # a streamed named tool call (its id stays the same)
    calls: StreamedCalls = dataclasses.field(default_factory=StreamedCalls)  # streamed auto tool calls


@dataclass(eq=False)  # identity: jobs live in a set
class Job:
    """One HTTP request: its engine streams (one per prompt) and what they produced so far."""

    id: str
    kind: str  # "completion" | "chat"
    streams: list[RequestStream]
    n: int
    prompt_texts: list[str | None]
    params: SamplingParams
    echo: bool = False
    prompt_only: bool = False  # echo with max_tokens=0: the generated token is dropped
    tool_mode: ToolMode | None = None  # chat with tools
    reasoning: ReasoningParser | None = None  # chat with a reasoning parser (unconstrained output)
    num_prompt_tokens: int = 0
    num_completion_tokens: int = 0
    registry: set | None = None  # the server's live jobs (ServerState.jobs)
    ended: bool = False  # the server ended it (shutdown)

    def __post_init__(self) -> None:
        if self.registry is not None:
            self.registry.add(self)
            if getattr(self.registry, "closed", False):  # (accepted after the drain ended the others)
                self.ended = True

    def end(self) -> None:
        """Shutdown: make the reader stop with ShuttingDown (its streams' reads raise it)."""
        self.ended = True
        for s in self.streams:
            s.interrupt(ShuttingDown())

    def close(self) -> None:
        for s in self.streams:
            s.close()
        if self.registry is not None:
            self.registry.discard(self)

    def cached_tokens(self) -> int:
        return sum((s.final_output.num_cached_tokens if s.final_output else 0) for s in self.streams)

    def usage(self) -> dict[str, Any]:
        return {
            "prompt_tokens": self.num_prompt_tokens,
            "completion_tokens": self.num_completion_tokens,
            "total_tokens": self.num_prompt_tokens + self.num_completion_tokens,
            "prompt_tokens_details": {"cached_tokens": self.cached_tokens()},
        }

    def account(self, pidx: int, delta: RequestOutput, seen_prompts: set[int]) -> None:
        if pidx not in seen_prompts:
            seen_prompts.add(pidx)
            self.num_prompt_tokens += len(delta.prompt_token_ids)
        self.num_completion_tokens += sum(len(c.token_ids) for c in delta.outputs)

    def deltas(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        """(prompt index, delta) from all of the job's streams as they come; for a prompt-only
        job without the token it generated."""
        return self._prompt_only(self._mux()) if self.prompt_only else self._mux()

    @staticmethod
    async def _prompt_only(
        deltas: AsyncIterator[tuple[int, RequestOutput]],
    ) -> AsyncIterator[tuple[int, RequestOutput]]:
        async for pidx, delta in deltas:
            outputs = [
                dataclasses.replace(
                    c,
                    text="",
                    token_ids=[],
                    logprobs=None if c.logprobs is None else [],
                    cumulative_logprob=None if c.cumulative_logprob is None else 0.0,
                )
                for c in delta.outputs
            ]
            yield pidx, dataclasses.replace(delta, outputs=outputs)

    async def _mux(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        """The streams read as one, on demand: each stream has at most one delta taken and not yet
        yielded, so what a slow consumer has not read stays merged in its stream (bounded), never
        queued here step by step. (Reading a one-stream job directly, without the task and the
        wait per delta, took 0.8x the loop's CPU per token but raised the ITL median ~5% in three
        interleaved served runs: docs/benchmarks.md, the output side's CPU per token.)"""
        if self.ended:
            raise ShuttingDown()
        reads = {asyncio.ensure_future(anext(s)): i for i, s in enumerate(self.streams)}
        try:
            while reads:
                done, _ = await asyncio.wait(reads, return_when=asyncio.FIRST_COMPLETED)
                for task in sorted(done, key=reads.__getitem__):  # (in prompt order)
                    i = reads.pop(task)
                    try:
                        d = task.result()
                    except StopAsyncIteration:
                        continue
                    reads[asyncio.ensure_future(anext(self.streams[i]))] = i
                    yield i, d
        finally:
            for task in reads:
                task.cancel()


class Formatter(Protocol):
    """What an endpoint family says: the final body and the streamed chunks of a job."""

    chunk_object: str

    def first_chunks(self, job: Job) -> list[dict[str, Any]]:
        """Choices sent before any output (chat: the assistant role)."""

    def stream_choice(
        self, job: Job, ch: Choice, idx: int, pidx: int, c, delta: RequestOutput, first: bool
    ) -> dict[str, Any]:
        """One streamed choice of a delta."""

    def final_body(self, job: Job, results: list[tuple[Choice, RequestOutput | None]]) -> dict[str, Any]:
        """The non-streaming response."""


class FormatBase:
    """What both formatters hold: the server state and the logprob formats."""

    def __init__(self, state) -> None:
        self.state = state
        self.lp = LogprobFormat(state.tokenizer)


def envelope(job: Job, object_: str, model: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "id": job.id,
        "object": object_,
        "created": int(time.time()),
        "model": model,
        "choices": choices,
        "usage": job.usage(),
        "system_fingerprint": None,
    }


def sse(payload: dict | str) -> str:
    """One server-sent event."""
    return f"data: {payload if isinstance(payload, str) else json.dumps(payload)}\n\n"


async def start_job(engine, registry: set, job_id: str, admitted: list[AdmittedRequest], gen: GenerationRequest) -> Job:
    """Submit every prompt's admitted request (together: they are admitted in the same step)."""
    if getattr(registry, "closed", False):
        raise shutting_down()
    results = await asyncio.gather(*(engine.submit(a) for a in admitted), return_exceptions=True)
    streams = [r for r in results if isinstance(r, RequestStream)]
    errors = [r for r in results if isinstance(r, BaseException)]
    if errors:
        for s in streams:
            s.close()
        raise errors[0]
    return Job(
        job_id,
        gen.kind,
        streams,
        gen.params.n,
        gen.texts,
        gen.params,
        echo=gen.echo,
        prompt_only=gen.prompt_only,
        tool_mode=gen.tool_mode,
        reasoning=gen.reasoning,
        registry=registry,
    )


async def collect(job: Job) -> list[tuple[Choice, RequestOutput | None]]:
    """Every choice of the job, read to the end."""
    choices: dict[int, Choice] = {}
    last: dict[int, RequestOutput] = {}
    seen: set[int] = set()
    async for pidx, delta in job.deltas():
        job.account(pidx, delta, seen)
        last[pidx] = delta
        for c in delta.outputs:
            if c.finish_reason == "error":
                raise engine_failed(delta.error or "unknown error")
            ch = choices.get(pidx * job.n + c.index)
            if ch is None:  # (not setdefault: that would build a Choice per delta)
                ch = choices[pidx * job.n + c.index] = Choice()
            ch.text += c.text
            ch.token_ids += c.token_ids
            ch.logprobs += c.logprobs or []
            if c.finish_reason:
                ch.finish_reason, ch.stop_reason = c.finish_reason, c.stop_reason
    return [
        (choices.get(i, Choice(finish_reason="abort")), last.get(i // job.n)) for i in range(len(job.streams) * job.n)
    ]


async def wait_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def until_done(work, request: Request, timeout: float | None, job_id: str):
    """work's result; None if the client disconnected first (work is cancelled); 504 after
    `timeout`; a 503 if the server ended the job."""
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(wait_disconnect(request))
    try:
        done, _ = await asyncio.wait({task, watch}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        if task in done:
            try:
                return task.result()
            except ShuttingDown:
                raise shutting_down() from None
        if watch in done:
            logger.info("%s: client disconnected; aborting", job_id)
            return None
        raise timeout_error(timeout)
    finally:
        for t in (task, watch):
            t.cancel()


class EventWriter(Protocol):
    """How an API frames a job's stream as server-sent events (OpenAI's chunks below;
    Anthropic's and the Responses API's events in messages.py and responses.py)."""

    def opening(self, job: Job) -> list[str]:
        """Events before any output."""

    def choice(self, job: Job, ch: Choice, idx: int, pidx: int, c, delta: RequestOutput, first: bool) -> list[str]:
        """The events of one choice's delta (ch holds what came before)."""

    def closing(self, job: Job) -> list[str]:
        """Events once every stream has finished."""

    def failure(self, job: Job, error: dict[str, Any]) -> list[str]:
        """The events that end a stream which could not finish (error: an OpenAI error body)."""


class ChunkEvents:
    """OpenAI's streamed chunks: the formatter's choices, the usage chunk if asked, then [DONE].

    A chunk is its job's constant fields, the choices and the usage; the constant head and the
    tail are serialised once per job and the chunk's text is exactly json.dumps of the whole
    (this runs once per token per stream)."""

    def __init__(self, fmt: Formatter, model: str, gen: GenerationRequest) -> None:
        self.fmt, self.model, self.gen = fmt, model, gen
        self.base: dict[str, Any] = {}
        self._head = 'data: {"choices": '  # json.dumps(base) less its closing brace, then the choices key
        self._tail = ', "usage": null}\n\n' if gen.include_usage else "}\n\n"

    def _chunk(self, job: Job, choices: list[dict]) -> str:
        if self.gen.continuous_usage:  # (vLLM's continuous_usage_stats)
            return f'{self._head}{json.dumps(choices)}, "usage": {json.dumps(job.usage())}}}\n\n'
        return f"{self._head}{json.dumps(choices)}{self._tail}"

    def opening(self, job: Job) -> list[str]:
        self.base = {"id": job.id, "object": self.fmt.chunk_object, "created": int(time.time()), "model": self.model}
        self._head = f'data: {json.dumps(self.base)[:-1]}, "choices": '
        return [self._chunk(job, [first]) for first in self.fmt.first_chunks(job)]

    def choice(self, job: Job, ch: Choice, idx: int, pidx: int, c, delta: RequestOutput, first: bool) -> list[str]:
        return [self._chunk(job, [self.fmt.stream_choice(job, ch, idx, pidx, c, delta, first)])]

    def closing(self, job: Job) -> list[str]:
        usage = [sse({**self.base, "choices": [], "usage": job.usage()})] if self.gen.include_usage else []
        return [*usage, sse("[DONE]")]

    def failure(self, job: Job, error: dict[str, Any]) -> list[str]:
        return [sse(error), sse("[DONE]")]


async def respond(
    job: Job,
    fmt: Formatter,
    model: str,
    gen: GenerationRequest,
    request: Request,
    timeout: float | None,
    events: EventWriter | None = None,
):
    """The job's SSE stream (OpenAI's chunks unless `events` frames it), or its body once
    collected (a 499 if the client left first)."""
    if gen.stream:
        return StreamingResponse(
            stream_events(job, events or ChunkEvents(fmt, model, gen), timeout),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache"},
        )
    try:
        results = await until_done(collect(job), request, timeout, job.id)
    finally:
        job.close()
    return Response(status_code=499) if results is None else fmt.final_body(job, results)


async def stream_events(job: Job, events: EventWriter, timeout: float | None) -> AsyncIterator[str]:
    """The job as SSE, framed by `events`; a job that cannot finish (engine error, time limit,
    dead engine, shutdown) ends with the writer's failure events."""
    choices: dict[int, Choice] = {}
    seen: set[int] = set()
    try:
        for event in events.opening(job):
            yield event
        async with _maybe_timeout(timeout):
            async for pidx, delta in job.deltas():
                job.account(pidx, delta, seen)
                for c in delta.outputs:
                    if c.finish_reason == "error":
                        raise RequestFailed(delta.error or "unknown error")
                    idx = pidx * job.n + c.index
                    ch = choices.get(idx)
                    first = ch is None
                    if ch is None:  # (not setdefault: that would build a Choice per delta)
                        ch = choices[idx] = Choice()
                    for event in events.choice(job, ch, idx, pidx, c, delta, first):
                        yield event
        ending = events.closing(job)
    except (EngineDeadError, TimeoutError, RequestFailed, ShuttingDown) as exc:
        ending = events.failure(
            job, stream_error_body(shutting_down() if isinstance(exc, ShuttingDown) else exc, timeout)
        )
    finally:
        job.close()
    for event in ending:
        yield event


@contextlib.asynccontextmanager
async def _maybe_timeout(seconds: float | None):
    if seconds is None:
        yield
    else:
        async with asyncio.timeout(seconds):
            yield
