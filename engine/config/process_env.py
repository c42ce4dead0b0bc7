"""The process environment kiln writes for what reads it there: Inductor's cache root, the OpenMP
wait policy (read once when torch loads), and the environment of child processes. With
settings.py and sources.py, the only modules that touch os.environ."""

from __future__ import annotations

import os
from pathlib import Path


def export_compile_cache_dir(path: Path) -> tuple[Path, bool]:
    """Point Inductor's cache root (read only from the process environment) at `path`.

    Returns the resolved path and whether it changed.
    """
    resolved = Path(path).expanduser().resolve()
    changed = os.environ.get("TORCHINDUCTOR_CACHE_DIR") != str(resolved)
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(resolved)
    return resolved, changed


def child_environment(extra: dict[str, str]) -> dict[str, str]:
    """This process's environment plus `extra`, for a child process (kiln serve-replicas)."""
    return {**os.environ, **extra}


def openmp_wait_set_by_user() -> bool:
    """Whether the environment already sets OMP_WAIT_POLICY or GOMP_SPINCOUNT."""
    return "OMP_WAIT_POLICY" in os.environ or "GOMP_SPINCOUNT" in os.environ


def export_openmp_spin(spin_count: str | None) -> str:
    """Let idle OpenMP threads spin `spin_count` rounds, then sleep (None: leave the environment as
    it is; libgomp, torch's CPU runtime, reads this once, when torch loads). Returns the wait
    policy in force, in words."""
    if spin_count is not None:
        os.environ["GOMP_SPINCOUNT"] = spin_count
    policy = os.environ.get("OMP_WAIT_POLICY", "")
    if not policy and "GOMP_SPINCOUNT" in os.environ:
        policy = f"spin {os.environ['GOMP_SPINCOUNT']} then sleep"
    return policy
