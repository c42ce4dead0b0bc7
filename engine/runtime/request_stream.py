"""RequestStream: the async iterator of one request's output deltas (lives on one asyncio loop).

The engine's threads hand it the newest delta with `loop.call_soon_threadsafe` (`_push`); it keeps
only what the reader has not read yet, merged (DeltaBacklog: pieces appended, joined once when
read), so a slow reader never makes the engine wait and costs memory only for its unread output.
A reader that takes nothing for `stall_timeout_s` while output waits is not reading (its client
has stopped): the request is aborted, which frees its KV blocks; the reader, should it come
back, reads what was made and the abort. Before that, back-pressure reaches generation: with
`pause_tokens` tokens unread the request is paused (not scheduled, its KV kept) until the reader
takes them, so a slow client slows only its own request and holds little unread output.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import threading
import time
from typing import Callable

from engine.core.outputs import CompletionOutput, RequestOutput

logger = logging.getLogger(__name__)


class RequestStream:
    """Async iterator of output deltas for one request (lives on one asyncio loop).

    Each item is a RequestOutput whose `outputs` hold, per choice that advanced, only what
    is new since the previous item: the new text, token ids and logprob entries, and the
    finish reason on the item where the choice ends. The engine makes these deltas
    (output_kind "delta": engine/runtime/output_processor.py); a reader slower than the engine gets the
    deltas of several steps merged into one item.
    """

    def __init__(
        self,
        request_id: str,
        loop: asyncio.AbstractEventLoop,
        on_close: Callable[[str], None] | None = None,
        stall_timeout_s: float | None = None,
        on_pause: Callable[[str, bool], None] | None = None,
        pause_tokens: int | None = None,
    ) -> None:
        self.request_id = request_id
        self.loop = loop
        self._on_close = on_close
        self._stall_timeout_s = stall_timeout_s
        self._on_pause: Callable[[str, bool], None] = on_pause or (lambda request_id, paused: None)
        self._pause_tokens = pause_tokens if on_pause is not None else None
        self.paused = False  # its request is paused until the reader takes what waits
        self.pauses = 0  # times it was paused
        self._backlog: DeltaBacklog | None = None  # deltas not yet read, merged
        self._unread_since = 0.0  # when the oldest unread delta came
        self._last: RequestOutput | None = None
        self._error: BaseException | None = None
        self._interrupt: BaseException | None = None  # raised by the next read, ahead of any output
        self._event = asyncio.Event()
        self.accepted: asyncio.Future = loop.create_future()
        self.finished = False  # the engine reported the request finished
        self.done = False  # the reader has seen the end
        self.closed = False
        self.stalled = False  # aborted because its reader took nothing for stall_timeout_s

    # ---- called on the stream's loop (scheduled from the step thread) ----
    def _push(self, delta: RequestOutput) -> None:
        if self._backlog is None:
            self._backlog = DeltaBacklog()
            self._unread_since = time.monotonic()
        self._backlog.add(delta)
        if delta.finished:
            self.finished = True
        else:
            if self._pause_tokens is not None and not self.paused and self._backlog.num_tokens >= self._pause_tokens:
                self.paused = True
                self.pauses += 1
                self._on_pause(self.request_id, True)
            if (
                self._stall_timeout_s is not None
                and not self.stalled
                and time.monotonic() - self._unread_since > self._stall_timeout_s
            ):
                self._stall()
        self._event.set()

    def _stall(self) -> None:
        self.stalled = True
        logger.info(
            "request %s: its reader took nothing for stall_timeout_s=%gs (%d tokens unread); aborting",
            self.request_id,
            self._stall_timeout_s,
            self._backlog.num_tokens if self._backlog else 0,
        )
        if self._on_close is not None:
            self._on_close(self.request_id)

    @property
    def unread_tokens(self) -> int:
        return self._backlog.num_tokens if self._backlog is not None else 0

    def _fail(self, exc: BaseException) -> None:
        if not self.accepted.done():
            self.accepted.set_exception(exc)
            self.accepted.exception()  # mark retrieved: the add path re-raises it itself
        self._error = exc
        self._event.set()

    def _accept(self, exc: BaseException | None) -> None:
        if self.accepted.done():
            return
        if exc is None:
            self.accepted.set_result(None)
        else:
            self.accepted.set_exception(exc)

    # ---- reader side ----
    def interrupt(self, exc: BaseException) -> None:
        """Make the reader's next (or waiting) read raise exc at once, output waiting or not (the
        server's shutdown ending a job); called on the stream's loop."""
        self._interrupt = exc
        self._event.set()

    @property
    def final_output(self) -> RequestOutput | None:
        """The last item the reader got (request-level fields: cached tokens, metrics, error)."""
        return self._last

    def __aiter__(self) -> "RequestStream":
        return self

    async def __anext__(self) -> RequestOutput:
        while True:
            if self._interrupt is not None:
                raise self._interrupt
            if self.done:
                raise StopAsyncIteration
            if self._backlog is not None:
                delta, self._backlog = self._backlog.take(), None
                if self.paused:
                    self.paused = False
                    if not self.finished and not self.closed:
                        self._on_pause(self.request_id, False)
                self._last = delta
                if delta.finished:
                    self.done = True
                return delta
            if self._error is not None:
                self.done = True
                raise self._error
            self._event.clear()
            await self._event.wait()

    def close(self) -> None:
        """Stop reading: aborts the request in the engine unless it already finished."""
        if self.closed:
            return
        self.closed = True
        if not self.finished and self._on_close is not None:
            self._on_close(self.request_id)


class LoopMailbox:
    """Outputs on their way from the engine's output thread to the streams of one asyncio loop.

    At most one delivery callback is queued on the loop at a time, and it takes everything posted
    so far; outputs for one stream posted while the loop is busy are merged (as the stream itself
    merges unread deltas). So a stalled or slow loop holds one pending item per stream, never one
    per engine step: memory stays bounded by what the readers have not read yet.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self._lock = threading.Lock()
        self._items: dict[RequestStream, DeltaBacklog] = {}
        self._scheduled = False

    def post(self, items: list[tuple[RequestStream, RequestOutput]]) -> list[RequestStream]:
        """Queue items for their streams (called on the output thread). Returns the streams whose
        items could not be handed over because the loop is closed (their readers are gone)."""
        with self._lock:
            for stream, out in items:
                backlog = self._items.get(stream)
                if backlog is None:
                    backlog = self._items[stream] = DeltaBacklog()
                backlog.add(out)
            if self._scheduled and not self.loop.is_closed():
                return []  # the queued callback takes these too
            self._scheduled = True
        try:
            if self.loop.is_closed():  # (closed with our callback still queued: it will never run)
                raise RuntimeError("event loop is closed")
            self.loop.call_soon_threadsafe(self._deliver)
        except RuntimeError:  # the loop is closed
            with self._lock:
                lost, self._items, self._scheduled = list(self._items), {}, False
            return lost
        return []

    @property
    def pending(self) -> int:
        """Streams with an item waiting for the loop."""
        with self._lock:
            return len(self._items)

    def _deliver(self) -> None:
        with self._lock:
            items, self._items, self._scheduled = self._items, {}, False
        for stream, backlog in items.items():
            stream._push(backlog.take())


