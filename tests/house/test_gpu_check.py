"""tools/gpu_check.sh on the CPU: stages skip cleanly without CUDA, the deadline cuts and skips
correctly, a fake device's run survives stages that crash midway (every stage's JSON is written
and the summary names the crash), the summary scores only figures from the cutlass backend with
CUDA graphs; tools/gpu_summary.py's bookkeeping; the strict skip rule of tests/conftest.py; the
drivers of the GPU benchmarks (latency, kernel bench) keep what they measured when they fail."""

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

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "tools" / "gpu_check.sh"
sys.path.insert(0, str(REPO / "tools"))
import gpu_summary  # noqa: E402

STAGES = [
    "env",
    "kernel-cache",
    "tests",
    "kernel-bench",
    "kernel-bench-v2",
    "latency-8b",
    "quant-bench",
    "w4a16-bench",
    "moe-bench",
    "swap-bench",
    "latency-1b",
]


def run_check(tmp_path, *args, timeout=300, **env):
    # no wheels unless given: this machine has the engine's dependencies (.whl/ holds the device's cp312 builds)
    full = dict(
        os.environ,
        OUT=str(tmp_path / "out"),
        GPU_CHECK_WORK=str(tmp_path / "work"),
        PYTHON=sys.executable,
        KILN_CACHE_DIR=str(tmp_path / "cache"),
        GPU_CHECK_WHEELS=str(tmp_path / "no-wheels"),
        GPU_CHECK_SITE=str(tmp_path / "site"),
    )
    full.update({k: str(v) for k, v in env.items()})
    proc = subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, env=full, timeout=timeout)
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    return proc, summary["stages"], summary


