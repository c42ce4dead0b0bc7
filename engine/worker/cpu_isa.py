"""KILN_CPU_ISA: run as a CPU with less than this one has (the levels and the variables it sets for
torch are in engine/config/process_env.py), to check or compare what such a CPU runs on this one.

`set_cpu_isa_limit()` runs from engine/__init__, before torch loads, and caps torch's own kernels
(ATen's dispatch, oneDNN, MKL read their variables once, at load). `apply_cpu_isa_limit()` runs at
engine start-up, before the weights load (the decoder stack takes its kernel level when it is
built): it caps kiln's weight-streaming kernels and logs both. With the limit below AVX-512, kiln's
choices that ask for AMX or native bf16 (cpu_dtype, cpu_gemm_weights) see neither, as torch's
capability no longer reports AVX-512.
"""

from __future__ import annotations

import logging
import sys

logger = logging.getLogger(__name__)

# What set_cpu_isa_limit found: the level, torch's variables in force, whether torch had loaded.
_LIMIT_STATE: dict = {"read": False, "level": None, "error": None, "torch": {}, "in_time": False}


def set_cpu_isa_limit() -> None:
    """Read KILN_CPU_ISA and cap torch's kernels at it, if torch has not loaded yet. A bad value is
    reported at engine start-up (apply_cpu_isa_limit), not at import."""
    from engine.config.process_env import cpu_isa_limit, export_torch_isa_limit

    if _LIMIT_STATE["read"]:
        return
    _LIMIT_STATE.update(read=True, in_time="torch" not in sys.modules)
    try:
        level = cpu_isa_limit()
    except ValueError as exc:
        _LIMIT_STATE["error"] = str(exc)
        return
    _LIMIT_STATE["level"] = level
    if level is not None and _LIMIT_STATE["in_time"]:
        _LIMIT_STATE["torch"] = export_torch_isa_limit(level)


def apply_cpu_isa_limit() -> str | None:
    """Cap kiln's weight-streaming kernels at KILN_CPU_ISA and log the limit (None: no limit)."""
    import torch

    from compiler.kernels import cpu_gemv

    set_cpu_isa_limit()  # (engine/__init__ has; here for a process that imported this module first)
    if _LIMIT_STATE["error"]:
        raise ValueError(_LIMIT_STATE["error"])
    level = _LIMIT_STATE["level"]
    cpu_gemv.GEMV.limit(level)
    if level is None:
        return None
    capability = torch.backends.cpu.get_cpu_capability()
    if _LIMIT_STATE["in_time"]:
        torch_vars = ", ".join(f"{k}={v}" for k, v in _LIMIT_STATE["torch"].items())
        logger.info("KILN_CPU_ISA=%s: kiln's CPU kernels run at most %s; torch's at %s (%s)", level, level,
                    capability, torch_vars)
    else:
        logger.warning("KILN_CPU_ISA=%s: kiln's CPU kernels run at most %s, but torch was imported before kiln "
                       "and its own kernels run at %s (set KILN_CPU_ISA before starting)", level, level, capability)
    return level