class DeltaBacklog:
    """Consecutive deltas of one request, merged: per choice, text, token ids and logprob entries
    concatenated; everything else from the newest. Pieces are appended as they come and joined
    once, when taken (merging delta by delta would copy the whole backlog every step)."""

    __slots__ = ("_only", "_latest", "_choices", "num_tokens")

    def __init__(self) -> None:
        self._only: RequestOutput | None = None  # the one delta so far (taken as it is)
        self._latest: RequestOutput | None = None
        self._choices: dict[int, _ChoiceBacklog] = {}
        self.num_tokens = 0

    def add(self, delta: RequestOutput) -> None:
        for c in delta.outputs:  # (a loop, not sum() over a generator: this runs per token)
            self.num_tokens += len(c.token_ids)
        if self._latest is None:
            self._only = self._latest = delta
            return
        if self._only is not None:
            self._absorb(self._only)
            self._only = None
        self._absorb(delta)
        self._latest = delta

    def _absorb(self, delta: RequestOutput) -> None:
        for c in delta.outputs:
            choice = self._choices.get(c.index)
            if choice is None:
                choice = self._choices[c.index] = _ChoiceBacklog()
            choice.add(c)

    def take(self) -> RequestOutput:
        if self._only is not None:
            return self._only
        assert self._latest is not None  # (taken only after a delta was added)
        return dataclasses.replace(self._latest, outputs=[self._choices[i].take() for i in sorted(self._choices)])


class _ChoiceBacklog:
    __slots__ = ("texts", "token_ids", "logprobs", "last")

    def __init__(self) -> None:
        self.texts: list[str] = []
        self.token_ids: list[int] = []
        self.logprobs: list = []
        self.last: CompletionOutput | None = None

    def add(self, c: CompletionOutput) -> None:
        self.texts.append(c.text)
        self.token_ids.extend(c.token_ids)
        if c.logprobs is not None:
            self.logprobs.extend(c.logprobs)
        self.last = c

    def take(self) -> CompletionOutput:
        c = self.last
        assert c is not None  # (a backlog is made for a choice's first delta)
        return dataclasses.replace(
            c,
            text="".join(self.texts),
            token_ids=self.token_ids,
            logprobs=None if c.logprobs is None else self.logprobs,
        )
