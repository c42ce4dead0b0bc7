"""tools/gpu_check.sh on the CPU: stages skip cleanly without CUDA, the deadline cuts and skips
correctly, a fake device's run survives stages that crash midway (every stage's JSON is written
and the summary names the crash), every test group collects its real pytest arguments; the strict
skip rule of tests/conftest.py. (What tools/gpu_summary.py makes of a run, and the GPU benchmarks'
drivers: test_gpu_summary.py.)"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
import tarfile

import pytest
import torch

from tests.support.gpu_tools import REPO, SCRIPT, gpu_summary

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


def run_check(tmp_path, *args, timeout=300, cache=None, **env):
    # no wheels unless given: this machine has the engine's dependencies (.whl/ holds the device's cp312 builds);
    # cache: a kiln cache that holds the CPU libraries, for a run that starts an engine
    full = dict(
        os.environ,
        OUT=str(tmp_path / "out"),
        GPU_CHECK_WORK=str(tmp_path / "work"),
        PYTHON=sys.executable,
        KILN_CACHE_DIR=str(cache or tmp_path / "cache"),
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
    """Simulated stages of 2 s under limits divided by 20 (env and kernel-cache set to 1 s) and a
    10 s deadline."""
    proc, stages, _ = run_check(
        tmp_path, DEADLINE_S=10, GPU_CHECK_SCALE=20, GPU_CHECK_SIMULATE_S=2, GPU_CHECK_MAX_S="env=1,kernel-cache=1"
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert list(sorted(stages, key=lambda s: stages[s]["order"])) == STAGES  # every stage has its record, in order
    assert "plan: env max 1s min 1s" in proc.stdout and "plan: tests max 11s min 3s" in proc.stdout
    # a 2 s stage is cut at its own limit
    assert stages["env"]["status"] == stages["kernel-cache"]["status"] == "timeout"
    assert stages["tests"]["status"] == "ok"  # 11 s allowed
    ran = [s for s in STAGES if stages[s]["status"] != "skipped"]
    assert sum(stages[s]["seconds"] for s in ran) <= 10 + 1
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
def fake_run(tmp_path_factory, kiln_cache_dir):
    """One fake-device run: every test group collected with its real arguments, two crashes. The
    limits of the stages it runs for real on the CPU are wide (a loaded machine must not turn a
    crash into a timeout: the deadline's cuts are test_the_deadline_cuts_and_skips_stages')."""
    tmp_path = tmp_path_factory.mktemp("fake-run")
    before = _sources()
    proc, stages, summary = run_check(
        tmp_path,
        "tests",
        "kernel-bench",
        "kernel-bench-v2",
        "latency-8b",
        "swap-bench",
        timeout=1800,
        cache=kiln_cache_dir,  # (the latency engines' C++ CPU libraries: not compiled again)
        DEADLINE_S=1700,
        GPU_CHECK_MAX_S="tests=600,latency-8b=600,swap-bench=300",
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
    for bad in ("tests=0", "tests=ten", "no-such-stage=5"):
        proc = subprocess.run(
            ["bash", str(SCRIPT), "--plan"],
            capture_output=True,
            text=True,
            timeout=60,
            env=dict(os.environ, OUT=str(tmp_path), GPU_CHECK_WORK=str(tmp_path / "w"), GPU_CHECK_MAX_S=bad),
        )
        assert proc.returncode == 2 and f"GPU_CHECK_MAX_S: '{bad}' is not STAGE=SECONDS" in proc.stdout, bad


def test_every_gpu_test_file_runs_in_a_group_and_kernel_tests_split_by_generation(fake_run):
    """What the fake run's groups collected with their real pytest arguments (as on an sm_90 GPU):
    every group some tests, each gpu-marked test file in some group, the kernel tests in two
    processes that share no test (newer generations alone), engine tests one per target; each
    process under the settings the device needs; every group's collection made in one process."""
    work = fake_run[0] / "work"
    groups = json.loads((work / "tests.json").read_text())["groups"]
    collected = {name: json.loads((work / f"tests-{name}.collect.json").read_text()) for name in groups}
    assert len(collected) >= 10 and all(c["nodes"] and not c["missing"] and not c["errors"] for c in collected.values())
    assert all(c["shared"] for c in collected.values())  # (one torch import for all, not one per group)
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
    still holds the two finished tests (SIGTERM would have left none). The limit is 10 s: the group
    was collected before it started, it only runs its stand-ins."""
    proc, stages, _ = run_check(
        tmp_path,
        "tests",
        GPU_CHECK_FAKE=1,
        GPU_CHECK_GROUPS="features",
        GPU_CHECK_HANG="tests:features",
        GPU_CHECK_MAX_S="tests=10",
    )
    work = tmp_path / "work"
    group = stages["tests"]["result"]["groups"]["features"]
    assert group["status"] == "timeout" and stages["tests"]["status"] == "timeout", group
    assert group["tests"] == {"passed": 2, "failed": 0, "errors": 0, "skipped": 0}, (
        work / "tests-features.log"
    ).read_text()
    assert len(gpu_summary.junit_outcomes([str(work / "tests-features.xml")])) == 2
    assert json.loads((work / "tests-features.collect.json").read_text())["shared"]


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
    assert not json.loads((tmp_path / "g.collect.json").read_text())["shared"]  # (collected by the group itself)


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


def test_every_module_the_script_runs_exists():
    """The `$PY -m NAME` commands of kiln's own modules (benchmarks, the kernel CLI): the fake device
    stubs some of them, so a module moved without the script following fails here, not on the GPU."""
    modules = set(re.findall(r"\$PY -m ((?:engine|compiler|tools)\.[\w.]+)", SCRIPT.read_text()))
    assert len(modules) >= 6, modules  # (the latency, kernel, quantised, W4A16, MoE and swap benchmarks...)
    assert [m for m in sorted(modules) if importlib.util.find_spec(m) is None] == []
