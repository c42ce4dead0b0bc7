"""The wheel's build hook (setup.py plugs it into setuptools' build_py and bdist_wheel): `pip wheel .`,
`pip install .` and `python -m build` build kiln's C++ CPU libraries for every ISA level kiln
dispatches to (`cpu_prebuild --all`) and ship them in the wheel under compiler/kernels/prebuilt/,
where the loaders look first, so the first start after installing that wheel compiles nothing
(issue 40, item 4).

It runs inside setuptools, where torch may be missing, so it imports neither torch nor kiln: the
builds run in a child process (compiler/kernels/cpu_prebuild.py), which reports where each library is.

- An editable install (`make venv`, `pip install -e .`): nothing. The Makefile builds this CPU's
  libraries into the checkout's compiler/kernels/prebuilt/ while pip installs (not twice).
- torch importable where the build runs (`pip wheel --no-build-isolation .`, `make wheel`): build
  what is missing into the checkout's compiler/kernels/prebuilt/ (what `make venv` built there is
  reused), copy the .so files alone into the wheel, and tag the wheel py3-none-<platform> (machine
  code; the libraries call no Python API). They are keyed by torch's version: under another torch
  a start compiles its own, once, and says so in one line.
- No torch (pip's default build isolation: torch is not a build requirement, since an unpinned
  one is a multi-GB CUDA download): one line, and a pure wheel without kernels, whose first start
  compiles the ones it loads (one log line).
- A build that fails: its lines, and the wheel ships the libraries that were built.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Callable

SOURCE_ROOT = Path(__file__).resolve().parents[2]
# The checkout's prebuilt folder: `make venv`'s libraries are there already, and a second wheel
# build finds the first's.
STAGE = SOURCE_ROOT / "compiler" / "kernels" / "prebuilt"
# Where the libraries go inside the wheel (the installed package's cpu_extension.SHIPPED_DIR).
IN_WHEEL = Path("compiler") / "kernels" / "prebuilt"

NO_TORCH = (
    "kiln CPU kernels: torch is not importable in this build environment (pip's build isolation), so "
    "this wheel ships no C++ CPU kernels and the first `kiln serve` compiles them (~1-2 min); with "
    "torch installed, `pip wheel --no-build-isolation .` (or `make wheel`) ships every ISA level's"
)


def torch_importable() -> bool:
    return importlib.util.find_spec("torch") is not None


def decide(editable: bool, has_torch: bool) -> str:
    """What the hook does: "editable" (nothing), "build" or "no-torch" (one line, no kernels)."""
    if editable:
        return "editable"
    return "build" if has_torch else "no-torch"


Runner = Callable[[list[str]], int]


def _run(cmd: list[str]) -> int:
    # (its lines pass through: the visible build step, shown by `pip -v` and `python -m build`)
    return subprocess.run(cmd, cwd=SOURCE_ROOT).returncode


def build(stage: Path = STAGE, run: Runner = _run) -> dict[str, Path]:
    """Build every ISA level's libraries that are missing under `stage`; returns each library's
    path inside a prebuilt folder -> its file (those that built, when some failed)."""
    with tempfile.TemporaryDirectory() as tmp:
        listing = Path(tmp) / "libraries.json"
        cmd = [sys.executable, "-m", "compiler.kernels.cpu_prebuild", "--all", "--into", str(stage)]
        rc = run([*cmd, "--manifest", str(listing)])
        found = json.loads(listing.read_text()) if listing.is_file() else {}
    if rc != 0:
        print(f"kiln CPU kernels: the build exited with {rc}; the wheel ships the {len(found)} libraries that built")
    return {rel: Path(path) for rel, path in found.items()}


def ship(libraries: dict[str, Path], build_lib: Path) -> list[Path]:
    """Copy the library files (not their object files or ninja state) into the wheel's tree, in
    place of any an earlier build left there (setuptools keeps build/lib: a stale key would ship)."""
    shutil.rmtree(build_lib / IN_WHEEL, ignore_errors=True)
    shipped = []
    for rel, path in sorted(libraries.items()):
        target = build_lib / IN_WHEEL / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(path, target)
        shipped.append(target)
    return shipped


def kernels_for_wheel(
    build_lib: Path, editable: bool, has_torch: bool, run: Runner = _run, stage: Path = STAGE
) -> list[Path]:
    """The hook: the libraries it put into `build_lib` (none for an editable install or without torch)."""
    what = decide(editable, has_torch)
    if what == "editable":
        return []
    if what == "no-torch":
        print(NO_TORCH)
        return []
    shipped = ship(build(stage, run), build_lib)
    print(f"kiln CPU kernels: {len(shipped)} C++ libraries in the wheel ({IN_WHEEL.as_posix()}/)")
    return shipped


def cmdclass() -> dict[str, type]:
    """setup.py's commands: build_py runs the hook; bdist_wheel tags a wheel that ships kernels
    for its platform (decided before the build, from whether torch is importable)."""
    try:
        from setuptools.command.bdist_wheel import bdist_wheel
    except ImportError:  # (a build without isolation in a venv that kept Python's own setuptools)
        raise SystemExit("kiln's wheel build needs setuptools>=70.1: pip install 'setuptools>=70.1'") from None
    from setuptools.command.build_py import build_py

    class BuildPy(build_py):
        def run(self) -> None:
            super().run()
            kernels_for_wheel(Path(self.build_lib), bool(self.editable_mode), torch_importable())

    class BdistWheel(bdist_wheel):
        def finalize_options(self) -> None:
            if torch_importable():  # machine code inside: a platform wheel, installed as such
                self.distribution.has_ext_modules = lambda: True  # type: ignore[method-assign]
            super().finalize_options()

        def get_tag(self) -> tuple[str, str, str]:
            impl, abi, plat = super().get_tag()
            # (any Python 3: the libraries link torch, not libpython)
            return (impl, abi, plat) if self.root_is_pure else ("py3", "none", plat)

    return {"build_py": BuildPy, "bdist_wheel": BdistWheel}
