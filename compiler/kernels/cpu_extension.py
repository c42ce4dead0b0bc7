"""Build and cache kiln's C++ CPU libraries (templates/cpu_*.cpp) with torch.utils.cpp_extension.

One place for what the CPU attention (compiler/kernels/cpu_attention.py) and the fused element-wise ops
(compiler/kernels/cpu_fused.py) share: the ISA flags, which follow torch's own CPU capability (never
-march=native, so one cache serves every machine of that capability), the cache key of everything
that changes the binary, where the library lives in the compile cache, and the build itself.

The libraries are built at install (compiler/kernels/cpu_prebuild.py: `make venv` builds this
CPU's into compiler/kernels/prebuilt/, a wheel ships every ISA level's there); a start that finds neither
the shipped library nor a cached one compiles it, once, and says so in one line.
"""

from __future__ import annotations

import hashlib
import logging
import os
import tempfile
import time
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

# A build lock older than this is a build that died (killed mid-compile): torch's builder would
# wait on it forever. (Builds take 10 s - 5 min on 2 busy cores.)
STALE_LOCK_SECONDS = 30 * 60

# What torch's own kernels for that capability may assume; never the build machine's whole ISA.
ISA_FLAGS = {
    "AVX512": ["-mavx2", "-mfma", "-mf16c", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq"],
    "AVX2": ["-mavx2", "-mfma", "-mf16c"],
}


def isa_flags(capability: str | None = None) -> list[str]:
    """The vector-ISA flags for a CPU of torch's `capability` (default: this one's)."""
    cap = capability or torch.backends.cpu.get_cpu_capability()
    return next((flags for name, flags in ISA_FLAGS.items() if cap.startswith(name)), [])


def cache_key(source: Path, flags: list[str], capability: str | None = None, includes: tuple[Path, ...] = ()) -> str:
    """A key of the source (and the files it includes), the flags, torch's version and the CPU capability."""
    parts = [
        source.read_text(),
        *(p.read_text() for p in includes),
        repr(flags),
        torch.__version__,
        capability or torch.backends.cpu.get_cpu_capability(),
    ]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:20]


# Libraries a wheel ships (cpu_prebuild.py --all --into this folder), found before the cache.
SHIPPED_DIR = Path(__file__).resolve().parent / "prebuilt"


def library_path(cache_dir: Path | None, kind: str, key: str) -> Path:
    """<cache_dir>/<kind>/kiln_<kind>_<key>/kiln_<kind>_<key>.so (a per-user temp dir without a
    cache dir); kind like "cpu-attention"."""
    directory = Path(cache_dir) if cache_dir else Path(tempfile.gettempdir()) / f"kiln-{kind}-{os.getuid()}"
    name = f"kiln_{kind.replace('-', '_')}_{key}"
    return directory / kind / name / f"{name}.so"


def find_library(cache_dir: Path | None, kind: str, key: str) -> Path:
    """The library to load: the one the package ships for this key, else the cache's (which the
    caller builds when it is missing)."""
    shipped = library_path(SHIPPED_DIR, kind, key)
    return shipped if shipped.is_file() else library_path(cache_dir, kind, key)


def log_runtime_build(what: str, path: Path) -> None:
    """The one line a start that compiles a library logs (the install step did not build it)."""
    logger.info(
        "compiling %s now: no library built at install for this CPU (%s) and torch %s "
        "(`make venv` or `python -m compiler.kernels.cpu_prebuild` builds them); cached in %s",
        what,
        torch.backends.cpu.get_cpu_capability(),
        torch.__version__,
        path.parent,
    )


def build(path: Path, source: Path, flags: list[str]) -> None:
    """Compile `source` into the library at `path` and load it (its TORCH_LIBRARY block registers
    the ops). ninja builds under a lock file in the build directory, so a concurrent start waits
    for the other's build."""
    from torch.utils.cpp_extension import load

    path.parent.mkdir(parents=True, exist_ok=True)
    clear_stale_lock(path.parent)
    load(
        name=path.stem,
        sources=[str(source)],
        extra_cflags=flags,
        extra_ldflags=["-fopenmp"],
        build_directory=str(path.parent),
        is_python_module=False,
        verbose=False,
    )


def clear_stale_lock(directory: Path, max_age: float = STALE_LOCK_SECONDS) -> bool:
    """Remove the build lock in `directory` when it is older than max_age (its build died).
    Returns whether it did."""
    lock = Path(directory) / "lock"
    try:
        age = time.time() - lock.stat().st_mtime
    except FileNotFoundError:
        return False
    if age < max_age:
        return False
    logger.warning("removing a build lock left %.0f min ago by a build that did not finish: %s", age / 60, lock)
    lock.unlink(missing_ok=True)
    return True
