"""KILN_CPU_ISA: run as a CPU with less than this one has (the levels and the variables it sets for
torch are in engine/config/process_env.py), to check or compare what such a CPU runs on this one.

`prepare_process()` (engine/config/process_setup.py) caps torch's own kernels before torch loads
(ATen's dispatch, oneDNN, MKL read their variables once, at load). `apply_cpu_isa_limit()` runs at
engine start-up, before the weights load (the decoder stack takes its kernel level when it is
built): it caps kiln's weight-streaming kernels and logs both. With the limit below AVX-512, kiln's
choices that ask for AMX or native bf16 (cpu_dtype, cpu_gemm_weights) see neither, as torch's
capability no longer reports AVX-512.
"""

from __future__ import annotations

import logging

from engine.config.process_setup import prepare_process

logger = logging.getLogger(__name__)


def apply_cpu_isa_limit() -> str | None:
    """Cap kiln's weight-streaming kernels at KILN_CPU_ISA and log the limit (None: no limit)."""
    import torch

    from compiler.kernels import cpu_gemv

    setup = prepare_process()  # (the entry point has; here it returns what it decided)
    if setup.cpu_isa_error:
        raise ValueError(setup.cpu_isa_error)
    level = setup.cpu_isa
    cpu_gemv.GEMV.limit(level)
    if level is None:
        return None
    capability = torch.backends.cpu.get_cpu_capability()
    if setup.before_torch:
        torch_vars = ", ".join(f"{k}={v}" for k, v in setup.torch_isa.items())
        logger.info(
            "KILN_CPU_ISA=%s: kiln's CPU kernels run at most %s; torch's at %s (%s)",
            level,
            level,
            capability,
            torch_vars,
        )
    else:
        logger.warning(
            "KILN_CPU_ISA=%s: kiln's CPU kernels run at most %s, but torch was imported before kiln "
            "and its own kernels run at %s (set KILN_CPU_ISA before starting)",
            level,
            level,
            capability,
        )
    return level
