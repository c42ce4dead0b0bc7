"""What tools/gpu_summary.py makes of a GPU check's run: a figure is scored only when measured on a
GPU with the cutlass backend and CUDA graphs, against the card the run was on; a stage's tests,
the kernel generations that passed, the quantised engines' ratios. And the drivers of the GPU
benchmarks (latency, kernel bench) keep what they measured when they fail. (The script's runs:
test_gpu_check.py.)"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.support.gpu_tools import gpu_summary


def _junit(path: Path, cases: dict[str, str]) -> str:
    body = []
    for name, outcome in cases.items():
        inner = {
            "passed": "",
            "failed": "<failure message='x'/>",
            "skipped": "<skipped/>",
            "error": "<error message='x'/>",
        }[outcome]
        body.append(f"<testcase classname='tests.compiler.test_kernels_gpu' name='{name}'>{inner}</testcase>")
    path.write_text(f"<testsuites><testsuite>{''.join(body)}</testsuite></testsuites>")
    return str(path)


GPU_ROW = dict(
    device="cuda",
    backend="cutlass",
    cuda_graphs=True,
    async_scheduling=True,
    decode_kernel="v1",
    prefill_kernel="mma",
    status="done",
)


def test_summary_scores_only_cutlass_figures_with_graphs(tmp_path):
    """A figure is MET or missed only when measured on a GPU on the cutlass backend with CUDA
    graphs, to the end; every target line names what produced it."""
    work = tmp_path / "work"
    (tmp_path / "lat8.json").write_text(
        json.dumps(
            [
                dict(GPU_ROW, batch_size=1, ms_per_step=4.1, decode_tok_per_s=243.0),
                dict(GPU_ROW, batch_size=64, ms_per_step=9.0, decode_tok_per_s=7100.0),
            ]
        )
    )
    (tmp_path / "lat1.json").write_text(
        json.dumps(
            [
                dict(GPU_ROW, batch_size=1, ms_per_step=0.8, backend="torch"),  # the fallback backend: never scored
                dict(GPU_ROW, batch_size=64, ms_per_step=3.0),
            ]
        )
    )
    (tmp_path / "kb.json").write_text(
        json.dumps(
            {
                "decode": [{"batch": 64, "ctx": 2048, "kiln_GBps": 3600.0}],
                "backend": "cutlass",
                "timing": "CUDA-graph replay",
                "decode_kernel": "v1",
                "device": "NVIDIA H200",
            }
        )
    )
    junit = _junit(
        tmp_path / "t.xml", {"test_a[v1]": "passed", "test_b[v2]": "failed", "test_c": "skipped", "test_d": "error"}
    )
    gpu_summary.record(work, "tests", "ok", "0", 120, None, None, [junit])
    gpu_summary.record(work, "kernel-bench", "ok", "0", 50, None, str(tmp_path / "kb.json"), [])
    gpu_summary.record(work, "latency-8b", "ok", "0", 140, None, str(tmp_path / "lat8.json"), [])
    gpu_summary.record(work, "latency-1b", "ok", "0", 60, None, str(tmp_path / "lat1.json"), [])
    text = gpu_summary.table(work, tmp_path / "out")
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["stages"]["tests"]["status"] == "failed"  # failures in the junit file fail the stage
    assert summary["stages"]["tests"]["tests"] == {"passed": 1, "failed": 1, "errors": 1, "skipped": 1}
    verdicts = {(t["stage"], t["target"].split(" (")[0]): (t["value"], t["verdict"]) for t in summary["targets"]}
    assert verdicts["latency-8b", "8B bf16 batch 1 ms/step"] == (4.1, "MET")
    assert verdicts["latency-8b", "8B bf16 batch 64 tok/s"] == (7100.0, "missed")  # below 3 x 2,734
    assert verdicts["latency-1b", "1B bf16 batch 1 ms/step"] == (0.8, "not scored (torch backend)")
    assert verdicts["kernel-bench", "paged decode GB/s at B=64, ctx 2048"] == (3600.0, "MET")
    assert verdicts["kernel-bench-v2", "paged decode GB/s at B=64, ctx 2048"] == (None, "no figure")
    b1 = next(t for t in summary["targets"] if t["target"].startswith("8B bf16 batch 1"))
    assert b1["vs_transformers"] == pytest.approx(21.96 / 4.1)
    assert "5.36x transformers" in text
    assert "[latency-8b: cuda, cutlass v1/mma, CUDA graphs, overlap on]" in text
    assert "[latency-1b: cuda, torch, CUDA graphs, overlap on]" in text
    # the same figures without graphs, from the CPU, or cut off before the end: never MET
    for change, why in (
        (dict(cuda_graphs=False), "no CUDA graphs"),
        (dict(device="cpu"), "device cpu"),
        (dict(status="running"), "status running"),
        (dict(forwards=10, graph_replays=9, recompiles=0), "9 graph replays for 10 forwards in the timed window"),
        (dict(forwards=10, graph_replays=10, recompiles=2), "2 recompiles in the timed window"),
    ):
        (tmp_path / "lat8.json").write_text(json.dumps([dict(GPU_ROW, batch_size=1, ms_per_step=4.1, **change)]))
        gpu_summary.record(work, "latency-8b", "ok", "0", 140, None, str(tmp_path / "lat8.json"), [])
        row = next(
            t for t in gpu_summary.targets({"latency-8b": json.loads((work / "latency-8b.stage.json").read_text())})
        )
        assert row["verdict"] == f"not scored ({why})" and "vs_transformers" not in row
    # recorded again: a stage keeps its place in the order
    assert json.loads((work / "latency-8b.stage.json").read_text())["order"] == 2


def test_a_stage_whose_tests_all_skipped_fails(tmp_path):
    work = tmp_path / "work"
    junit = _junit(tmp_path / "s.xml", {"test_a[v1]": "skipped", "test_b[v2]": "skipped"})
    entry = gpu_summary.record(work, "feature-tests", "ok", "0", 5, None, None, [junit])
    assert entry["status"] == "failed" and entry["reason"] == "all 2 tests skipped"
    (work / "tests-g.xml").write_text("<testsuites><testsuite/></testsuites>")
    assert gpu_summary.group(work, "g", "0", 1.0)["reason"] == "no test ran"
    crashed = gpu_summary.group(work, "h", "139", 2.0)  # no junit, killed by a signal
    assert crashed["status"] == "failed" and crashed["crash"].startswith("killed by SIGSEGV")


def test_kernel_env_needs_every_test_of_a_generation_to_pass(tmp_path):
    ok = _junit(
        tmp_path / "a.xml",
        {
            "test_decode[v2-bf16]": "passed",
            "test_decode[v1-bf16]": "failed",
            "test_prefill[wgmma]": "passed",
            "test_prefill[mma]": "passed",
        },
    )
    assert gpu_summary.kernel_env([ok]) == ["KILN_DECODE_KERNEL=v2", "KILN_PREFILL_KERNEL=wgmma"]
    bad = _junit(
        tmp_path / "b.xml",
        {"test_decode[v2-bf16]": "passed", "test_policy[v2-x]": "failed", "test_prefill[wgmma]": "skipped"},
    )
    assert gpu_summary.kernel_env([bad]) == []  # a failed v2 test, and wgmma never ran
    assert gpu_summary.kernel_env([str(tmp_path / "missing.xml")]) == []


def test_quant_compare_ratios_scoring_and_missing_figures(tmp_path):
    from engine.bench import quant_compare

    bf16, int4, fp8 = tmp_path / "bf16.json", tmp_path / "int4.json", tmp_path / "fp8.json"
    bf16.write_text(
        json.dumps(
            [
                dict(GPU_ROW, batch_size=1, ms_per_step=5.0, weight_GB=16.0),
                dict(GPU_ROW, batch_size=64, ms_per_step=20.0, decode_tok_per_s=3200.0),
            ]
        )
    )
    int4.write_text(json.dumps(dict(GPU_ROW, batch_size=1, ms_per_step=1.8, weight_GB=5.2, quantization="gptq")))
    fp8.write_text(json.dumps(dict(GPU_ROW, batch_size=64, ms_per_step=15.0, decode_tok_per_s=4800.0)))
    out = tmp_path / "q.json"
    assert quant_compare.main(["--bf16", str(bf16), "--int4", str(int4), "--fp8", str(fp8), "--json", str(out)]) == 0
    r = json.loads(out.read_text())
    assert r["int4_over_bf16_ms"] == pytest.approx(0.36) and r["int4_verdict"] == "MET"
    assert r["int4_row"]["quantization"] == "gptq" and r["bf16_row"]["backend"] == "cutlass"
    assert r["fp8_over_bf16_tok_s"] == pytest.approx(1.5) and r["notes"] == []
    work = tmp_path / "work"
    gpu_summary.record(work, "quant-bench", "ok", "0", 60, None, str(out), [])
    (row,) = [
        t
        for t in gpu_summary.targets({"quant-bench": json.loads((work / "quant-bench.stage.json").read_text())})
        if t["stage"] == "quant-bench"
    ]
    assert (row["value"], row["verdict"]) == (pytest.approx(0.36), "MET")
    int4.write_text(json.dumps(dict(GPU_ROW, batch_size=1, ms_per_step=1.8, backend="torch")))
    assert quant_compare.compare(str(bf16), str(int4), None)["int4_verdict"] == "not scored: torch backend"
    int4.write_text(json.dumps(dict(GPU_ROW, batch_size=1, status="running")))  # cut before it measured
    r = quant_compare.compare(str(bf16), str(int4), str(tmp_path / "absent.json"))
    assert "int4_over_bf16_ms" not in r
    assert r["notes"] == ["int4 batch 1: no int4 figure", "fp8 batch 64: no fp8 figure"]


def test_figures_are_scored_against_the_card_the_run_was_on():
    """The floors are the H200's; on an H100 each memory-bound bound scales by the bandwidths (the
    int4 / bf16 ratio does not), and the card is named beside each row."""
    env = {"env": {"result": {"gpu": "NVIDIA H100 80GB HBM3"}}}
    h100 = {row["target"]: row for row in gpu_summary.targets(env)}
    h200 = {row["target"]: row for row in gpu_summary.targets({"env": {"result": {"gpu": "NVIDIA H200"}}})}
    assert {row["card"] for row in h100.values()} == {"H100"} and {row["card"] for row in h200.values()} == {"H200"}
    assert h200["8B bf16 batch 1 ms/step"]["bound"] == "<= 4.3"
    assert h100["8B bf16 batch 1 ms/step"]["bound"] == f"<= {4.3 * 4.8 / 3.35:.4g}"
    assert h100["1B bf16 batch 1 ms/step"]["bound"] == f"<= {1.0 * 4.8 / 3.35:.4g}"
    assert h100["8B int4 / bf16 ms/step at batch 1"]["bound"] == h200["8B int4 / bf16 ms/step at batch 1"]["bound"]
    assert h100["paged decode GB/s at B=64, ctx 2048"]["bound"] == f">= {3500 * 3.35 / 4.8:.4g}"
    assert gpu_summary.card_of({}) == "H200"  # (no env record: the H200's floors)


# ---- the benchmarks' drivers keep what they measured -------------------------------------------


def test_latency_bench_writes_each_row_as_measured(tiny_llama, tmp_path, monkeypatch):
    """A GPU's defaults on the CPU (overlap on, chunked prefill): a fault in the second batch leaves
    the first batch's row, the fault in the second's, and the third pending; the fault propagates."""
    from engine.bench import latency

    real = latency.bench_one

    def failing(engine, batch, *args, **kw):
        if batch == 3:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        return real(engine, batch, *args, **kw)

    monkeypatch.setattr(latency, "bench_one", failing)
    out = tmp_path / "lat.json"
    with pytest.raises(RuntimeError, match="illegal memory access"):
        latency.main(
            [
                "--model",
                str(tiny_llama),
                "--device",
                "cpu",
                "--batch-size",
                "1,3,5",
                "--input-len",
                "8",
                "--output-len",
                "4",
                "--warmup-steps",
                "2",
                "--async-scheduling",
                "true",
                "--max-num-batched-tokens",
                "16",
                "--json",
                str(out),
            ]
        )
    rows = json.loads(out.read_text())
    assert [(r["batch_size"], r["status"]) for r in rows] == [(1, "done"), (3, "error"), (5, "pending")]
    assert rows[0]["ms_per_step"] > 0 and rows[0]["decode_steps"] == 3 and rows[0]["async_scheduling"] is True
    assert "illegal memory access" in rows[1]["error"]
    assert all(r["backend"] == "torch" and r["cuda_graphs"] is False and "startup_s" in r for r in rows)
    assert rows[0]["forwards"] >= 2 and rows[0]["graph_replays"] is None and rows[0]["recompiles"] == 0


def test_kernel_bench_writes_each_section(tmp_path, monkeypatch):
    """engine/bench/kernels.py with its GPU parts replaced: a fault in the prefill section leaves
    the copy bandwidth and the decode rows on disk, marked incomplete; only the chosen generation
    is loaded."""
    from compiler.kernels import cutlass_ops, loader
    from engine.bench import kernels as bench

    loaded = []

    class Kernels:
        occupancy = {}

        def __init__(self, *args, decode_kernel, prefill_kernel):
            loaded.append((decode_kernel, prefill_kernel))

    def prefill_fault(*args, **kw):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "fake")
    monkeypatch.setattr(cutlass_ops, "required_variants", lambda *a: [])
    monkeypatch.setattr(cutlass_ops, "AttentionKernels", Kernels)
    monkeypatch.setattr(loader, "missing_variants", lambda *a: [])
    monkeypatch.setattr(bench, "copy_bandwidth", lambda: 4.0e12)
    row = {
        "batch": 64,
        "ctx": 2048,
        "kiln_us": 150.0,
        "kiln_GBps": 3500.0,
        "kiln_copy_share": 0.8,
        "v1_us": 150.0,
        "v2_us": float("nan"),
    }
    monkeypatch.setattr(bench, "bench_decode", lambda *a, **kw: [row])
    monkeypatch.setattr(bench, "bench_prefill", prefill_fault)
    out = tmp_path / "kb.json"
    with pytest.raises(RuntimeError, match="illegal memory access"):
        bench.main(["--quick", "--json", str(out), "--decode-kernel", "v2", "--prefill-kernel", "wgmma"])
    result = json.loads(out.read_text())
    assert result["complete"] is False and result["copy_GBps"] == 4000.0 and result["decode"][0]["kiln_GBps"] == 3500
    assert "prefill" not in result and (result["decode_kernel"], result["prefill_kernel"]) == ("v2", "wgmma")
    assert loaded == [("v2", "wgmma")]  # one generation per process
