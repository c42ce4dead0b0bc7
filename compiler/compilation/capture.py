"""Compile the model's forward with Inductor and capture decode steps as CUDA graphs.

What is compiled
    The model forward (ids, positions, per-layer KV views, attention metadata) ->
    hidden states, with `torch.compile(fullgraph=True, dynamic=True)`. Attention and
    the KV write are opaque custom ops (compiler/kernels/ops.py), so Dynamo sees one graph
    per layer stack and never traces into them. The token and sequence dimensions,
    and the host ints `max_query_len` / `max_seq_len`, are symbolic; the KV cache
    and the block-table width are marked static (`mark_static_dims`). Dynamo
    specialises sizes 0 and 1, so the runner pads every compiled step of two or more
    tokens to at least two sequences (a padding row has slot -1 and length 0) and passes
    `max_seq_len >= 2`. That leaves exactly three compiled graphs: one token (batch-1
    decode, fully static shapes), decode-shaped steps (`max_query_len == 1`, batch
    symbolic) and everything else; `compile_count()` lets tests check that nothing
    recompiles per step.

What is captured (CUDA only)
    `CudaGraphSet` holds one graph per key (rows, ctx) of a caller-supplied body that
    runs one step over static buffers and returns its outputs. All graphs share one
    memory pool and are captured largest first, so the smaller graphs reuse the
    larger ones' intermediate memory. Before capture, the body runs once on a side
    stream (lazy Triton loading and autotuning must not happen inside a capture).
    Replay runs no Python beyond `graph.replay()`; the caller writes the step's values
    into the static buffers in place beforehand.

Nothing here imports `engine`: the body is a plain callable.
"""

from __future__ import annotations

import logging
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable, Sequence

import torch

logger = logging.getLogger(__name__)

# Multi-token compiled steps have >= this many sequences: size 1 makes Dynamo specialise (recompile).
MIN_COMPILED_ROWS = 2
# Reference-attention graphs: context buckets are powers of two from here up.
MIN_GRAPH_CTX = 256


# ---- compile ---------------------------------------------------------------------------
def configure_compile_cache(path: Path, changed: bool) -> Path:
    """Turn on Inductor's persistent caches (FX graphs, AOTAutograd, Triton kernels) under `path`.

    Inductor reads its cache root only from the TORCHINDUCTOR_CACHE_DIR process variable; the
    engine sets it from its `compile_cache_dir` setting (engine/config/settings.py) before calling this,
    and says whether it changed, in which case the in-memory caches keyed to the previous root
    are dropped. A second start with the same directory and model reuses the compiled
    artefacts (Dynamo still traces).
    """
    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config

    path.mkdir(parents=True, exist_ok=True)
    inductor_config.fx_graph_cache = True
    functorch_config.enable_autograd_cache = True
    if changed:
        from torch._inductor.utils import clear_caches

        clear_caches()
    return path


def compile_forward(fn: Callable) -> Callable:
    """`torch.compile` a model forward: Inductor, one full graph, dynamic sizes."""
    # Several engines in one process (tests) each add at most two entries per code object.
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 32)
    return torch.compile(fn, backend="inductor", fullgraph=True, dynamic=True)


def mark_static_dims(tensors: Iterable[torch.Tensor], dims: Sequence[int] | None = None) -> None:
    """Tell Dynamo these sizes never change (no symbols, no duck-sizing with token counts)."""
    for t in tensors:
        for d in range(t.dim()) if dims is None else dims:
            torch._dynamo.mark_static(t, d)


def compile_count() -> int:
    """Graphs Dynamo has compiled in this process so far (all functions): for recompile checks.
    Where nothing imported Dynamo, nothing was compiled: 0, without importing it (Dynamo and the
    Triton it pulls in add ~0.1 GB to an eager CPU engine's memory, issue 40)."""
    if "torch._dynamo" not in sys.modules:
        return 0
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


# ---- graph keys ------------------------------------------------------------------------
def bucket_for(n: int, sizes: Sequence[int]) -> int | None:
    """Smallest capture size >= n (sizes sorted ascending), or None when n exceeds them all."""
    for s in sizes:
        if s >= n:
            return s
    return None


