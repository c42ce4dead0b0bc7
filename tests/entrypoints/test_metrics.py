"""EngineMetrics against a real engine under KV pressure: preemptions by mode, swap bytes."""

from __future__ import annotations

import time

from engine import SamplingParams
from engine.entrypoints.openai.metrics import EngineMetrics
from tests.support.engine import assert_engine_clean
from tests.support.metrics import _samples


def test_preemption_and_swap_metrics_follow_the_engine(make_llm):
    llm = make_llm(
        num_gpu_blocks=14, block_size=8, max_num_seqs=6, max_model_len=96, preemption_mode="swap", swap_space_gb=0.01
    )
    engine = llm.engine
    metrics = EngineMetrics("tiny", log_stats_interval=0)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    for i in range(6):
        engine.add_request(list(range(10 + i, 40 + i)), params, f"r{i}")
    while engine.core.has_unfinished_requests():
        outs = engine.step()
        metrics.on_step(engine, outs, time.monotonic())
        engine.core.check_integrity()
    assert_engine_clean(engine)
    m = _samples(metrics)
    swaps = m[("kiln:num_preemptions_total", (("mode", "swap"),))]
    assert swaps == engine.core.scheduler.preemptions_by_mode["swap"] > 0
    assert (
        m[("kiln:num_preemptions_total", (("mode", "recompute"),))]
        == engine.core.scheduler.preemptions_by_mode["recompute"]
    )
    assert m[("kiln:swap_out_bytes_total", ())] == engine.core.block_swapper.bytes_out > 0
    assert m[("kiln:swap_in_bytes_total", ())] == engine.core.block_swapper.bytes_in > 0
    assert m[("kiln:request_success_total", (("finished_reason", "length"),))] == 6
    assert m[("kiln:num_requests_swapped", ())] == 0
