"""The wheel's build hook (compiler/kernels/wheel_build.py, plugged in by setup.py): what it decides
and what it puts into the wheel, with a fake builder (a real build of every ISA level costs minutes;
`pip wheel --no-build-isolation .` runs it, docs/benchmarks.md has its figures)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from compiler.kernels import cpu_extension, cpu_prebuild, wheel_build
from tests.support.prebuilt_kernels import prebuilt_dir

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    "editable, has_torch, what",
    [(True, True, "editable"), (True, False, "editable"), (False, True, "build"), (False, False, "no-torch")],
)
def test_what_the_hook_decides(editable, has_torch, what):
    assert wheel_build.decide(editable, has_torch) == what


class FakeBuilder:
    """Writes what a ninja build leaves (object file, ninja state, the library) for some libraries
    under the stage folder and the manifest cpu_prebuild writes; exits with `rc`."""

    def __init__(self, stage: Path, names: list[str], rc: int = 0) -> None:
        self.stage, self.names, self.rc, self.calls = stage, names, rc, []

    def __call__(self, cmd: list[str]) -> int:
        self.calls.append(cmd)
        listing = {}
        for name in self.names:
            folder = self.stage / "cpu-fused" / name
            folder.mkdir(parents=True, exist_ok=True)
            for junk in ("cpu_fused_ops.o", "build.ninja", ".ninja_log"):
                (folder / junk).write_text("x")
            (folder / f"{name}.so").write_bytes(b"\x7fELF")
            listing[f"cpu-fused/{name}/{name}.so"] = str(folder / f"{name}.so")
        Path(cmd[cmd.index("--manifest") + 1]).write_text(json.dumps(listing))
        return self.rc


def test_a_build_ships_the_libraries_alone_where_the_loaders_look(tmp_path, capsys):
    stage, build_lib = tmp_path / "stage", tmp_path / "build_lib"
    fake = FakeBuilder(stage, ["kiln_cpu_fused_aaa", "kiln_cpu_fused_bbb"])
    shipped = wheel_build.kernels_for_wheel(build_lib, editable=False, has_torch=True, run=fake, stage=stage)
    (cmd,) = fake.calls
    assert cmd[:3] == [sys.executable, "-m", "compiler.kernels.cpu_prebuild"] and "--all" in cmd
    assert cmd[cmd.index("--into") + 1] == str(stage)
    files = sorted(p.relative_to(build_lib).as_posix() for p in build_lib.rglob("*") if p.is_file())
    assert files == [
        "compiler/kernels/prebuilt/cpu-fused/kiln_cpu_fused_aaa/kiln_cpu_fused_aaa.so",
        "compiler/kernels/prebuilt/cpu-fused/kiln_cpu_fused_bbb/kiln_cpu_fused_bbb.so",
    ]
    assert sorted(shipped) == sorted(build_lib / f for f in files)
    # The installed package's loaders find them: the same layout as cpu_extension.library_path.
    assert shipped[0] == cpu_extension.library_path(build_lib / wheel_build.IN_WHEEL, "cpu-fused", "aaa")
    assert "2 C++ libraries in the wheel" in capsys.readouterr().out


def test_a_library_an_earlier_build_left_in_build_lib_is_not_shipped(tmp_path):
    stage, build_lib = tmp_path / "stage", tmp_path / "build_lib"
    stale = build_lib / wheel_build.IN_WHEEL / "cpu-fused" / "kiln_cpu_fused_old" / "kiln_cpu_fused_old.so"
    stale.parent.mkdir(parents=True)
    stale.write_bytes(b"")
    fake = FakeBuilder(stage, ["kiln_cpu_fused_new"])
    wheel_build.kernels_for_wheel(build_lib, editable=False, has_torch=True, run=fake, stage=stage)
    assert [p.name for p in build_lib.rglob("*.so")] == ["kiln_cpu_fused_new.so"]


def test_an_editable_install_builds_nothing(tmp_path, capsys):
    fake = FakeBuilder(tmp_path / "stage", ["kiln_cpu_fused_aaa"])
    assert wheel_build.kernels_for_wheel(tmp_path / "lib", editable=True, has_torch=True, run=fake) == []
    assert fake.calls == [] and not (tmp_path / "lib").exists() and capsys.readouterr().out == ""


def test_without_torch_one_line_and_a_wheel_without_kernels(tmp_path, capsys):
    fake = FakeBuilder(tmp_path / "stage", ["kiln_cpu_fused_aaa"])
    assert wheel_build.kernels_for_wheel(tmp_path / "lib", editable=False, has_torch=False, run=fake) == []
    out = capsys.readouterr().out.strip().splitlines()
    assert fake.calls == [] and out == [wheel_build.NO_TORCH] and not (tmp_path / "lib").exists()


def test_a_failed_build_ships_what_built_and_says_so(tmp_path, capsys):
    stage, build_lib = tmp_path / "stage", tmp_path / "lib"
    fake = FakeBuilder(stage, ["kiln_cpu_fused_aaa"], rc=1)
    shipped = wheel_build.kernels_for_wheel(build_lib, editable=False, has_torch=True, run=fake, stage=stage)
    assert [p.name for p in shipped] == ["kiln_cpu_fused_aaa.so"]
    assert "exited with 1; the wheel ships the 1 libraries that built" in capsys.readouterr().out


def test_the_manifest_lists_every_level_where_the_loaders_find_it(tmp_path):
    """cpu_prebuild's --manifest (what the hook copies) names each library by the path a loader
    looks up under a prebuilt folder, wherever the build found it."""
    jobs = cpu_prebuild.jobs(every_level=True)
    for job in jobs[:2]:
        path = cpu_prebuild.library(job, tmp_path)
        path.parent.mkdir(parents=True)
        path.write_bytes(b"")
    with prebuilt_dir(tmp_path / "empty"):
        listing = cpu_prebuild.manifest(tmp_path, every_level=True)
    assert listing == {
        cpu_prebuild.library(job, Path("x")).relative_to("x").as_posix(): str(cpu_prebuild.library(job, tmp_path))
        for job in jobs[:2]
    }


def test_setup_py_plugs_the_hook_into_setuptools():
    """setup.py loads the hook by path (no torch, no kiln imports) and hands setuptools its commands."""
    text = (ROOT / "setup.py").read_text()
    assert "cmdclass=wheel_build.cmdclass()" in text
    commands = wheel_build.cmdclass()
    from setuptools.command.bdist_wheel import bdist_wheel
    from setuptools.command.build_py import build_py

    assert issubclass(commands["build_py"], build_py) and issubclass(commands["bdist_wheel"], bdist_wheel)
