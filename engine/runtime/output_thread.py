"""The AsyncEngine's output side: the thread that turns the core's updates into outputs.

The step thread hands it items through a bounded queue (engine/runtime/async_engine.py):
("add", admitted request, stream) | ("out", updates, timeline step or None) | ("die", error,
updates). For each step it runs the OutputProcessor (detokenisation, stop strings,
RequestOutputs), feeds the listener, and hands each stream the newest cumulative output through
its event loop's mailbox. What the output side ended goes back to the step thread through
`to_core` (a stop string finishes that sample; an output that could not be built, or a stream
whose loop is closed, aborts the request).

Apart from the step thread because detokenising and stop-string matching are Python work per
token that need not hold the next forward back.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import time
from typing import Any, Callable

from engine.core.outputs import RequestOutput, RequestUpdate
from engine.runtime.admission import AdmittedRequest
from engine.runtime.inbox import AbortRequest, FinishSequence, StepListener
from engine.runtime.llm_engine import LLMEngine
from engine.runtime.output_gate import OutputGate
from engine.runtime.output_processor import OutputProcessor
from engine.runtime.request_stream import LoopMailbox, RequestStream

logger = logging.getLogger(__name__)


def post(stream: RequestStream, fn: Callable, arg: Any) -> None:
    """Run fn(arg) on the stream's event loop (nothing, when that loop is closed)."""
    try:
        stream.loop.call_soon_threadsafe(fn, arg)
    except RuntimeError:
        pass  # loop closed


class OutputThread:
    """State owned by the output thread: the streams being served, one mailbox per event loop,
    and the OutputProcessor. `run` is the thread's body."""

    def __init__(
        self,
        engine: LLMEngine,
        listener: StepListener | None,
        outbox: queue.Queue,
        gate: OutputGate,
        to_core: Callable[[list[AbortRequest | FinishSequence]], None],
    ) -> None:
        self.engine = engine
        self.listener = listener
        self.outbox = outbox
        self.gate = gate
        self.to_core = to_core
        self.streams: dict[str, RequestStream] = {}
        self.mailboxes: dict[asyncio.AbstractEventLoop, LoopMailbox] = {}
        self.outputs = OutputProcessor(engine.tokenizer)

    def run(self) -> None:
        """Updates -> RequestOutputs (text, stop strings) -> listener and streams, off the step thread."""
        while True:
            kind, *args = self.outbox.get()
            if kind == "add":
                self.add(*args)
                continue
            if kind == "die":
                err, updates = args
                self.notify_stopped(self.process(updates))
                self.fail_streams(err)
                return
            updates, timeline_step = args
            outputs = self.process(updates)
            if self.listener is not None:
                try:
                    self.listener.on_step(self.engine, outputs, time.monotonic())
                except Exception:  # noqa: BLE001 - metrics must not stop the outputs
                    logger.exception("step listener failed")
            try:
                self.dispatch(outputs)
            except Exception:  # noqa: BLE001 - this thread must keep serving the other streams
                logger.exception("handing out outputs failed")
            timeline = self.engine.core.timeline
            if timeline is not None and timeline_step is not None and outputs:
                timeline.delivered(timeline_step, list(self.mailboxes))
            self.gate.delivered(list(self.mailboxes) if outputs else [])

    def add(self, admitted: AdmittedRequest, stream: RequestStream) -> None:
        self.outputs.add(admitted)
        self.streams[admitted.request_id] = stream

    def process(self, updates: list[RequestUpdate]) -> list[RequestOutput]:
        """The outputs of a batch of updates; what the output side ended goes back to the core."""
        processed = self.outputs.process(updates)
        if processed.stopped or processed.failed:
            ended: list[AbortRequest | FinishSequence] = [
                FinishSequence(request_id, index, stop) for request_id, index, stop in processed.stopped
            ]
            ended += [AbortRequest(request_id) for request_id in processed.failed]
            self.to_core(ended)
        return processed.outputs

    def dispatch(self, outputs: list[RequestOutput]) -> None:
        """Each stream's newest output, one delivery per event loop."""
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[RequestStream, RequestOutput]]] = {}
        for out in outputs:
            stream = self.streams.get(out.request_id)
            if stream is None:
                continue
            if out.finished:
                del self.streams[out.request_id]
            items = by_loop.get(stream.loop)
            if items is None:  # (not setdefault: that would build a list per output)
                items = by_loop[stream.loop] = []
            items.append((stream, out))
        for loop, items in by_loop.items():
            mailbox = self.mailboxes.get(loop)
            if mailbox is None:
                mailbox = self.mailboxes[loop] = LoopMailbox(loop)
            lost = mailbox.post(items)
            if lost:  # that loop is closed: its readers are gone
                del self.mailboxes[loop]
                self.to_core([AbortRequest(stream.request_id) for stream in lost])

    def fail_streams(self, err: BaseException) -> None:
        for stream in list(self.streams.values()):
            post(stream, stream._fail, err)
        self.streams.clear()

    def notify_stopped(self, failed: list[RequestOutput]) -> None:
        """Last word to the listener: the failed requests, and that nothing runs any more (the
        metrics' gauges go to zero even when the engine is too broken to report)."""
        if self.listener is None:
            return
        try:
            self.listener.on_step(self.engine, failed, time.monotonic())
        except Exception:  # noqa: BLE001 - a broken engine may not report; the gauges still reset
            logger.debug("listener could not read the stopped engine", exc_info=True)
        stopped = getattr(self.listener, "on_engine_stopped", None)
        if stopped is not None:
            stopped()
