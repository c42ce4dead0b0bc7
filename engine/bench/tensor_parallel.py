"""`kiln bench throughput --tensor-parallel-size N`: the same workload at TP 1 and at TP N, in one run.

Prints both throughputs and their ratio. On the CPU (gloo) this measures the cost of tensor
parallelism rather than a speed-up: the ranks share the cores, and every step pays the step
broadcast and the model's collectives. Those are measured in the TP N run on rank 0: the
collectives by timing each `torch.distributed.all_reduce` / `all_gather` call the model makes
(wall time, so it includes waiting for the slower rank), the step description by the executor's
own counters.
"""

from __future__ import annotations

import contextlib
import gc
import json
import statistics
import time
from collections import defaultdict
from pathlib import Path
from typing import Any, Callable

import torch

from engine.executor import step_codec as codec


@contextlib.contextmanager
def timed_collectives(stats: dict[str, list[float]]):
    """Time every all_reduce / all_gather called through torch.distributed while inside."""
    import torch.distributed as dist

    originals = {name: getattr(dist, name) for name in ("all_reduce", "all_gather")}

    def timed(name: str, fn: Callable) -> Callable:
        def call(*args: Any, **kwargs: Any):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                stats[name].append(time.perf_counter() - t0)

        return call

    for name, fn in originals.items():
        setattr(dist, name, timed(name, fn))
    try:
        yield stats
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)


ROUNDS = 3  # timed runs of each engine, alternated (a shared machine's load drifts between them)


def compare(settings, reqs, run_kiln: Callable) -> dict[str, Any]:
    """Run `reqs` on a TP 1 and a TP N engine (both built up front), alternating ROUNDS times;
    print and return the median throughputs, their ratio and the TP N step costs."""
    from engine.entrypoints.llm import LLM

    world = settings.tensor_parallel_size
    base = settings.model_dump(exclude_unset=True) | {"model": settings.model}
    warm = reqs[: max(1, len(reqs) // 8)]
    result: dict[str, Any] = {
        "model": settings.model,
        "num_requests": len(reqs),
        "tensor_parallel_size": world,
        "rounds": ROUNDS,
    }
    engines = {}
    try:
        for tp in (1, world):
            engines[tp] = LLM(**(base | {"tensor_parallel_size": tp}))
            run_kiln(engines[tp], warm)  # warm-up
        rates: dict[int, list[float]] = {1: [], world: []}
        executor = engines[world].engine.core.executor
        stats: dict[str, list[float]] = defaultdict(list)
        steps = messages = 0
        send_s = 0.0
        for _ in range(ROUNDS):
            for tp, llm in engines.items():
                if llm.engine.core.device.type == "cpu":  # the thread count is per process: each engine's own
                    torch.set_num_threads(llm.engine.core.cpu_threads.threads)
                if tp == 1:
                    seconds, tokens, _ = run_kiln(llm, reqs)
                else:
                    sent0, send0 = dict(executor.sent), executor.send_seconds
                    with timed_collectives(stats):
                        seconds, tokens, _ = run_kiln(llm, reqs)
                    steps += executor.sent[codec.OP_FORWARD] - sent0.get(codec.OP_FORWARD, 0)
                    messages += sum(executor.sent.values()) - sum(sent0.values())
                    send_s += executor.send_seconds - send0
                llm.engine.core.check_integrity()
                rates[tp].append(tokens / seconds)
                print(
                    f"tensor_parallel_size {tp}: {tokens} output tokens in {seconds:.2f}s = "
                    f"{tokens / seconds:.1f} tok/s",
                    flush=True,
                )
    finally:
        for llm in engines.values():
            if llm.engine.core.executor is not None:
                llm.engine.core.executor.shutdown()
        engines.clear()
        gc.collect()
    for tp, values in rates.items():
        result[f"tp{tp}_tok_per_s"] = statistics.median(values)
        result[f"tp{tp}_tok_per_s_runs"] = values
    per_step = max(1, steps)
    result.update(
        steps_per_run=steps / ROUNDS,
        messages_per_step=messages / per_step,
        broadcast_ms_per_step=send_s * 1e3 / per_step,
    )
    print(
        f"tensor_parallel_size {world}, per forward step (medians of {ROUNDS} runs above; these over all "
        f"{steps} steps): step description {messages / per_step:.2f} messages, "
        f"{send_s * 1e3 / per_step:.3f} ms (rank 0 broadcasts)"
    )
    for name, times in sorted(stats.items()):
        total_ms = sum(times) * 1e3
        per_call = total_ms / max(1, len(times))
        result.update(
            {
                f"{name}_calls_per_step": len(times) / per_step,
                f"{name}_ms_per_call": per_call,
                f"{name}_ms_per_step": total_ms / per_step,
            }
        )
        print(
            f"  {name}: {len(times) / per_step:.1f} calls per step, {per_call:.3f} ms per call, "
            f"{total_ms / per_step:.2f} ms per step"
        )
    result["ratio"] = result[f"tp{world}_tok_per_s"] / result["tp1_tok_per_s"]
    print(f"ratio tensor_parallel_size {world} / 1 (median tok/s): {result['ratio']:.2f}x")
    return result


def main_tp(args, settings, workload: Callable, length_range: Callable, run_kiln: Callable) -> int:
    """`kiln bench throughput` with --tensor-parallel-size > 1 (no transformers baseline: the
    baseline is TP 1)."""
    from engine.models.config import ModelConfig
    from engine.models.loader.model_loader import load_tokenizer

    config = ModelConfig.from_dir(Path(settings.model))
    vocab = min(config.vocab_size, len(load_tokenizer(settings.tokenizer or settings.model)))
    reqs = workload(
        args.num_requests, length_range(args.prompt_len), length_range(args.output_len), vocab, args.workload_seed
    )
    result = compare(settings, reqs, run_kiln)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    return 0
