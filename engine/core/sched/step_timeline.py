"""The step timeline: one JSON line per engine step, to find where slow steps come from.

Opt-in (the step_timeline setting names the file; off, nothing here runs and the core pays one
`is None` test per step). The step thread records what a step did and how long its parts took;
the server's output thread adds when it handed the step's outputs to the event loops, and the
event loop when it got to them; Python's collector reports its pauses through `gc.callbacks`.
A line is written once RECORD_LAG_STEPS newer steps have ended (the output side has filled its
part by then; fields it never filled stay null), and every line still held on `close`.
`kiln bench timeline FILE` (engine/bench/timeline_report.py) names the causes of the slow ones.

Fields of a line (times in ms, `t` in s since the timeline opened):
  step            the step's number (0, 1, ...)
  t               when the step began
  kind            "decode" (no prefill tokens), "prefill" (no decodes), "mixed", or "idle" (nothing ran)
  prefill_tokens  prompt tokens computed (chunked-prefill pieces included)
  decode_seqs     sequences that decoded (one token each; with drafts, their tokens)
  prefill_seqs    sequences with prefill tokens in the step (the pieces)
  chunked_seqs    of those, pieces that did not reach their prompt's end (chunked prefill)
  gap_ms          since the previous step ended: the step thread's loop (inbox, hand-off, waits)
  schedule_ms     the scheduler's schedule()
  model_ms        launch to the sampled tokens on the host: the forward and sampling
  update_ms       the core's pass over the tokens (stops, grammars, freed blocks)
  interval_ms     previous step's end to this one's: the inter-token gap its decodes saw at the engine
  gc_ms           Python collector pauses within that interval (any thread), and gc_collections,
  gc_collections  gc_max_gen: how many, the oldest generation collected (-1: none)
  gc_max_gen
  output_ms       step end to its outputs handed to the event loops (the output thread); null offline
  loop_ms         handed to the event loop to the loop running it (its wake-up and backlog); null offline
With overlap scheduling (GPU) a step() launches one step and processes the previous one: its
line then holds this launch's token counts and the previous step's model and update times.
"""

from __future__ import annotations

import atexit
import gc
import json
import threading
import time
from collections import OrderedDict
from pathlib import Path
from typing import Any, Callable

# A line is written once this many newer steps ended (the output thread is at most
# MAX_PENDING_STEPS (64) steps behind the step thread; the event loop a little more).
RECORD_LAG_STEPS = 128

FIELDS = (
    "step",
    "t",
    "kind",
    "prefill_tokens",
    "decode_seqs",
    "prefill_seqs",
    "chunked_seqs",
    "gap_ms",
    "schedule_ms",
    "model_ms",
    "update_ms",
    "interval_ms",
    "gc_ms",
    "gc_collections",
    "gc_max_gen",
    "output_ms",
    "loop_ms",
)


def _ms(seconds: float) -> float:
    return round(seconds * 1e3, 3)


