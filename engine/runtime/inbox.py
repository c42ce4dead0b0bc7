"""What the step thread's inbox carries (engine/runtime/async_engine.py): admitted requests to add,
requests to abort, stop strings the output thread found, calls to run between steps; and the listener hook AsyncEngine's
callers give it. (The errors its callers see are in engine/runtime/errors.py.)"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Protocol

from engine.core.outputs import RequestOutput

if TYPE_CHECKING:
    from engine.runtime.admission import AdmittedRequest
    from engine.runtime.llm_engine import LLMEngine
    from engine.runtime.request_stream import RequestStream


class StepListener(Protocol):
    """Called from the step thread: metrics and stats logging hook in here."""

    def on_step(self, engine: LLMEngine, outputs: list[RequestOutput], now: float) -> None:
        """After every loop iteration (also idle ones, about once a second): `outputs` are the
        requests that advanced or were aborted in it."""


@dataclass
class AddRequest:
    admitted: "AdmittedRequest"
    stream: "RequestStream"


@dataclass
class AbortRequest:
    request_id: str


@dataclass
class PauseRequest:
    """A stream's reader fell behind (paused) or caught up: pause or resume its request."""

    request_id: str
    paused: bool


@dataclass
class FinishSequence:
    """The output thread found a stop string: finish that sequence in the engine."""

    request_id: str
    index: int
    stop: int | str | None


@dataclass
class EngineCall:
    """Run fn(engine) on the step thread, between steps; the result goes to `future`."""

    fn: Callable[[LLMEngine], Any]
    future: asyncio.Future
    loop: asyncio.AbstractEventLoop


def settle_call(call: EngineCall, result: Any, error: BaseException | None) -> None:
    """Hand a EngineCall's outcome to its caller's loop (nothing if the caller gave up or the loop closed)."""

    def done() -> None:
        if not call.future.done():
            if error is not None:
                call.future.set_exception(error)
            else:
                call.future.set_result(result)

    try:
        call.loop.call_soon_threadsafe(done)
    except RuntimeError:
        pass
