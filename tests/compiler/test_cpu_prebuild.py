"""The install step's CPU libraries (compiler/kernels/cpu_prebuild.py) are the ones a start loads:
the same paths and keys as the loaders', every ISA level with --all, nothing rebuilt that is
there, and a library a wheel ships found before the cache. (The compiles themselves are the
loaders' builds, which tests/worker/test_cpu_compile.py runs.)"""

from __future__ import annotations

import json
import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from compiler.kernels import cpu_extension, cpu_prebuild
from compiler.kernels.cpu_attention import KERNEL
from compiler.kernels.cpu_fused import FUSED
from compiler.kernels.cpu_gemv import GEMV
from tests.support.prebuilt_kernels import prebuilt_dir

ROOT = Path(__file__).resolve().parents[2]


def test_this_cpus_jobs_are_what_a_start_loads(tmp_path):
    here = torch.backends.cpu.get_cpu_capability()
    jobs = cpu_prebuild.jobs(every_level=False)
    assert {(j.kind, j.capability) for j in jobs} == {
        ("cpu-gemv", "every level"),
        ("cpu-attention", here),
        ("cpu-fused", here),
    }
    paths = {j.kind: cpu_prebuild.library(j, tmp_path) for j in jobs}
    assert paths["cpu-attention"] == cpu_extension.library_path(tmp_path, "cpu-attention", KERNEL.key())
    assert paths["cpu-fused"] == cpu_extension.library_path(tmp_path, "cpu-fused", FUSED.key())
    assert paths["cpu-gemv"] == cpu_extension.library_path(tmp_path, "cpu-gemv", GEMV.key())


@pytest.mark.skipif(platform.machine().lower() not in ("x86_64", "amd64"), reason="x86-64's ISA levels")
def test_every_level_has_its_own_flags_and_key(tmp_path):
    jobs = cpu_prebuild.jobs(every_level=True)
    caps = {j.capability for j in jobs if j.kind == "cpu-attention"}
    assert caps == {"DEFAULT", "AVX2", "AVX512"} == {j.capability for j in jobs if j.kind == "cpu-fused"}
    assert len(jobs) == 7
    assert len({cpu_prebuild.library(j, tmp_path) for j in jobs}) == 7
    _, flags, _ = cpu_prebuild._spec(cpu_prebuild.Job("cpu-attention", "AVX512"))
    assert "-mavx512f" in flags and "-mavx512f" not in cpu_prebuild._spec(cpu_prebuild.Job("cpu-fused", "AVX2"))[1]


@pytest.fixture
def nothing_shipped(tmp_path):
    """An empty package folder (a checkout's compiler/kernels/prebuilt/ may hold `make venv`'s builds)."""
    with prebuilt_dir(tmp_path / "shipped") as folder:
        yield folder


def test_nothing_is_rebuilt_that_is_there(tmp_path, monkeypatch, nothing_shipped):
    for job in cpu_prebuild.jobs(every_level=False):
        path = cpu_prebuild.library(job, tmp_path)
        path.parent.mkdir(parents=True)
        path.write_bytes(b"")

    def no_build(*args, **kwargs):
        raise AssertionError("a library already built was built again")

    monkeypatch.setattr(subprocess, "run", no_build)
    lines: list[str] = []
    assert cpu_prebuild.prebuild(tmp_path, out=lines.append) == 0
    assert len(lines) == 3 and all("already built" in line for line in lines)


def test_a_library_the_package_ships_is_not_built_into_the_cache(tmp_path, monkeypatch, nothing_shipped):
    (job, *_) = cpu_prebuild.jobs(every_level=False)
    shipped = cpu_prebuild.library(job, cpu_extension.SHIPPED_DIR)
    shipped.parent.mkdir(parents=True)
    shipped.write_bytes(b"")
    monkeypatch.setattr(
        subprocess, "run", lambda cmd, **kwargs: subprocess.CompletedProcess(cmd, 1, stdout="", stderr="no compiler")
    )
    lines: list[str] = []
    assert cpu_prebuild.prebuild(tmp_path / "cache", jobs_at_once=1, out=lines.append) == 2  # (the other two)
    assert f"{job.label} already built ({shipped.parent})" in lines[0]


def test_a_failed_build_is_reported_not_hidden(tmp_path, monkeypatch, nothing_shipped):
    def failing(cmd, **kwargs):
        return subprocess.CompletedProcess(cmd, 1, stdout="", stderr="c++: error: no compiler here")

    monkeypatch.setattr(subprocess, "run", failing)
    lines: list[str] = []
    assert cpu_prebuild.prebuild(tmp_path, jobs_at_once=1, out=lines.append) == 3
    assert lines[0].startswith("kiln CPU kernels: building 3 C++ libraries")
    assert sum("FAILED" in line and "no compiler here" in line for line in lines) == 3