class StepTimeline:
    """Collects the step records and writes them as JSON lines; see the module docstring.

    The step thread calls begin / scheduled / processed / end in each step; the output thread
    calls delivered. `clock` is injectable for tests (seconds, monotonic)."""

    def __init__(self, path: Path | str, clock: Callable[[], float] = time.perf_counter) -> None:
        self.path = Path(path)
        self._file = open(self.path, "w", encoding="utf-8")  # noqa: SIM115 - held open until close()
        self._clock = clock
        self._t0 = clock()
        self._lock = threading.Lock()  # the file and the held records (close may race the last step)
        self._held: OrderedDict[int, dict[str, Any]] = OrderedDict()
        self._step = -1
        self.last_step: int | None = None  # the newest ended step (the async engine hands it on)
        self._last_end: float | None = None
        self._begin = self._sched = 0.0
        self._record: dict[str, Any] = {}
        # The collector's pauses since the last step ended (written by whichever thread collects).
        self._gc_start: float | None = None
        self._gc_ms = 0.0
        self._gc_n = 0
        self._gc_gen = -1
        self._closed = False
        gc.callbacks.append(self._on_gc)
        atexit.register(self.close)

    # ---- the collector ----
    def _on_gc(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._gc_start = self._clock()
        elif self._gc_start is not None:
            self._gc_ms += (self._clock() - self._gc_start) * 1e3
            self._gc_n += 1
            self._gc_gen = max(self._gc_gen, int(info.get("generation", 0)))
            self._gc_start = None

    # ---- the step thread ----
    def begin(self) -> None:
        self._begin = self._clock()
        self._step += 1
        self._record = {"model_ms": 0.0, "update_ms": 0.0}

    def scheduled(self, sched: Any) -> None:
        """After schedule(): the step's token counts (a SchedulerOutput)."""
        self._sched = self._clock()
        prefill_seqs = chunked = 0
        for s in sched.seqs:
            if s.start_pos < s.num_prompt_tokens:
                prefill_seqs += 1
                chunked += not s.do_sample
        prefill, decode = sched.num_prefill_tokens, sched.num_decode_tokens
        kind = "idle" if not sched.seqs else "decode" if not prefill else "prefill" if not decode else "mixed"
        self._record.update(
            kind=kind,
            prefill_tokens=prefill,
            decode_seqs=decode,
            prefill_seqs=prefill_seqs,
            chunked_seqs=chunked,
            schedule_ms=_ms(self._sched - self._begin),
        )

    def processed(self, launched_at: float, result_at: float, done_at: float) -> None:
        """A step's results were processed: launch -> sampled tokens -> update done (clock times)."""
        self._record["model_ms"] += _ms(result_at - launched_at)
        self._record["update_ms"] += _ms(done_at - result_at)

    def end(self) -> int:
        """The step is over: its line is complete but for the output side's part. Its number."""
        now = self._clock()
        rec = self._record
        step = self._step
        last = self._last_end
        rec["step"] = step
        rec["t"] = round(self._begin - self._t0, 6)
        rec["gap_ms"] = _ms(self._begin - last) if last is not None else None
        rec["interval_ms"] = _ms(now - last) if last is not None else None
        rec["gc_ms"], rec["gc_collections"], rec["gc_max_gen"] = round(self._gc_ms, 3), self._gc_n, self._gc_gen
        self._gc_ms, self._gc_n, self._gc_gen = 0.0, 0, -1
        rec.setdefault("output_ms", None)
        rec.setdefault("loop_ms", None)
        rec["_end"] = now
        self._last_end = now
        with self._lock:
            if not self._closed:
                self._held[step] = rec
                self._write_due(step - RECORD_LAG_STEPS)
        self.last_step = step
        return step

    # ---- the output thread and the event loops ----
    def delivered(self, step: int, loops: list[Any]) -> None:
        """The step's outputs were handed to these event loops (the output thread calls this)."""
        rec = self._held.get(step)
        if rec is None:
            return
        now = self._clock()
        rec["output_ms"] = _ms(now - rec["_end"])
        for loop in loops:
            try:
                loop.call_soon_threadsafe(self._reached, rec, now)
            except RuntimeError:
                pass  # (a closed loop)

    def _reached(self, rec: dict[str, Any], posted: float) -> None:
        delay = _ms(self._clock() - posted)
        if rec.get("loop_ms") is None or delay > rec["loop_ms"]:
            rec["loop_ms"] = delay

    # ---- the file ----
    def _write_due(self, upto: int) -> None:
        wrote = False
        while self._held:
            step = next(iter(self._held))
            if step > upto:
                break
            rec = self._held.pop(step)
            rec.pop("_end", None)
            self._file.write(json.dumps({k: rec.get(k) for k in FIELDS}) + "\n")
            wrote = True
        if wrote:
            self._file.flush()

    def close(self) -> None:
        """Write every line still held and stop listening to the collector (idempotent)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._write_due(self._step)
            self._file.close()
        if self._on_gc in gc.callbacks:
            gc.callbacks.remove(self._on_gc)
        atexit.unregister(self.close)
