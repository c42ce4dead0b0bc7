"""The step timeline (engine/core/sched/step_timeline.py): the documented fields, from a fake
clock; a collector pause lands in its step; a served engine writes one line per step with the
output side's delays filled in (tests/runtime/test_served_timeline.py); and `kiln bench timeline`
names the cause of a slow step."""

from __future__ import annotations

import gc
import json
from types import SimpleNamespace

from engine.bench.timeline_report import analyse
from engine.core.sched.step_timeline import FIELDS, StepTimeline


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now

    def tick(self, ms: float) -> None:
        self.now += ms / 1e3


def _sched(prefill: int, decodes: int, chunked: bool = False):
    seqs = [SimpleNamespace(start_pos=10, num_prompt_tokens=10, do_sample=True) for _ in range(decodes)]
    if prefill:
        seqs.append(SimpleNamespace(start_pos=0, num_prompt_tokens=prefill + 5 * chunked, do_sample=not chunked))
    return SimpleNamespace(seqs=seqs, num_prefill_tokens=prefill, num_decode_tokens=decodes)


def _step(tl: StepTimeline, clock: FakeClock, prefill: int, decodes: int, model_ms: float, chunked: bool = False):
    clock.tick(1.0)  # the loop between steps
    tl.begin()
    clock.tick(0.5)
    tl.scheduled(_sched(prefill, decodes, chunked))
    launched = clock()
    clock.tick(model_ms)
    result = clock()
    clock.tick(0.25)
    tl.processed(launched, result, clock())
    return tl.end()


def _lines(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_lines_hold_the_documented_fields(tmp_path):
    clock = FakeClock()
    tl = StepTimeline(tmp_path / "steps.jsonl", clock=clock)
    _step(tl, clock, prefill=64, decodes=0, model_ms=30.0)
    step = _step(tl, clock, prefill=0, decodes=4, model_ms=10.0)
    tl.delivered(step, [])
    _step(tl, clock, prefill=32, decodes=4, model_ms=25.0, chunked=True)
    tl.close()
    tl.close()  # (idempotent)
    lines = _lines(tmp_path / "steps.jsonl")
    assert [list(line) for line in lines] == [list(FIELDS)] * 3
    first, decode, mixed = lines
    assert first["kind"] == "prefill" and first["gap_ms"] is None and first["interval_ms"] is None
    assert decode == {
        **decode,
        "step": 1,
        "kind": "decode",
        "prefill_tokens": 0,
        "decode_seqs": 4,
        "prefill_seqs": 0,
        "gap_ms": 1.0,
        "schedule_ms": 0.5,
        "model_ms": 10.0,
        "update_ms": 0.25,
        "interval_ms": 11.75,
        "output_ms": 0.0,
        "loop_ms": None,  # (no event loop was handed the step)
    }
    assert mixed["kind"] == "mixed" and mixed["prefill_seqs"] == 1 and mixed["chunked_seqs"] == 1
    assert mixed["output_ms"] is None  # offline: no output thread


def test_a_collector_pause_lands_in_its_step(tmp_path):
    tl = StepTimeline(tmp_path / "steps.jsonl")
    tl.begin()
    tl.scheduled(_sched(0, 2))
    gc.collect()
    tl.end()
    tl.close()
    (line,) = _lines(tmp_path / "steps.jsonl")
    assert line["gc_collections"] >= 1 and line["gc_max_gen"] == 2 and line["gc_ms"] >= 0.0
    assert tl._on_gc not in gc.callbacks


def test_the_report_blames_the_prefill_chunk(tmp_path):
    clock = FakeClock()
    tl = StepTimeline(tmp_path / "steps.jsonl", clock=clock)
    for k in range(60):
        _step(tl, clock, prefill=256 if k % 20 == 10 else 0, decodes=8, model_ms=60.0 if k % 20 == 10 else 10.0)
    tl.close()
    report = analyse(_lines(tmp_path / "steps.jsonl"), top=5.0)
    assert report["decode_steps"] == 58  # (the first two have no earlier delivery to measure from)
    assert set(report["causes"]) == {"prefill chunk"}
    assert report["gap_ms"]["median"] == 11.75
