"""tools/bench_scheduler.py runs: this tree's scheduler against a git revision's, one table."""

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _bench():
    spec = importlib.util.spec_from_file_location("bench_scheduler", ROOT / "tools" / "bench_scheduler.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_bench_scheduler_times_both_schedulers_and_prints_the_ratio(monkeypatch, capsys):
    if subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True).returncode:
        pytest.skip("not a git checkout: no baseline revision to load")
    bench = _bench()
    monkeypatch.setattr(
        sys, "argv", ["bench_scheduler", "--baseline", "HEAD", "--batches", "1,8", "--steps", "12", "--repeats", "1"]
    )
    assert bench.main() == 0
    out = capsys.readouterr().out
    rows = [line.split() for line in out.splitlines() if line.split()[:1] in (["1"], ["8"])]
    assert {(r[0], r[1]) for r in rows} == {("1", "decode"), ("1", "mixed"), ("8", "decode"), ("8", "mixed")}, out
    assert all(r[-1].endswith("x") and float(r[-1][:-1]) > 0 for r in rows), out
