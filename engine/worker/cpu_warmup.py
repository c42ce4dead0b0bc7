"""What the engine compiles on the CPU, and the start-up step that makes serving compile nothing.

Measured on the 2-core machine (benchmarks/2026-11-29.md, CPU, `kiln bench cpu --parts`): compiling the whole
forward with Inductor gives no faster decode than eager (the matmuls are MKL/oneDNN calls either
way) and costs a minute of cold start and ~15 s warm, and a recompile whenever max_model_len or
the thread count changes; the C++ paged attention (compiler/kernels/cpu_attention.py,
benchmarks/2026-11-29.md, CPU decode attention) is
many times faster than the gather + SDPA reference. So by default only the attention is compiled,
ahead of time (a shared library loaded in milliseconds on a warm start), and the forward runs
eagerly; `cpu_compile_forward` brings back the compiled forward.

The warm-up runs one padding decode step (two rows, slot -1, length 0: nothing is written or
read) through the model exactly as serving does, which loads the kernel (or builds it, first
start only) and initialises the BLAS paths before the first request arrives.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from compiler.kernels.cpu_attention import KERNEL
from engine.layers.attention.base import AttentionMetadata
from engine.worker.step_features import StepFeatures


@torch.inference_mode()
def warm_cpu_decode(
    model: torch.nn.Module, kv_cache: torch.Tensor, compile_cache_dir: Path, decoder_stack: bool = True
) -> float:
    """Load or build the CPU paged attention, build the C++ decoder stack where the model has one
    (decoder_stack: the cpu_decoder_stack setting) and run a padding decode step through the eager
    forward. Returns seconds."""
    t0 = time.perf_counter()
    KERNEL.configure(compile_cache_dir)
    KERNEL.load()
    if decoder_stack and hasattr(model, "use_cpu_stack"):
        model.use_cpu_stack()
    rows = 2
    ids = torch.zeros(rows, dtype=torch.int64)
    meta = AttentionMetadata(
        slot_mapping=torch.full((rows,), -1, dtype=torch.int64),
        query_start_loc=torch.arange(rows + 1, dtype=torch.int32),
        seq_lens=torch.zeros(rows, dtype=torch.int32),
        block_tables=torch.zeros(rows, 1, dtype=torch.int32),
        max_query_len=1,
        max_seq_len=1,
        num_decodes=rows,
    )
    hidden = model(ids, ids, kv_cache, meta, StepFeatures.for_model(model, rows, torch.device("cpu")).context(rows))
    model.compute_logits(hidden)
    return time.perf_counter() - t0
