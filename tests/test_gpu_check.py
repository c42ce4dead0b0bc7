"""tools/gpu_check.sh's stage logic on the CPU: stages skip cleanly without CUDA, the deadline
cuts and skips correctly, the summary always prints; tools/gpu_summary.py's bookkeeping."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "tools" / "gpu_check.sh"
sys.path.insert(0, str(REPO / "tools"))
import gpu_summary  # noqa: E402

STAGES = ["env", "kernel-cache", "tests", "kernel-bench", "latency-8b", "quant-bench", "w4a16-bench", "feature-tests",
          "moe-bench", "swap-bench", "latency-1b"]


def run_check(tmp_path, *args, timeout=240, **env):
    # no wheels unless given: this machine has the engine's dependencies (.whl/ holds the device's cp312 builds)
    full = dict(os.environ, OUT=str(tmp_path / "out"), GPU_CHECK_WORK=str(tmp_path / "work"), PYTHON=sys.executable,
                KILN_CACHE_DIR=str(tmp_path / "cache"), GPU_CHECK_WHEELS=str(tmp_path / "no-wheels"),
                GPU_CHECK_SITE=str(tmp_path / "site"))
    full.update({k: str(v) for k, v in env.items()})
    proc = subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, env=full, timeout=timeout)
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    return proc, summary["stages"], summary


def _table(script: str, name: str) -> dict[str, int]:
    body = re.search(rf"declare -A {name}=\((.*?)\)\n", script, re.S).group(1)
    return {k: int(v) for k, v in re.findall(r"\[([a-z0-9-]+)\]=(\d+)", body)}


def test_stage_budget_reaches_the_8b_figures():
    """The stage maxima up to latency-8b fit the default deadline, in the issue's order."""
    text = SCRIPT.read_text()
    order = re.search(r"ALL_STAGES=\((.*?)\)", text).group(1).split()
    assert order == STAGES
    max_s, min_s = _table(text, "MAX_S"), _table(text, "MIN_S")
    deadline = int(re.search(r"DEADLINE_S=\$\{DEADLINE_S:-(\d+)\}", text).group(1))
    assert sum(max_s[s] for s in order[:order.index("latency-8b") + 1]) <= deadline
    assert deadline + 40 <= 9 * 60  # one device call under 9 minutes (timeout_s=540), 40 s to pack and print
    assert all(min_s[s] <= max_s[s] for s in order)
    assert "sed -i" not in text  # the kernel choice is a setting, no source is edited


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA path")
def test_without_cuda_every_gpu_stage_skips_and_the_summary_prints(tmp_path):
    proc, stages, _ = run_check(tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert stages["env"]["status"] == "ok", (tmp_path / "work" / "env.log").read_text()[-2000:]
    assert stages["env"]["result"]["import_failures"] == {}  # every engine and compiler module imports
    for s in STAGES[1:]:
        assert stages[s]["status"] == "skipped" and stages[s]["reason"] == "no CUDA device"
    assert "kiln GPU check summary" in proc.stdout and "no figure" in proc.stdout
    out = tmp_path / "out"
    assert sorted(p.name for p in out.iterdir()) == ["gpu_check.tar.gz", "summary.json", "summary.txt"]
    with tarfile.open(out / "gpu_check.tar.gz") as tar:
        assert "./env.stage.json" in tar.getnames()


def test_a_failed_wheel_install_fails_fast(tmp_path):
    """Broken carried wheels: the env stage fails and no GPU stage runs, the summary still prints."""
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    (wheels / "broken-1.0-py3-none-any.whl").write_bytes(b"not a zip")
    proc, stages, _ = run_check(tmp_path, GPU_CHECK_WHEELS=wheels)
    assert stages["env"]["status"] == "failed"
    assert "wheel install failed" in (tmp_path / "work" / "env.log").read_text()
    for s in STAGES[1:]:
        assert stages[s]["status"] == "skipped" and stages[s]["reason"].startswith("env stage failed")
    assert "kiln GPU check summary" in proc.stdout


def test_the_deadline_cuts_and_skips_stages(tmp_path):
    """Simulated stages of 5 s under limits divided by 10 and a 20 s deadline."""
    proc, stages, _ = run_check(tmp_path, DEADLINE_S=20, GPU_CHECK_SCALE=10, GPU_CHECK_SIMULATE_S=5)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert list(sorted(stages, key=lambda s: stages[s]["order"])) == STAGES  # every stage has its record, in order
    # env and kernel-cache may run 4 s (40 / 10): a 5 s stage is cut at its own limit
    assert stages["env"]["status"] == stages["kernel-cache"]["status"] == "timeout"
    assert stages["tests"]["status"] == "ok"  # 20 s allowed
    ran = [s for s in STAGES if stages[s]["status"] != "skipped"]
    assert sum(stages[s]["seconds"] for s in ran) <= 20 + 1
    skipped = [s for s in STAGES if stages[s]["status"] == "skipped"]
    assert "latency-1b" in skipped and all(stages[s]["reason"].startswith("deadline:") for s in skipped)
    # once skipped for time, a stage needing at least as much is skipped too
    assert "latency-8b" in skipped  # needs 9 s, never left after four 4-5 s stages
    assert "kiln GPU check summary" in proc.stdout


def test_quant_bench_stage_dry_run(tmp_path):
    """The quant-bench stage runs (simulated) right after latency-8b, under its own limit."""
    proc, stages, _ = run_check(tmp_path, "--dry-run", "latency-8b", "quant-bench")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert stages["quant-bench"]["status"] == "ok"
    assert stages["quant-bench"]["order"] == stages["latency-8b"]["order"] + 1
    assert "== quant-bench (limit 160s" in proc.stdout
    # skipped by the deadline like any stage: 60 s left is under its 70 s minimum
    proc, stages, _ = run_check(tmp_path, "quant-bench", DEADLINE_S=60, GPU_CHECK_SIMULATE_S=1)
    assert stages["quant-bench"]["status"] == "skipped" and stages["quant-bench"]["reason"].startswith("deadline:")


def test_quant_compare_ratios_and_missing_figures(tmp_path):
    from engine.bench import quant_compare

    bf16, int4, fp8 = tmp_path / "bf16.json", tmp_path / "int4.json", tmp_path / "fp8.json"
    bf16.write_text(json.dumps([{"batch_size": 1, "ms_per_step_median": 5.0, "weight_GB": 16.0},
                                {"batch_size": 64, "ms_per_step_median": 20.0, "decode_tok_per_s": 3200.0}]))
    int4.write_text(json.dumps({"batch_size": 1, "ms_per_step_median": 1.8, "weight_GB": 5.2}))
    fp8.write_text(json.dumps({"batch_size": 64, "decode_tok_per_s": 4800.0}))
    out = tmp_path / "q.json"
    assert quant_compare.main(["--bf16", str(bf16), "--int4", str(int4), "--fp8", str(fp8), "--json", str(out)]) == 0
    r = json.loads(out.read_text())
    assert r["int4_over_bf16_ms"] == pytest.approx(0.36) and r["int4_verdict"] == "MET"
    assert r["fp8_over_bf16_tok_s"] == pytest.approx(1.5) and r["notes"] == []
    r = quant_compare.compare(None, str(int4), str(tmp_path / "absent.json"))
    assert "int4_over_bf16_ms" not in r and r["notes"] == ["int4 batch 1: no bf16 figure", "fp8 batch 64: no bf16 figure"]


def test_unknown_stage_is_refused(tmp_path):
    proc = subprocess.run(["bash", str(SCRIPT), "no-such-stage"], capture_output=True, text=True, timeout=60,
                          env=dict(os.environ, OUT=str(tmp_path), GPU_CHECK_WORK=str(tmp_path / "w")))
    assert proc.returncode == 2 and "unknown stage" in proc.stdout


# ---- gpu_summary.py ----------------------------------------------------------------------------

def _junit(path: Path, cases: dict[str, str]) -> str:
    body = []
    for name, outcome in cases.items():
        inner = {"passed": "", "failed": "<failure message='x'/>", "skipped": "<skipped/>",
                 "error": "<error message='x'/>"}[outcome]
        body.append(f"<testcase classname='tests.test_kernels_gpu' name='{name}'>{inner}</testcase>")
    path.write_text(f"<testsuites><testsuite>{''.join(body)}</testsuite></testsuites>")
    return str(path)


def test_summary_reads_figures_and_judges_targets(tmp_path):
    work = tmp_path / "work"
    (tmp_path / "lat8.json").write_text(json.dumps([
        {"batch_size": 1, "ms_per_step_median": 4.1, "decode_tok_per_s": 243.0},
        {"batch_size": 64, "ms_per_step_median": 9.0, "decode_tok_per_s": 7100.0}]))
    (tmp_path / "kb.json").write_text(json.dumps({"decode": [{"batch": 64, "ctx": 2048, "kiln_GBps": 3600.0}]}))
    junit = _junit(tmp_path / "t.xml", {"test_a[v1]": "passed", "test_b[v2]": "failed", "test_c": "skipped",
                                        "test_d": "error"})
    gpu_summary.record(work, "tests", "ok", "0", 120, None, None, [junit])
    gpu_summary.record(work, "kernel-bench", "ok", "0", 50, None, str(tmp_path / "kb.json"), [])
    gpu_summary.record(work, "latency-8b", "ok", "0", 140, None, str(tmp_path / "lat8.json"), [])
    gpu_summary.record(work, "latency-1b", "skipped", "-", 0, "deadline: 3s left, needs 60s", None, [])
    text = gpu_summary.table(work, tmp_path / "out")
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["stages"]["tests"]["status"] == "failed"  # failures in the junit file fail the stage
    assert summary["stages"]["tests"]["tests"] == {"passed": 1, "failed": 1, "errors": 1, "skipped": 1}
    verdicts = {t["target"].split(" (")[0]: (t["value"], t["verdict"]) for t in summary["targets"]}
    assert verdicts["8B bf16 batch 1 ms/step"] == (4.1, "MET")
    assert verdicts["8B bf16 batch 64 tok/s"] == (7100.0, "missed")  # below 3 x 2,734
    assert verdicts["1B bf16 batch 1 ms/step"] == (None, "no figure")
    assert verdicts["paged decode GB/s at B=64, ctx 2048"] == (3600.0, "MET")
    b1 = next(t for t in summary["targets"] if t["target"].startswith("8B bf16 batch 1"))
    assert b1["vs_transformers"] == pytest.approx(21.96 / 4.1)
    assert "deadline: 3s left" in text and "5.36x transformers" in text


def test_kernel_env_needs_every_test_of_a_generation_to_pass(tmp_path):
    ok = _junit(tmp_path / "a.xml", {"test_decode[v2-bf16]": "passed", "test_decode[v1-bf16]": "failed",
                                     "test_prefill[wgmma]": "passed", "test_prefill[mma]": "passed"})
    assert gpu_summary.kernel_env([ok]) == ["KILN_DECODE_KERNEL=v2", "KILN_PREFILL_KERNEL=wgmma"]
    bad = _junit(tmp_path / "b.xml", {"test_decode[v2-bf16]": "passed", "test_policy[v2-x]": "failed",
                                      "test_prefill[wgmma]": "skipped"})
    assert gpu_summary.kernel_env([bad]) == []  # a failed v2 test, and wgmma never ran
    assert gpu_summary.kernel_env([str(tmp_path / "missing.xml")]) == []


def test_w4a16_in_the_tests_stage_and_quant_bench_merges_kiln_and_tinygemm(tmp_path):
    """The tests stage runs tests/test_w4a16_gpu.py; quant-bench measures int4 on both kernels and
    its inline merge (run here on hand-made comparisons) adds tinygemm's figures and the kiln ratio."""
    from engine.bench import quant_compare

    text = SCRIPT.read_text()
    assert "tests/test_w4a16_gpu.py" in text and " w4a16)" in text
    assert "KILN_INT4_KERNEL=kiln" in text and "KILN_INT4_KERNEL=tinygemm" in text
    merge = re.search(r'"\$WORK/quant-bench-tinygemm.json" <<\'EOF\'\n(.*?)\nEOF\n', text, re.S).group(1)
    bf16 = tmp_path / "bf16.json"
    bf16.write_text(json.dumps([{"batch_size": 1, "ms_per_step_median": 5.0}]))
    for name, ms in (("kiln", 1.5), ("tinygemm", 2.5)):
        (tmp_path / f"{name}.json").write_text(json.dumps({"batch_size": 1, "ms_per_step_median": ms}))
        quant_compare.main(["--bf16", str(bf16), "--int4", str(tmp_path / f"{name}.json"),
                            "--json", str(tmp_path / f"q-{name}.json")])
    proc = subprocess.run([sys.executable, "-", str(tmp_path / "q-kiln.json"), str(tmp_path / "q-tinygemm.json")],
                          input=merge, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    r = json.loads((tmp_path / "q-kiln.json").read_text())
    assert r["int4_over_bf16_ms"] == pytest.approx(0.3) and r["tinygemm_over_bf16_ms"] == pytest.approx(0.5)
    assert r["kiln_over_tinygemm_ms"] == pytest.approx(0.6) and r["tinygemm_verdict"] == "missed"
    assert "kiln 1.500 ms/step vs tinygemm 2.500" in proc.stdout
