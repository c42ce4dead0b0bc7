"""The process environment kiln writes for what reads it there: Inductor's cache root, the OpenMP
wait policy and the instruction-set limit (both read once when torch loads), and the environment of
child processes. With settings.py and sources.py, the only modules that touch os.environ."""

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


# KILN_CPU_ISA: the highest x86 instruction-set level the process uses, to check or compare what a
# lesser CPU runs on this one (as a llama.cpp build variant, or oneDNN's ONEDNN_MAX_CPU_ISA). kiln's
# weight-streaming kernels stop at that level, and torch's own kernels are capped through their
# variables, read once, when torch loads: ATen's kernel dispatch, oneDNN, MKL.
TORCH_ISA_LIMITS = {  # level: ATEN_CPU_CAPABILITY, ONEDNN_MAX_CPU_ISA, MKL_ENABLE_INSTRUCTIONS
    "generic": ("default", "SSE41", "SSE4_2"),
    "avx2": ("avx2", "AVX2", "AVX2"),
    "avx2_vnni": ("avx2", "AVX2_VNNI", "AVX2"),
    "avx512": ("avx512", "AVX512_CORE", "AVX512"),
    "avx512_vnni": ("avx512", "AVX512_CORE_VNNI", "AVX512"),
}
CPU_ISA_LEVELS = tuple(TORCH_ISA_LIMITS)  # (compiler/kernels/cpu_gemv.py LEVELS, in order)
TORCH_ISA_VARIABLES = ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS")


def cpu_isa_limit() -> str | None:
    """KILN_CPU_ISA, one of CPU_ISA_LEVELS; None where unset or "auto"."""
    value = os.environ.get("KILN_CPU_ISA", "").strip().lower()
    if value in ("", "auto"):
        return None
    if value not in CPU_ISA_LEVELS:
        raise ValueError(f"KILN_CPU_ISA={value!r} is not one of auto, {', '.join(CPU_ISA_LEVELS)}")
    return value


def onednn_isa_limit() -> str:
    """ONEDNN_MAX_CPU_ISA as the process has it ("" where unset): part of what a measurement of
    oneDNN's speed on this machine depends on."""
    return os.environ.get("ONEDNN_MAX_CPU_ISA", "")


def export_torch_isa_limit(level: str) -> dict[str, str]:
    """Cap torch's kernels at `level` (a variable the user set is kept). Returns the variables in force."""
    for name, value in zip(TORCH_ISA_VARIABLES, TORCH_ISA_LIMITS[level]):
        os.environ.setdefault(name, value)
    return {name: os.environ[name] for name in TORCH_ISA_VARIABLES}


def client_api_key() -> str | None:
    """The API key a client of a kiln server sends when none is given (`kiln chat --url`):
    KILN_API_KEY, else OPENAI_API_KEY, as the openai client reads it."""
    return os.environ.get("KILN_API_KEY") or os.environ.get("OPENAI_API_KEY")
