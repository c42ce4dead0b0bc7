"""A wheel that installs: built from the tracked files (as a fresh clone has them), installed
(not editable) into a new virtual environment, it holds every package and the kernel templates,
and its `kiln` runs `generate` and serves `/health` from outside the source tree.

The new environment takes its dependencies (torch, transformers, ...) from the test's own
environment through a path file, so nothing is downloaded; kiln itself comes only from the wheel.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import sysconfig
import time
import zipfile
from pathlib import Path

import httpx
import pytest

ROOT = Path(__file__).resolve().parents[2]


def _tracked_copy(dest: Path) -> Path:
    """The repository's tracked files (what a fresh clone holds) copied into dest."""
    files = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    for name in filter(None, files.decode().split("\0")):
        src = ROOT / name
        if src.is_file():
            target = dest / name
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(src.read_bytes())
    return dest


def _prebuilt_libraries(src: Path) -> list[Path]:
    """Every ISA level's C++ CPU libraries at the paths where the wheel's build hook
    (compiler/kernels/wheel_build.py: cpu_prebuild --all) finds them under the tree `src`, put there
    first so the hook builds none (minutes): this CPU's are the session's real libraries (the
    installed kiln below loads them), the other levels' are stand-ins it never loads."""
    from compiler.kernels import cpu_prebuild

    placed = []
    for job in cpu_prebuild.jobs(every_level=True):
        target = cpu_prebuild.library(job, src / "compiler/kernels/prebuilt")
        real = cpu_prebuild.built(job, ROOT / "compiler/kernels/prebuilt")
        target.parent.mkdir(parents=True, exist_ok=True)
        if real is not None:
            target.write_bytes(real.read_bytes())
        elif job.kind != "cpu-gemv" and job.capability != torch_capability():
            target.write_bytes(b"not a library")
        else:
            continue  # (one this CPU loads, not built by the install step: the hook builds it)
        placed.append(target)
    return placed


def torch_capability() -> str:
    import torch

    return torch.backends.cpu.get_cpu_capability()


@pytest.fixture(scope="module")
def built_wheel(tmp_path_factory) -> tuple[Path, list[str]]:
    """The wheel, and the CPU libraries placed for its build hook (paths inside the package)."""
    if subprocess.run(["git", "rev-parse"], cwd=ROOT, capture_output=True).returncode != 0:
        pytest.skip("not a git checkout")
    src = _tracked_copy(tmp_path_factory.mktemp("src"))
    placed = _prebuilt_libraries(src)
    out = tmp_path_factory.mktemp("dist")
    res = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(out), str(src)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    (whl,) = out.glob("kiln_serve-*.whl")
    return whl, [str(p.relative_to(src)) for p in placed]


@pytest.fixture(scope="module")
def wheel(built_wheel) -> Path:
    return built_wheel[0]


@pytest.fixture(scope="module")
def venv(wheel, tmp_path_factory) -> Path:
    env_dir = tmp_path_factory.mktemp("venv")
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(env_dir)], check=True, timeout=120)
    site = Path(
        subprocess.run(
            [str(env_dir / "bin" / "python"), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    )
    # Dependencies from this environment (a .pth line is a path, not a site dir: its own .pth files,
    # among them the editable kiln's finder, are not run).
    (site / "deps.pth").write_text(sysconfig.get_path("purelib") + "\n")
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "--python",
            str(env_dir / "bin" / "python"),
            "install",
            "-q",
            "--no-deps",
            "--no-index",
            str(wheel),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    return env_dir


def _env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")} | {"PYTHONUNBUFFERED": "1"}


def test_wheel_holds_every_package_and_the_templates(built_wheel):
    wheel, shipped = built_wheel
    names = zipfile.ZipFile(wheel).namelist()
    packages = {str(p.parent.relative_to(ROOT)) for p in ROOT.glob("engine/**/__init__.py")}
    packages |= {str(p.parent.relative_to(ROOT)) for p in ROOT.glob("compiler/**/__init__.py")}
    for pkg in sorted(packages):
        assert f"{pkg}/__init__.py" in names, f"{pkg} is missing from the wheel"
    templates = {p.name for p in (ROOT / "templates").iterdir() if p.suffix in (".cpp", ".cuh", ".inc", ".j2", ".toml")}
    assert templates and templates <= {Path(n).name for n in names if n.startswith("templates/")}
    for data in ("grafana_dashboard.json", "chat_page.html"):  # (package data: the dashboard, the chat page)
        assert f"engine/entrypoints/openai/{data}" in names, data
    # every ISA level's CPU libraries (the build hook's), where the loaders look first (cpu_extension.py)
    assert shipped and set(shipped) <= set(names), sorted(set(shipped) - set(names))


def test_installed_kiln_generates_and_serves(venv, tiny_llama, tmp_path):
    kiln = str(venv / "bin" / "kiln")
    where = subprocess.run(
        [str(venv / "bin" / "python"), "-c", "import engine, templates; print(engine.__file__)"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        env=_env(),
        timeout=120,
    )
    assert where.returncode == 0, where.stderr
    assert str(venv) in where.stdout and str(ROOT) not in where.stdout  # the wheel's copy, not the source tree

    res = subprocess.run(
        [
            kiln,
            "generate",
            "Hello",
            "--max-tokens",
            "4",
            "--json",
            "--model",
            str(tiny_llama),
            "--device",
            "cpu",
            "--max-model-len",
            "128",
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        env=_env(),
        timeout=900,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    assert json.loads(res.stdout.strip().splitlines()[-1])["prompt"] == "Hello"

    # `kiln grafana-dashboard` prints where the installed dashboard is.
    dash = subprocess.run([kiln, "grafana-dashboard"], cwd=tmp_path, capture_output=True, text=True, env=_env())
    path = Path(dash.stdout.strip())
    assert dash.returncode == 0 and str(venv) in str(path) and json.loads(path.read_text())["panels"], dash

    proc = subprocess.Popen(
        [kiln, "serve", "--model", str(tiny_llama), "--port", "0", "--device", "cpu", "--max-model-len", "128"],
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=_env(),
    )
    try:
        url, seen = None, []
        deadline = time.monotonic() + 900
        while url is None and time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            seen.append(line)
            if m := re.match(r"kiln: serving .* at (http://[^/\s]+)", line):
                url = m.group(1)
        assert url, "".join(seen)[-3000:]
        for _ in range(100):
            health = httpx.get(f"{url}/health", timeout=5)
            if health.status_code == 200:
                break
            time.sleep(0.1)
        assert health.status_code == 200
        assert "<title>kiln chat</title>" in httpx.get(f"{url}/", timeout=5).text  # (package data)
    finally:
        proc.terminate()
        proc.wait(60)