def test_stage_budget_reaches_the_8b_figures(tmp_path):
    """The plan the script prints (--plan; every run prints it first): the stages in the issue's
    order, their maxima up to latency-8b within the default deadline, the call (deadline + packing)
    within the device tool's 600 s per command."""
    proc = subprocess.run(
        ["bash", str(SCRIPT), "--plan"],
        capture_output=True,
        text=True,
        timeout=60,
        env=dict(os.environ, OUT=str(tmp_path / "out"), GPU_CHECK_WORK=str(tmp_path / "w")),
    )
    assert proc.returncode == 0, proc.stderr
    rows = re.findall(r"^plan: ([a-z0-9-]+) max (\d+)s min (\d+)s$", proc.stdout, re.M)
    assert [r[0] for r in rows] == STAGES
    assert all(int(lo) <= int(hi) for _, hi, lo in rows)
    total = re.search(
        r"^plan: stage maxima (\d+)s in all, (\d+)s up to latency-8b, DEADLINE_S=(\d+) .*"
        r"timeout_s=(\d+) of at most 600$",
        proc.stdout,
        re.M,
    )
    assert total, proc.stdout
    in_all, to_8b, deadline, timeout_s = map(int, total.groups())
    assert in_all == sum(int(hi) for _, hi, _ in rows) and deadline == 500
    assert to_8b == sum(int(hi) for _, hi, _ in rows[: STAGES.index("latency-8b") + 1]) <= deadline
    assert deadline + 60 <= timeout_s <= 600
    assert not (tmp_path / "out" / "summary.json").exists()  # the plan only: no stage ran
    # each test group's engine builds beside the tests stage's limit, their estimate within it
    groups = re.findall(
        r"^plan:   group ([a-z0-9-]+): (\d+) engine builds \((\d+) cold compiles\), ~(\d+)s of builds, "
        r"limit (\d+)s(.*)$",
        proc.stdout,
        re.M,
    )
    script = SCRIPT.read_text()
    names = re.findall(r'^  "([a-z0-9-]+)\|', script[script.index("TEST_GROUPS=(") :], re.M)
    assert [g[0] for g in groups] == names and {"spec-torch", "spec-cutlass"} <= set(names), proc.stdout
    limit = dict((r[0], int(r[1])) for r in rows)["tests"]
    for name, engines, cold, est, group_limit, over in groups:
        assert int(cold) <= int(engines) and int(group_limit) == limit and int(est) <= limit and not over, name


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA path")
def test_without_cuda_every_gpu_stage_skips_and_the_summary_prints(tmp_path):
    proc, stages, _ = run_check(tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert stages["env"]["status"] == "ok", (tmp_path / "work" / "env.log").read_text()[-2000:]
    assert stages["env"]["result"]["import_failures"] == {}  # every engine and compiler module imports
    for s in STAGES[1:]:
        assert stages[s]["status"] == "skipped" and stages[s]["reason"] == "no CUDA device", (s, stages[s])
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
    # env and kernel-cache may run 4 and 2 s (40 / 10, 20 / 10): a 5 s stage is cut at its own limit
    assert stages["env"]["status"] == stages["kernel-cache"]["status"] == "timeout"
    assert stages["tests"]["status"] == "ok"  # 22 s allowed
    ran = [s for s in STAGES if stages[s]["status"] != "skipped"]
    assert sum(stages[s]["seconds"] for s in ran) <= 20 + 1
    skipped = [s for s in STAGES if stages[s]["status"] == "skipped"]
    assert "latency-1b" in skipped and all(stages[s]["reason"].startswith("deadline:") for s in skipped)
    assert "kiln GPU check summary" in proc.stdout


def test_quant_bench_stage_dry_run(tmp_path):
    """The quant-bench stage runs (simulated) right after latency-8b, under its own limit; the
    optional quantised stages run only when named."""
    proc, stages, _ = run_check(tmp_path, "--dry-run", "latency-8b", "quant-bench")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert stages["quant-bench"]["status"] == "ok"
    assert stages["quant-bench"]["order"] == stages["latency-8b"]["order"] + 1
    assert "== quant-bench (limit 90s" in proc.stdout
    assert "plan: stage maxima 210s in all, 120s up to latency-8b, DEADLINE_S=500" in proc.stdout
    # skipped by the deadline like any stage: 20 s left is under its 30 s minimum
    proc, stages, _ = run_check(tmp_path, "quant-bench", DEADLINE_S=20, GPU_CHECK_SIMULATE_S=1)
    assert stages["quant-bench"]["status"] == "skipped" and stages["quant-bench"]["reason"].startswith("deadline:")
    proc, stages, _ = run_check(tmp_path, "--dry-run", "quant-fp8", "quant-tinygemm")
    assert stages["quant-fp8"]["status"] == stages["quant-tinygemm"]["status"] == "ok"


def _sources() -> dict[str, bytes]:
    return {str(p): p.read_bytes() for d in ("engine", "compiler", "tests", "tools") for p in (REPO / d).rglob("*.py")}


@pytest.fixture(scope="module")
def fake_run(tmp_path_factory):
    """One fake-device run: every test group collected with its real arguments, two crashes."""
    tmp_path = tmp_path_factory.mktemp("fake-run")
    before = _sources()
    proc, stages, summary = run_check(
        tmp_path,
        "tests",
        "kernel-bench",
        "kernel-bench-v2",
        "latency-8b",
        "swap-bench",
        timeout=600,
        GPU_CHECK_FAKE=1,
        GPU_CHECK_CRASH="latency-8b,tests:kernels-v2",
    )
    return tmp_path, proc, stages, summary, before != _sources()


def test_fake_device_run_survives_crashes_and_names_them(fake_run):
    """A fake device (GPU_CHECK_FAKE): the latency-8b stage runs the real latency driver on the
    CPU (its engine built in the background during the tests stage) and dies of SIGSEGV at its
    second batch; one test process dies the same way. Every other stage's JSON is written, the
    crashed stage keeps the row it measured, the summary names both crashes, and the unverified
    kernel generation is not benchmarked. No Python source was edited (the kernel choice is a
    setting, not a sed of the source)."""
    tmp_path, proc, stages, summary, edited = fake_run
    assert not edited
    work = tmp_path / "work"
    assert proc.returncode == 0, proc.stderr[-3000:]
    lat = stages["latency-8b"]
    assert lat["status"] == "failed" and lat["rc"] == "139", (work / "latency-8b.log").read_text()[-3000:]
    assert "killed by SIGSEGV" in lat["crash"] and "illegal memory access" in lat["crash"]
    rows = json.loads((work / "latency-8b.json").read_text())
    assert [r["status"] for r in rows] == ["done", "running"]  # the measured row survived the crash
    assert rows[0]["ms_per_step"] > 0 and rows[0]["async_scheduling"] is True  # a GPU's default: overlap on
    assert rows[0]["compile_s"] == 0 and rows[0]["startup_s"] > 0
    tests = stages["tests"]
    groups = tests["result"]["groups"]
    assert groups["kernels-v2"]["status"] == "failed" and "SIGSEGV" in groups["kernels-v2"]["crash"]
    assert all(g["status"] == "ok" for name, g in groups.items() if name != "kernels-v2")
    collected = {name: json.loads((work / f"tests-{name}.collect.json").read_text()) for name in groups}
    assert tests["status"] == "failed"
    assert tests["tests"]["passed"] == sum(len(c["nodes"]) for name, c in collected.items() if name != "kernels-v2")
    assert stages["kernel-bench"]["status"] == "ok" and stages["kernel-bench"]["result"]["complete"]
    # the GPU is checked quiet before timing: the 8B engine built in the background is polled, and
    # its state goes beside the figures (the timed engine's own stage polls none other)
    assert stages["kernel-bench"]["engines"] in ("latency-8b=built-idle", "latency-8b=still-building")
    assert stages["latency-8b"]["engines"] == "none"
    assert stages["kernel-bench-v2"]["status"] == "skipped" and "not verified" in stages["kernel-bench-v2"]["reason"]
    assert stages["swap-bench"]["status"] == "ok" and stages["swap-bench"]["result"]["complete"]
    text = (tmp_path / "out" / "summary.txt").read_text()
    assert "CRASH: killed by SIGSEGV" in text and "kernels-v2" in text
    assert "background engines: latency-8b=" in text
    verdicts = {(t["stage"], t["target"]): t["verdict"] for t in summary["targets"]}
    assert verdicts["latency-8b", "8B bf16 batch 1 ms/step"] == "not scored (device cpu)"
    assert verdicts["latency-8b", "8B bf16 batch 64 tok/s (3x transformers' 2,734)"] == "no figure"
    assert verdicts["kernel-bench", "paged decode GB/s at B=64, ctx 2048"] == "not scored (a fake device)"
    assert "MET" not in text and "missed" not in text


def test_unknown_stage_is_refused(tmp_path):
    proc = subprocess.run(
        ["bash", str(SCRIPT), "no-such-stage"],
        capture_output=True,
        text=True,
        timeout=60,
        env=dict(os.environ, OUT=str(tmp_path), GPU_CHECK_WORK=str(tmp_path / "w")),
    )
    assert proc.returncode == 2 and "unknown stage" in proc.stdout


def test_every_gpu_test_file_runs_in_a_group_and_kernel_tests_split_by_generation(fake_run):
    """What the fake run's groups collected with their real pytest arguments (as on an sm_90 GPU):
    every group some tests, each gpu-marked test file in some group, the kernel tests in two
    processes that share no test (newer generations alone), engine tests one per target; each
    process under the settings the device needs."""
    work = fake_run[0] / "work"
    groups = json.loads((work / "tests.json").read_text())["groups"]
    collected = {name: json.loads((work / f"tests-{name}.collect.json").read_text()) for name in groups}
    assert len(collected) >= 10 and all(c["nodes"] and not c["missing"] and not c["errors"] for c in collected.values())
    files = {node.split("::")[0] for c in collected.values() for node in c["nodes"]}
    gpu = re.compile(r"(@pytest\.mark\.gpu|pytestmark = pytest\.mark\.gpu|marks=pytest\.mark\.gpu)")
    marked = {
        f"tests/{p.relative_to(REPO / 'tests')}"
        for p in (REPO / "tests").rglob("test_*.py")
        if gpu.search(p.read_text())
    }
    assert marked <= files, marked - files
    v1, v2 = set(collected["kernels-v1"]["nodes"]), set(collected["kernels-v2"]["nodes"])
    assert not v1 & v2
    newer = [any(k in node.split("::")[-1] for k in ("v2", "wgmma")) for node in v1 | v2]
    assert sum(newer) == len(v2)  # every newer-generation test in kernels-v2, none in kernels-v1
    for f in ("tests/compiler/test_kernels_gpu.py", "tests/layers/test_fp8_kv_gpu.py"):
        assert any(n.startswith(f) for n in v1) and any(n.startswith(f) for n in v2)
    for target in ("torch", "cutlass_v1", "cutlass_v2"):
        nodes = collected[f"graph-{target.replace('_', '-')}"]["nodes"]
        assert nodes and all(n.startswith("tests/worker/test_cuda_graph.py::") and target in n for n in nodes)
    for c in collected.values():
        assert c["env"] == {
            "TORCHINDUCTOR_COMPILE_THREADS": "2",
            "KILN_NUM_GPU_BLOCKS": "1024",
            "KILN_GPU_CHECK_STRICT": "1",
        }


def test_a_group_cut_at_its_limit_keeps_its_finished_verdicts(tmp_path):
    """A test group that hangs after two tests: its limit (SIGINT) cuts it, and its junit file
    still holds the two finished tests (SIGTERM would have left none)."""
    proc, stages, _ = run_check(
        tmp_path,
        "tests",
        GPU_CHECK_FAKE=1,
        GPU_CHECK_GROUPS="features",
        GPU_CHECK_HANG="tests:features",
        GPU_CHECK_SCALE=5,
    )
    work = tmp_path / "work"
    group = stages["tests"]["result"]["groups"]["features"]
    assert group["status"] == "timeout" and stages["tests"]["status"] == "timeout", group
    assert group["tests"] == {"passed": 2, "failed": 0, "errors": 0, "skipped": 0}, (
        work / "tests-features.log"
    ).read_text()
    assert len(gpu_summary.junit_outcomes([str(work / "tests-features.xml")])) == 2


@pytest.mark.parametrize(
    "args, problem",
    [
        (["-m", "gpu", "tests/test_no_such_file.py"], "no such path: tests/test_no_such_file.py"),
        (["-m", "gpu", "-k", "no_test_is_named_so", "tests/runtime/test_features_gpu.py"], "no test collected"),
    ],
)
def test_a_stale_group_fails_the_dry_run(tmp_path, args, problem):
    """A group whose path is gone, or whose -k/-m selects nothing, fails on the fake device."""
    proc = subprocess.run(
        [
            sys.executable,
            str(REPO / "tools" / "gpu_check_fake.py"),
            "group",
            str(tmp_path / "g"),
            "--",
            "-q",
            *args,
            f"--junitxml={tmp_path / 'g.xml'}",
        ],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=300,
    )
    assert proc.returncode == 3 and f"FAKE GROUP FAILED: {problem}" in proc.stdout, proc.stdout + proc.stderr
    assert not (tmp_path / "g.xml").exists()


def test_strict_mode_turns_gpu_skips_into_failures(tmp_path):
    """KILN_GPU_CHECK_STRICT=1: a gpu-marked test that skips (no GPU here) and a module that skips
    as a whole fail; without it they skip."""
    args = [
        sys.executable,
        "-m",
        "pytest",
        "-q",
        "-p",
        "no:cacheprovider",
        "-m",
        "gpu",
        "--continue-on-collection-errors",
        "tests/runtime/test_e2e_gpu.py",
        "tests/compiler/test_kernels_gpu.py",
        f"--junitxml={tmp_path / 'j.xml'}",
    ]
    if torch.cuda.is_available():
        pytest.skip("needs a machine without CUDA (the GPU tests would run)")
    plain = subprocess.run(
        args,
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=120,
        env={k: v for k, v in os.environ.items() if k != "KILN_GPU_CHECK_STRICT"},
    )
    assert plain.returncode == 0 and gpu_summary.junit_counts([str(tmp_path / "j.xml")])["skipped"] >= 2
    strict = subprocess.run(
        args, capture_output=True, text=True, cwd=REPO, timeout=120, env=dict(os.environ, KILN_GPU_CHECK_STRICT="1")
    )
    assert strict.returncode != 0
    counts = gpu_summary.junit_counts([str(tmp_path / "j.xml")])
    assert counts["skipped"] == 0 and counts["passed"] == 0 and counts["errors"] + counts["failed"] >= 3
    assert "KILN_GPU_CHECK_STRICT" in strict.stdout and "test_kernels_gpu.py" in strict.stdout


# ---- gpu_summary.py ----------------------------------------------------------------------------


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