def test_a_shipped_library_is_found_before_the_cache(tmp_path, monkeypatch):
    monkeypatch.setattr(cpu_extension, "SHIPPED_DIR", tmp_path / "prebuilt")
    cache = tmp_path / "cache"
    assert cpu_extension.find_library(cache, "cpu-fused", "k1") == cpu_extension.library_path(cache, "cpu-fused", "k1")
    shipped = cpu_extension.library_path(tmp_path / "prebuilt", "cpu-fused", "k1")
    shipped.parent.mkdir(parents=True)
    shipped.write_bytes(b"")
    assert cpu_extension.find_library(cache, "cpu-fused", "k1") == shipped
    assert FUSED.library_path(cache) != shipped  # (another key: its own source and flags)


def test_the_warm_up_line_says_what_this_start_compiled(monkeypatch):
    from engine.runtime import builder_cpu

    before = builder_cpu.library_builds()
    assert builder_cpu.compiled_since(before) == ""  # (nothing compiled: nothing said)
    monkeypatch.setattr(KERNEL, "builds", KERNEL.builds + 1)
    monkeypatch.setattr(GEMV, "builds", GEMV.builds + 1)
    said = builder_cpu.compiled_since(before)
    assert said.startswith("; 2 C++ libraries compiled by this start") and "ahead of time" not in said


# A fresh process (each library loads once per process) with an empty cache and the package's
# prebuilt folder at argv[1]: loads every library this CPU's starts load, any compile an error.
_START = """
import json, sys
from pathlib import Path
import torch
from compiler.kernels import cpu_extension
cpu_extension.SHIPPED_DIR = Path(sys.argv[1])
def no_build(path, *args):
    raise AssertionError(f"compiled at start: {path}")
cpu_extension.build = no_build
from compiler.kernels.cpu_attention import KERNEL
from compiler.kernels.cpu_fused import FUSED
from compiler.kernels.cpu_gemv import GEMV
cache = Path(sys.argv[2])
KERNEL.configure(cache)
KERNEL.load()
assert FUSED.ensure(cache), FUSED.error
GEMV.configure(cache)
assert GEMV.ensure(), GEMV.error
print(json.dumps(sorted(p for p in torch.ops.loaded_libraries if Path(p).name.startswith("kiln_"))))
"""


def test_a_start_after_the_install_step_loads_its_libraries_and_compiles_nothing(tmp_path):
    """What `make venv` leaves in the package's prebuilt folder is what a start loads: every
    library from there, no compile, nothing written into the (empty) cache."""
    session = Path(os.environ["KILN_CACHE_DIR"]) / "compile"
    # The install step's libraries: a checkout's (make venv's) or this session's; built into the
    # session's cache only where neither has one (the build a later test would otherwise pay).
    assert cpu_prebuild.prebuild(session, jobs_at_once=1, out=lambda line: None) == 0
    prebuilt = tmp_path / "prebuilt"
    for job in cpu_prebuild.jobs(every_level=False):
        found = cpu_prebuild.built(job, session)
        assert found is not None, job
        copy = cpu_prebuild.library(job, prebuilt)
        copy.parent.mkdir(parents=True)
        shutil.copy2(found, copy)
    cache = tmp_path / "cache"
    res = subprocess.run(
        [sys.executable, "-c", _START, str(prebuilt), str(cache)], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert res.returncode == 0, res.stderr[-3000:]
    loaded = [Path(p) for p in json.loads(res.stdout.strip().splitlines()[-1])]
    assert len(loaded) == 3 and all(p.is_relative_to(prebuilt) for p in loaded), loaded
    assert not list(cache.rglob("*.so")), "a start wrote a library into the cache"


def test_one_build_more_than_cores_and_each_builds_cpu_seconds_said(tmp_path, monkeypatch, nothing_shipped):
    # 3 libraries on 2 cores: all at once (the short one shares the cores instead of running last).
    assert cpu_prebuild.default_workers(3, cores=2) == 3
    assert cpu_prebuild.default_workers(7, cores=2) == 3 and cpu_prebuild.default_workers(1, cores=8) == 1
    seen = []

    def child(cmd, **kwargs):
        seen.append(kwargs.get("cwd"))
        return subprocess.CompletedProcess(cmd, 0, stdout="ninja says things\nkiln-build-cpu-seconds:12.5\n", stderr="")

    monkeypatch.setattr(subprocess, "run", child)
    lines: list[str] = []
    assert cpu_prebuild.prebuild(tmp_path, jobs_at_once=1, out=lines.append) == 0
    assert seen == [cpu_prebuild.PACKAGE_ROOT] * 3  # (the package importable whatever the caller's folder)
    assert sum(line.endswith("(12 CPU-s)") for line in lines) == 3  # (12.5 rounds to even)
    assert lines[-1].startswith("kiln CPU kernels: 3 built in") and lines[-1].endswith(", 38 CPU-s")
