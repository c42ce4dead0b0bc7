"""AsyncEngine: the step loop behind the server.

Two background threads: the step thread owns the LLMEngine's EngineCore and runs its step
(`engine.core.step()`: schedule, launch, the core's one pass over each step's tokens) back to back
while there is work (model steps are blocking torch calls, so they must not run on the event
loop); the output thread turns the core's updates into outputs. Everything else talks to the
step thread through a thread-safe inbox (add / abort / finish a sample), which it drains at the
top of every iteration; when idle it sleeps on an event.

Each request gets a `RequestStream` bound to the asyncio loop that created it. The output
thread hands it the newest cumulative `RequestOutput` through that loop's mailbox; the stream
keeps only the newest snapshot, so a slow reader never makes the step loop wait and never piles
up memory: it reads the coalesced difference (a delta) when it gets to it.

Requests come in admitted (engine/runtime/admission.py: the server admits them itself, step by
step; `add_request` runs every step). The step thread runs the engine core
(engine/runtime/engine_core.py: the core's one pass over each step's tokens, in token ids) and
hands the RequestUpdates to an output thread (engine/runtime/output_thread.py), which runs the same
OutputProcessor as the offline path (engine/runtime/output_processor.py: detokenisation, stop
strings, RequestOutputs), feeds the listener and the streams. What the
output side ended goes back to the step thread through the inbox: a stop string
(`FinishSequence`) finishes that sample in the core and frees its blocks; a request whose
output could not be built is aborted.

If the step thread dies, the engine is marked dead and every pending stream fails with
`EngineDeadError`.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import queue
import threading
import time
from typing import Any, AsyncIterator, Callable

from engine.core import admission_rules as rules
from engine.core.admission_rules import InvalidRequestError
from engine.core.outputs import RequestOutput, RequestUpdate
from engine.core.params import LoRARequest, PoolingParams, SamplingParams
from engine.runtime.admission import AdmittedRequest
from engine.runtime.engine_info import EngineInfo, EngineStatus
from engine.runtime.errors import EngineDeadError, QueueFullError
from engine.runtime.inbox import (
    AbortRequest,
    AddRequest,
    EngineCall,
    FinishSequence,
    PauseRequest,
    StepListener,
    settle_call,
)
from engine.runtime.llm_engine import LLMEngine
from engine.runtime.output_gate import OutputGate
from engine.runtime.output_thread import OutputThread, post
from engine.runtime.request_stream import RequestStream
from engine.worker.cpu_threads import release_openmp_team

logger = logging.getLogger(__name__)

# Back-pressure, nothing dropped: the step thread hands each step's outputs to the output thread
# through a queue of at most this many steps. When the output thread (detokenisation, stop
# strings, the listener) falls that far behind, the step thread waits for room before it steps
# again, so a slow consumer slows generation down instead of growing memory without limit. Past
# the output thread, each event loop gets one delivery callback at a time (LoopMailbox) and each
# stream merges what its reader has not read yet: a slow reader holds its unread text, not a
# queue of steps.
MAX_PENDING_STEPS = 64


# A step that could run nothing (its requests paused by back-pressure) is retried after this
# long, or at once when the inbox wakes the loop (a reader caught up, a request came).
STALLED_POLL_S = 0.05

# After a tensor-parallel worker died, how long the step thread gets to fail on its own.
WORKER_DEATH_GRACE_S = 2.0


class AsyncEngine:
    """Runs an LLMEngine in a background step thread; see the module docstring."""

    def __init__(
        self,
        engine: LLMEngine,
        listener: StepListener | None = None,
        max_waiting_requests: int | None = None,
        idle_poll_s: float = 1.0,
        max_pending_steps: int = MAX_PENDING_STEPS,
        stream_stall_timeout_s: float | None = None,
        stream_pause_tokens: int | None = None,
    ) -> None:
        self.engine = engine
        self.listener = listener
        # A stream whose reader takes nothing this long is aborted (RequestStream); None: never.
        self.stream_stall_timeout_s = stream_stall_timeout_s
        # A stream with this many tokens unread pauses its request until it is read; None: never.
        self.stream_pause_tokens = stream_pause_tokens
        self.max_waiting_requests = (
            max_waiting_requests if max_waiting_requests is not None else engine.settings.max_waiting_requests
        )
        self._idle_poll_s = idle_poll_s
        self._inbox: collections.deque[AddRequest | AbortRequest | PauseRequest | FinishSequence | EngineCall] = (
            collections.deque()
        )
        self._wake = threading.Event()
        # step thread -> output thread: ("add", admitted request, stream) | ("out", updates, timeline step
        # or None) | ("die", error, updates);
        # bounded (MAX_PENDING_STEPS): a full queue makes the step thread wait (_send)
        if max_pending_steps < 1:
            raise ValueError(f"max_pending_steps must be at least 1, got {max_pending_steps}")
        self._outbox: queue.Queue = queue.Queue(maxsize=max_pending_steps)
        self.backpressure_waits = 0  # times the step thread waited for the output thread
        self.backpressure_seconds = 0.0
        self.admission = engine.admission  # (read-only: the API side admits requests with it)
        self._gate = OutputGate(engine.settings.step_waits_for_outputs)  # (off: no-op calls)
        # (its state - streams, mailboxes, the OutputProcessor - is owned by the output thread)
        self._output_side = OutputThread(engine, listener, self._outbox, self._gate, self._to_core)
        self._output_thread: threading.Thread | None = None
        self._lock = threading.Lock()  # guards _pending_adds and dead-state transitions
        self._pending_adds = 0
        self._stop = False
        self._dead: BaseException | None = None
        self.crashed = False  # the loop died of an error (not a shutdown)
        self._thread: threading.Thread | None = None
        self.info = EngineInfo.of(engine)
        # Tensor parallelism: a dead worker rank is fatal (the process should exit; serve() does).
        self.fatal: str | None = None
        executor = engine.core.executor
        if executor is not None:
            executor.on_death(self._worker_died)

    # ---- lifecycle ----
    def start(self) -> "AsyncEngine":
        if self._thread is None:
            # The step thread is to be the process's one OpenMP user: a team left on this thread (it
            # built the engine) would make libgomp cut every idle thread's spin (cpu_threads).
            release_openmp_team()
            self._output_thread = threading.Thread(target=self._output_side.run, name="kiln-outputs", daemon=True)
            self._output_thread.start()
            self._thread = threading.Thread(target=self._run, name="kiln-step-loop", daemon=True)
            self._thread.start()
        return self

    def shutdown(self, timeout: float = 10.0) -> None:
        self._stop = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout)
        if self._output_thread is not None:
            self._output_thread.join(timeout)
        if self._thread is None or not self._thread.is_alive():  # (the step thread no longer touches the pool)
            self.engine.core.close()
        executor = self.engine.core.executor
        if executor is not None:
            executor.shutdown()

    @property
    def is_alive(self) -> bool:
        return (
            self._dead is None
            and self.fatal is None
            and self._thread is not None
            and self._thread.is_alive()
            and not self._stop
        )

    @property
    def dead_error(self) -> BaseException | None:
        return self._dead

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    # ---- the API side's public face (the server never reaches into LLMEngine) ----
    @property
    def grammar_compiler(self):
        """The engine's StructuredOutputCompiler (thread-safe; its cache is the engine's)."""
        return self.engine.structured_output

    def lora_adapters(self) -> list[LoRARequest]:
        """The adapters loaded now (a copy: safe to read from the event loop)."""
        lora = self.engine.core.lora
        return list(lora.adapters) if lora is not None else []

    def find_lora(self, name: str) -> LoRARequest | None:
        return next((a for a in self.lora_adapters() if a.lora_name == name), None)

    async def load_lora(self, name: str, path: str) -> LoRARequest:
        """Load an adapter between two steps (never under a running step)."""
        return await self.run_in_engine(lambda e: e.core.load_lora(name, path))

    async def unload_lora(self, name: str) -> None:
        await self.run_in_engine(lambda e: e.core.unload_lora(name))

    def num_waiting(self) -> int:
        """Requests queued but not yet running (including those still in the inbox, and those
        waiting for a KV tier load)."""
        tiers = self.engine.core.kv_tiers
        loading = tiers.num_loading if tiers is not None else 0
        return len(self.engine.core.scheduler.waiting) + self._pending_adds + loading

    # ---- requests ----
    async def add_request(
        self,
        prompt: str | list[int],
        params: SamplingParams,
        request_id: str | None = None,
        priority: int = 0,
        arrival_time: float | None = None,
        lora_request: LoRARequest | None = None,
        pooling: PoolingParams | None = None,
    ) -> RequestStream:
        """Admit a request (every admission step, here: engine/runtime/admission.py) and submit it.

        Raises InvalidRequestError (bad parameters, prompt too long), QueueFullError, EngineDeadError.
        """
        admitted = await self.admission.admit_async(
            prompt, params, request_id, priority, lora_request, pooling, arrival_time=arrival_time
        )
        return await self.submit(admitted)

    async def submit(self, admitted: AdmittedRequest) -> RequestStream:
        """Queue an admitted request; returns its stream once the step loop accepted it.

        Raises InvalidRequestError (its id is in use, or a new adapter's files do not load),
        QueueFullError, EngineDeadError.
        """
        if admitted.params.output_kind != "delta":  # streams hand out deltas (RequestStream)
            admitted.params = admitted.params.clone(output_kind="delta")
        self._raise_if_dead()
        # (the ids in use: the streams being served; two submits racing with one id fail the second in the scheduler)
        rules.request_id_free(admitted.request_id, self._output_side.streams)
        if self.num_waiting() >= self.max_waiting_requests:
            raise QueueFullError(
                f"the server is at capacity: {self.num_waiting()} requests waiting "
                f"(max_waiting_requests={self.max_waiting_requests}); retry later"
            )
        loop = asyncio.get_running_loop()
        stream = RequestStream(
            admitted.request_id,
            loop,
            on_close=self.abort,
            stall_timeout_s=self.stream_stall_timeout_s,
            on_pause=self.pause,
            pause_tokens=self.stream_pause_tokens,
        )
        with self._lock:
            self._pending_adds += 1
        self._inbox.append(AddRequest(admitted, stream))
        self._wake.set()
        if self._dead is not None:  # died between the check and the append: nobody will answer
            self._fail_inbox()
        try:
            await asyncio.shield(stream.accepted)
        except asyncio.CancelledError:
            stream.close()
            raise
        return stream

    async def generate(
        self, prompt: str | list[int], params: SamplingParams, request_id: str | None = None, priority: int = 0
    ) -> AsyncIterator[RequestOutput]:
        """Add a request and yield its deltas; closing the generator early aborts the request."""
        stream = await self.add_request(prompt, params, request_id, priority)
        try:
            async for delta in stream:
                yield delta
        finally:
            stream.close()

    async def run_in_engine(self, fn: Callable[[LLMEngine], Any]) -> Any:
        """fn(engine) on the step thread between two steps (where changing the engine is safe,
        e.g. loading a LoRA adapter); returns its result or raises its exception."""
        self._raise_if_dead()
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self._inbox.append(EngineCall(fn, future, loop))
        self._wake.set()
        if self._dead is not None:
            self._fail_inbox()
        return await future

    def abort(self, request_id: str) -> None:
        """Stop a request; its blocks are freed at the top of the next step. Thread-safe."""
        if self._dead is not None:
            return
        self._inbox.append(AbortRequest(request_id))
        self._wake.set()

    def pause(self, request_id: str, paused: bool) -> None:
        """Pause a request whose reader is behind, or resume it (its blocks stay). Thread-safe."""
        if self._dead is not None:
            return
        self._inbox.append(PauseRequest(request_id, paused))
        self._wake.set()

    def status(self) -> EngineStatus:
        e = self.engine.core
        sched = e.scheduler
        return EngineStatus(
            alive=self.is_alive,
            error=repr(self._dead) if self._dead else None,
            num_running=len(sched.running),
            num_waiting=len(sched.waiting) + self._pending_adds,
            num_swapped=len(getattr(sched, "swapped", ()) or ()),
            num_blocks_in_use=e.pool.num_in_use,
            kv_usage=e.pool.usage(),
        )

    def _raise_if_dead(self) -> None:
        if self._dead is not None:
            raise EngineDeadError(f"the engine loop has stopped: {self._dead!r}")
        if self._stop:
            raise EngineDeadError("the engine is shutting down")
        if self._thread is None:
            raise EngineDeadError("the engine loop was never started")

    # ---- the step thread ----
    def _run(self) -> None:
        core = self.engine.core
        try:
            while not self._stop:
                if self.fatal is not None:
                    raise EngineDeadError(self.fatal)
                self._wake.clear()
                updates = self._drain_inbox()
                busy = core.has_unfinished_requests()
                if busy:
                    updates.extend(core.step())
                # (also idle: the listener ticks about once a second); the step's number for the timeline
                timeline = core.timeline
                self._gate.before_send()
                self._send(("out", updates, timeline.last_step if busy and timeline is not None else None))
                if busy:  # (step_waits_for_outputs: the hand-out runs between the steps, engine/runtime/output_gate.py)
                    self._gate.wait(lambda: self._output_thread is not None and self._output_thread.is_alive())
                if not self._inbox:
                    if not busy:
                        self._wake.wait(self._idle_poll_s)
                    elif core.stalled:  # (every running request paused, say): not a busy loop
                        self._wake.wait(STALLED_POLL_S)
        except BaseException as exc:  # noqa: BLE001 - anything that stops the loop kills the engine
            logger.exception("engine step loop died")
            self.crashed = True
            if core.executor is not None and self.fatal is None:
                # A step that failed part-way leaves the tensor-parallel ranks out of step: fatal.
                self.fatal = f"the engine loop died with tensor parallelism: {exc!r}"
            self._die(exc)
            return
        self._die(EngineDeadError("the engine was shut down"), log=False)

    def _worker_died(self, reason: str) -> None:
        """(watchdog thread) A tensor-parallel worker exited: the step thread fails at its next
        collective or loop turn; should it be stuck, the engine is declared dead from here."""
        self.fatal = reason
        self._wake.set()

        def backstop() -> None:
            if self._dead is None:
                logger.error("the step loop did not stop after the worker died: failing its requests")
                self.crashed = True
                self._die(EngineDeadError(reason))

        timer = threading.Timer(WORKER_DEATH_GRACE_S, backstop)
        timer.daemon = True
        timer.start()

    def _to_core(self, items: list[AbortRequest | FinishSequence]) -> None:
        """(output thread) What the output side ended, back to the step thread."""
        self._inbox.extend(items)
        self._wake.set()

    def _drain_inbox(self) -> list[RequestUpdate]:
        """Apply queued adds and aborts; returns the last updates of aborted requests."""
        engine = self.engine
        core = engine.core
        aborted: list[RequestUpdate] = []
        while self._inbox:
            item = self._inbox.popleft()
            if isinstance(item, EngineCall):
                try:
                    result, error = item.fn(engine), None
                except Exception as exc:  # noqa: BLE001 - handed to the caller
                    result, error = None, exc
                settle_call(item, result, error)
                continue
            if isinstance(item, AbortRequest):
                update = core.abort(item.request_id)
                if update is not None:
                    aborted.append(update)
                continue
            if isinstance(item, PauseRequest):
                core.scheduler.set_paused(item.request_id, item.paused)
                continue
            if isinstance(item, FinishSequence):
                core.finish_by_text(item.request_id, item.index, item.stop)
                continue
            with self._lock:
                self._pending_adds -= 1
            stream = item.stream
            if stream.closed:  # the reader gave up before we got here
                post(stream, stream._accept, EngineDeadError("request cancelled"))
                continue
            admitted = item.admitted
            try:
                core.add_admitted(admitted)
            except InvalidRequestError as exc:
                post(stream, stream._accept, exc)
                continue
            except Exception as exc:  # noqa: BLE001 - one bad request must not stop the loop
                logger.exception("add_request failed for %s", admitted.request_id)
                post(stream, stream._accept, InvalidRequestError(f"could not add the request: {exc}"))
                continue
            self._send(("add", admitted, stream))
            post(stream, stream._accept, None)
        return aborted

    def _die(self, exc: BaseException, log: bool = True) -> None:
        with self._lock:
            if self._dead is None:
                self._dead = (
                    exc if isinstance(exc, EngineDeadError) else EngineDeadError(f"the engine loop died: {exc!r}")
                )
        err = self._dead
        failed: list[RequestUpdate] = []
        try:  # release every request's blocks so the pool's accounting stays whole
            failed = self.engine.core.fail_all(str(err)) or []
        except Exception:  # noqa: BLE001 - the engine is already broken; streams must still fail
            logger.exception("could not fail the engine's requests cleanly")
        # The output thread gives the listener its last word, then fails the streams it holds.
        try:
            self._send(("die", err, failed))
        except RuntimeError:  # (the output thread is gone: no stream can be reached any more)
            logger.error("the output thread is gone; its streams cannot be failed")
        self._fail_inbox()

    def _send(self, item: tuple) -> None:
        """Hand an item to the output thread, waiting while its queue is full (back-pressure)."""
        try:
            self._outbox.put_nowait(item)
            return
        except queue.Full:
            pass
        t0 = time.monotonic()
        while True:
            try:
                self._outbox.put(item, timeout=0.1)
                break
            except queue.Full:
                if self._output_thread is None or not self._output_thread.is_alive():
                    raise RuntimeError("the output thread is gone: outputs cannot be handed out") from None
        self.backpressure_waits += 1
        self.backpressure_seconds += time.monotonic() - t0

    def _fail_inbox(self) -> None:
        err = self._dead
        while True:
            try:
                item = self._inbox.popleft()
            except IndexError:
                break
            if isinstance(item, AddRequest):
                with self._lock:
                    self._pending_adds -= 1
                post(item.stream, item.stream._fail, err)
            elif isinstance(item, EngineCall):
                settle_call(item, None, err)
