"""RequestStream: the async iterator of one request's output deltas (lives on one asyncio loop).

The engine's threads hand it the newest delta with `loop.call_soon_threadsafe` (`_push`); it keeps
only what the reader has not read yet, merged, so a slow reader never makes the engine wait and
never piles up memory.
"""

from __future__ import annotations

import asyncio
import dataclasses
import threading
from typing import Callable

from engine.core.request import RequestOutput


class RequestStream:
    """Async iterator of output deltas for one request (lives on one asyncio loop).

    Each item is a RequestOutput whose `outputs` hold, per choice that advanced, only what
    is new since the previous item: the new text, token ids and logprob entries, and the
    finish reason on the item where the choice ends. The engine makes these deltas
    (output_kind "delta": engine/runtime/output_processor.py); a reader slower than the engine gets the
    deltas of several steps merged into one item.
    """

    def __init__(self, request_id: str, loop: asyncio.AbstractEventLoop,
                 on_close: Callable[[str], None] | None = None) -> None:
        self.request_id = request_id
        self.loop = loop
        self._on_close = on_close
        self._pending: RequestOutput | None = None  # deltas not yet read, merged
        self._last: RequestOutput | None = None
        self._error: BaseException | None = None
        self._event = asyncio.Event()
        self.accepted: asyncio.Future = loop.create_future()
        self.finished = False  # the engine reported the request finished
        self.done = False  # the reader has seen the end
        self.closed = False

    # ---- called on the stream's loop (scheduled from the step thread) ----
    def _push(self, delta: RequestOutput) -> None:
        self._pending = delta if self._pending is None else _merge(self._pending, delta)
        if delta.finished:
            self.finished = True
        self._event.set()

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
    @property
    def final_output(self) -> RequestOutput | None:
        """The last item the reader got (request-level fields: cached tokens, metrics, error)."""
        return self._last

    def __aiter__(self) -> "RequestStream":
        return self

    async def __anext__(self) -> RequestOutput:
        while True:
            if self.done:
                raise StopAsyncIteration
            delta = self._pending
            if delta is not None:
                self._pending = None
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
        self._items: dict[RequestStream, RequestOutput] = {}
        self._scheduled = False

    def post(self, items: list[tuple[RequestStream, RequestOutput]]) -> list[RequestStream]:
        """Queue items for their streams (called on the output thread). Returns the streams whose
        items could not be handed over because the loop is closed (their readers are gone)."""
        with self._lock:
            for stream, out in items:
                old = self._items.get(stream)
                self._items[stream] = out if old is None else _merge(old, out)
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
        for stream, out in items.items():
            stream._push(out)


def _merge(older: RequestOutput, newer: RequestOutput) -> RequestOutput:
    """Two consecutive deltas of one request as one: per choice, text, tokens and logprob entries
    concatenated; everything else from the newer one."""
    choices = {c.index: c for c in older.outputs}
    for c in newer.outputs:
        old = choices.get(c.index)
        if old is None:
            choices[c.index] = c
            continue
        choices[c.index] = dataclasses.replace(
            c, text=old.text + c.text, token_ids=old.token_ids + c.token_ids,
            logprobs=None if c.logprobs is None else (old.logprobs or []) + c.logprobs)
    return dataclasses.replace(newer, outputs=[choices[i] for i in sorted(choices)])
