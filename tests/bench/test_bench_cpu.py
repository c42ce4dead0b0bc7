"""`kiln bench cpu` on the tiny model: every setting with and without the neighbour, ratios, and
the neighbour is gone afterwards."""

from __future__ import annotations

import json

import torch

from engine.bench import cpu
from engine.bench.cpu_step_parts import decoder_stack, step_part, step_parts
from engine.bench.cpu_threads_under_load import Neighbour, thread_settings


def test_thread_settings_fold_repeats():
    assert thread_settings("default,1,2,all", 2, 1) == [("default (1)", 1), ("2", 2)]
    assert thread_settings("default,1,2,all", 8, 7) == [("default (7)", 7), ("1", 1), ("2", 2), ("all (8)", 8)]


def test_neighbour_is_bounded_and_stopped():
    with Neighbour(1, seconds=60) as n:
        procs = list(n.running)
        assert all(p.poll() is None for p in procs)
    assert all(p.poll() is not None for p in procs)
    with Neighbour(1, seconds=0.1) as n:  # ends by itself
        n.running[0].wait(timeout=30)


def test_bench_cpu_runs_every_setting_with_and_without_the_neighbour(tiny_llama, tmp_path, capsys):
    before = torch.get_num_threads()
    out = tmp_path / "cpu.json"
    try:
        rc = cpu.main(
            [
                "--model",
                str(tiny_llama),
                "--enforce-eager",
                "--threads",
                "default,1,2",
                "--rounds",
                "1",
                "--requests",
                "6",
                "--output-len",
                "3",
                "--batch1-tokens",
                "4",
                "--input-len",
                "8",
                "--max-model-len",
                "128",
                "--json",
                str(out),
            ]
        )
    finally:
        torch.set_num_threads(before)
    assert rc == 0
    res = json.loads(out.read_text())
    rows = res["rows"]
    assert {r["neighbour"] for r in rows} == {False, True}
    for flag in (False, True):
        mine = [r for r in rows if r["neighbour"] == flag]
        assert mine[0]["setting"].startswith("default")
        assert min(r["batch1_vs_best"] for r in mine) == 1.0 and all(r["batch1_vs_best"] >= 1.0 for r in mine)
        assert min(r["throughput_vs_best"] for r in mine) == 1.0
        assert all(r["batch1_ms"] > 0 and r["throughput_tok_s"] > 0 for r in mine)
    assert isinstance(res["default_within_1.3x"], bool)
    text = capsys.readouterr().out
    assert "| neighbour | threads |" in text and "default with the neighbour" in text


def test_step_parts_split_a_decode_step(tiny_llama, capsys):
    """--step-parts: every op's own time lands in one part, the parts and the host's remainder add
    up to the unprofiled step, and the linear layers and attention are found by name (the eager
    reference attention here: no kernel build in a test)."""
    from engine.config.settings import EngineSettings
    from engine.runtime.llm_engine import LLMEngine

    assert step_part("aten::mm") == "linear" and step_part("aten::addmm") == "linear"
    assert step_part("kiln_cpu::paged_attention") == "attention"
    assert step_part("kiln_cpu_fused::rms_norm") == "fused norms/rope/act"
    assert step_part("aten::add") == "other torch ops"
    engine = LLMEngine.from_settings(
        EngineSettings(
            model=str(tiny_llama),
            device="cpu",
            max_model_len=128,
            num_gpu_blocks=64,
            max_num_seqs=4,
            log_stats_interval=0,
            enforce_eager=True,
        )
    )
    row = step_parts(engine, batch=2, steps=4, input_len=8)
    assert row["ops_per_step"] > 0 and row["parts_us"]["linear"] > 0 and row["parts_us"]["attention"] > 0
    assert sum(row["parts_us"].values()) >= row["step_us"] * 0.99
    assert not engine.core.has_unfinished_requests() and engine.core.pool.is_fully_free()
    assert "torch ops per step" in capsys.readouterr().out


def test_decoder_stack_against_op_by_op(tiny_llama, capsys):
    """--decoder-stack: both ways timed in one engine, interleaved, the stack put back afterwards;
    an engine without the stack says so and compares nothing."""
    from engine.config.settings import EngineSettings
    from engine.runtime.llm_engine import LLMEngine

    common = dict(
        model=str(tiny_llama), device="cpu", max_model_len=128, num_gpu_blocks=64, max_num_seqs=4, log_stats_interval=0
    )
    engine = LLMEngine.from_settings(EngineSettings(**common))
    stack = engine.core.runner.model.cpu_stack
    assert stack is not None
    res = decoder_stack(engine, [1, 2], rounds=2, steps=3, input_len=8)
    assert [r["batch"] for r in res["rows"]] == [1, 2]
    for r in res["rows"]:
        assert set(r["samples"]) == {"stack", "op by op", "stack, fork/join"}  # (no GGUF-blocks head here)
        assert all(len(v) == 2 for v in r["samples"].values())
        assert r["speedup"] == r["op_by_op_ms"] / r["stack_ms"] > 0 and r["team_speedup"] > 0
    assert engine.core.runner.model.cpu_stack is stack and stack.stack.team_rows() == 8
    assert not engine.core.has_unfinished_requests() and engine.core.pool.is_fully_free()
    off = LLMEngine.from_settings(EngineSettings(**common, cpu_decoder_stack=False))
    assert decoder_stack(off, [1], rounds=1, steps=2, input_len=8) == {}
    assert "-> " in capsys.readouterr().out


def test_decode_window_opens_on_a_prompt_the_prefix_cache_holds(make_llm):
    """The same prompt again (its blocks cached: the engine computes only its last tokens) still
    times every decode step; the window once waited for prompt tokens a cache hit never computes,
    and `kiln bench cpu` printed "batch-1 nan ms/token" for every round after the first."""
    from engine.bench.latency import run_kiln

    engine = make_llm(enable_prefix_caching=True).engine
    prompt = [[(7 * i) % 200 + 5 for i in range(40)]]  # (two full blocks of 16: cached after one run)
    first = run_kiln(engine, prompt, 6, "a")
    again = run_kiln(engine, prompt, 6, "b")
    assert engine.core.num_prompt_tokens_total < 2 * 40  # (the second run hit the cache)
    assert again["tokens"] == first["tokens"]
    for res in (first, again):
        assert res["decode_steps"] == 5 and len(res["step_s"]) == 5 and all(s > 0 for s in res["step_s"])
        assert res["window_tokens"] == 5
