"""The CPU's share of start-up (EngineBuilder's, engine/runtime/builder.py): the weights' final
form (2-byte copies of float32 weights that hold only 2-byte values, oneDNN's packed GEMM copies
where memory allows, huge pages under them) and the warm-up that loads the C++ kernels, so the
first request compiles and builds nothing. Each choice is logged with why."""

from __future__ import annotations

import logging
from typing import Any, Callable

import torch

from engine.config.settings import EngineSettings
from engine.runtime.startup_phase import Phase
from engine.worker import kv_sizing

logger = logging.getLogger(__name__)

# A CPU step's token budget where max_num_batched_tokens is not set (its default, 2048, is a GPU's), as
# llama.cpp's micro-batch (-ub 512): a step's activations are rows of every token in it, and 16 prompts of
# 128 tokens in one 2048-token step peaked 0.14-0.16 GB higher on a 1.2B GGUF model (issue 40: F16 3.13 ->
# 2.99 GB, 1.10x llama.cpp's). The trade: a dense bfloat16 model's GEMMs run more, smaller calls (its
# prompts of 16 x 128 tokens ~0.75x as fast, still ~4x llama.cpp's); quantised layers on the kernels cost
# per row either way (docs/benchmarks.md, "Memory beside the peers", session 24)
CPU_STEP_TOKENS = 512


def step_token_budget(s: EngineSettings) -> int:
    """The most tokens in one CPU step: max_num_batched_tokens where it was set, else CPU_STEP_TOKENS."""
    if "max_num_batched_tokens" in s.model_fields_set:
        return s.max_num_batched_tokens
    return min(s.max_num_batched_tokens, CPU_STEP_TOKENS)


def huge_page_advice() -> Callable[[list[torch.Tensor]], None]:
    """The loader's on_allocated: before the weights are written, their pages are advised to fault
    in as huge pages (no collapse copy later); one advice for the whole load (it keeps the
    mappings it read)."""
    from engine.worker.cpu_huge_pages import HugePageAdvice

    return HugePageAdvice()


def finish_weights(
    s: EngineSettings, model: Any, dtype: torch.dtype, extra_models: list[torch.nn.Module], huge_pages: bool
) -> None:
    """After loading, on one CPU process (no tensor parallelism): 2-byte weights, oneDNN's GEMM
    copies, and huge pages under every model's weights (the draft's too: extra_models)."""
    if s.cpu_half_weights:
        # (the layers' post-load hook: engine/layers/linear.py)
        changed, saved, head_saved = model.process_weights_after_loading(dtype, "half")
        if changed:
            logger.info(
                "%d float32 projection weights hold only 2-byte values: kept in 2 bytes (%.0f MB less "
                "per decode step; cpu_half_weights)",
                changed,
                saved / 1e6,
            )
        if head_saved:
            logger.info(
                "the LM head holds only 2-byte values: decode steps read a 2-byte copy (%.0f MB less "
                "per step, as much more in memory; cpu_half_weights)",
                head_saved / 1e6,
            )
    _keep_gemm_weights(model, dtype, s.cpu_gemm_packed_weights)
    if huge_pages:
        from engine.worker.cpu_huge_pages import back_with_huge_pages

        # (the weights only: collapsing a KV cache copies all of it at every start, for little)
        models = [model, *extra_models]
        back_with_huge_pages([t for m in models for t in (*m.parameters(), *m.buffers())], "weights")


def _keep_gemm_weights(model: Any, dtype: torch.dtype, setting: str) -> None:
    """oneDNN's blocked weight copies for GEMM rows, where cpu_gemm_packed_weights says so
    (engine/worker/cpu_gemm_weights.py; made by the layers' hook); the choice and why, logged."""
    from engine.worker import cpu_gemm_weights as gw

    wanted = gw.dense_weight_bytes(model, dtype)
    free = kv_sizing.read_free_memory()  # (MemAvailable, or less under a cgroup limit)
    keep, why = gw.gemm_weights_choice(setting, dtype, wanted, gw.has_amx(), free.bytes if free else 0)
    if not keep:
        logger.info("oneDNN weight copies for GEMM rows: off (%s)", why)
        return
    with Phase("packing oneDNN weight copies for GEMM rows"):
        made, nbytes, head_bytes = model.process_weights_after_loading(dtype, "gemm")
    made, nbytes = made + (head_bytes > 0), nbytes + head_bytes
    logger.info("oneDNN weight copies for GEMM rows: %d weights, %.0f MB more in memory (%s)", made, nbytes / 1e6, why)


def warm_cpu_linear(s: EngineSettings, runners: list[Any]) -> None:
    """oneDNN's shapes for the batch sizes serving will use, built now."""
    for runner in runners:
        warm = getattr(runner.model, "warm_cpu_linear", None)
        if warm is not None:
            warm(step_token_budget(s), s.max_num_seqs)


def warm_cpu_kernels(s: EngineSettings, runners: list[Any]) -> float:
    """Load (or, where the cache lacks them, build) the C++ kernels and run one padding decode
    step per runner (engine/worker/cpu_warmup.py). Returns seconds."""
    from engine.worker.cpu_warmup import warm_cpu_decode

    seconds = 0.0
    for runner in runners:
        fuse = getattr(runner.model, "use_cpu_fused_ops", None)
        if fuse is not None:  # fused norms / RoPE / SiLU (compiler/kernels/cpu_fused.py)
            fuse(s.resolved_compile_cache_dir())
        seconds += warm_cpu_decode(
            runner.model, runner.kv_cache.tensor, s.resolved_compile_cache_dir(), s.cpu_decoder_stack
        )
    return seconds


def library_builds() -> int:
    """The C++ CPU libraries this process has compiled so far (none where the install built them)."""
    from compiler.kernels.cpu_attention import KERNEL
    from compiler.kernels.cpu_fused import FUSED
    from compiler.kernels.cpu_gemv import GEMV

    return KERNEL.builds + FUSED.builds + GEMV.builds


def compiled_since(before: int) -> str:
    """What the warm-up line adds when this start compiled libraries (never "built ahead of time"
    for one it just compiled)."""
    n = library_builds() - before
    if n == 0:
        return ""
    libraries = "1 C++ library" if n == 1 else f"{n} C++ libraries"
    return f"; {libraries} compiled by this start (`kiln build-kernels --cpu` builds them at install)"