def graph_ctx(max_seq_len: int, max_model_len: int, device_reads_lengths: bool) -> int:
    """The `max_seq_len` a decode graph is captured with, for a step whose longest sequence is
    `max_seq_len`.

    A kernel that reads sequence lengths on the device (kiln's CUTLASS decode) needs only an
    upper bound, so one graph per bucket at max_model_len serves every step. The torch
    reference pads its gather to max_seq_len and bakes that into the graph, and at a large
    max_model_len one padded gather per layer would be both slow and huge; so those graphs
    are keyed by max_seq_len rounded up to a power of two (>= MIN_GRAPH_CTX), captured when
    first needed, at most 2x the work of the exact length.
    """
    if device_reads_lengths:
        return max_model_len
    ctx = MIN_GRAPH_CTX
    while ctx < max_seq_len:
        ctx *= 2
    return min(ctx, max_model_len)


# ---- CUDA graphs -----------------------------------------------------------------------
@dataclass
class CapturedGraph:
    key: tuple[int, int]
    graph: "torch.cuda.CUDAGraph"
    outputs: tuple[torch.Tensor, ...]
    seconds: float = 0.0


@dataclass
class CudaGraphSet:
    """Decode graphs keyed by (rows, ctx) (or (rows, ctx, query tokens per row): a verify step's),
    one shared memory pool.

    `body(*key)` runs one step over the first `rows` rows of the static buffers with
    attention bounded by `ctx`, and returns its output tensors (they stay valid until the
    next replay of the same graph; copy them into shared buffers inside the body to keep
    one set of outputs for all graphs).
    """

    body: Callable[[int, int], tuple[torch.Tensor, ...]]
    device: torch.device
    warmup_runs: int = 1
    graphs: dict[tuple[int, int], CapturedGraph] = field(default_factory=dict)
    capture_seconds: float = 0.0

    def __post_init__(self) -> None:
        self.pool = torch.cuda.graph_pool_handle()
        self.stream = torch.cuda.Stream(self.device)

    def __contains__(self, key: tuple[int, int]) -> bool:
        return key in self.graphs

    def __len__(self) -> int:
        return len(self.graphs)

    def capture(self, key: tuple[int, int]) -> CapturedGraph:
        """Warm the body up on a side stream, then record it into the shared pool.

        The warm-up really runs the step on whatever the static buffers hold: padding at
        start-up (slot -1, length 0: it writes only the null block), or the current step
        when a graph is captured on first use (re-running a step writes the same K/V again).
        """
        if key in self.graphs:
            return self.graphs[key]
        t0 = time.perf_counter()
        current = torch.cuda.current_stream(self.device)
        self.stream.wait_stream(current)
        with torch.cuda.stream(self.stream):
            for _ in range(self.warmup_runs):
                self.body(*key)
        current.wait_stream(self.stream)
        torch.cuda.synchronize(self.device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool, stream=self.stream, capture_error_mode="thread_local"):
            outputs = self.body(*key)
        torch.cuda.synchronize(self.device)
        seconds = time.perf_counter() - t0
        captured = CapturedGraph(key, graph, tuple(outputs), seconds)
        self.graphs[key] = captured
        self.capture_seconds += seconds
        return captured

    def capture_all(self, keys: Iterable[tuple[int, int]]) -> float:
        """Capture keys largest first (smaller graphs then reuse the pool); returns seconds."""
        t0 = time.perf_counter()
        for key in sorted(set(keys), key=lambda k: (k[1], k[0]), reverse=True):
            self.capture(key)
        return time.perf_counter() - t0

    def replay(self, key: tuple[int, int]) -> tuple[torch.Tensor, ...]:
        captured = self.graphs[key]
        captured.graph.replay()
        return captured.outputs


@dataclass
class SimulatedGraphSet(CudaGraphSet):
    """CudaGraphSet's interface without CUDA graphs: replay runs the body again (CPU tests)."""

    def __post_init__(self) -> None:
        self.pool = None
        self.stream = None

    def capture(self, key: tuple[int, int]) -> CapturedGraph:
        if key not in self.graphs:
            self.graphs[key] = CapturedGraph(key, None, ())
        return self.graphs[key]

    def replay(self, key: tuple[int, int]) -> tuple[torch.Tensor, ...]:
        self.graphs[key]  # KeyError when never captured, like the real thing
        return tuple(self.body(*key))
