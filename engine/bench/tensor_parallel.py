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
import time
from collections import defaultdict
from pathlib import Path
from typing import Any, Callable

from engine.distributed import step_codec as codec


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


def compare(settings, reqs, run_kiln: Callable) -> dict[str, Any]:
    """Run `reqs` at TP 1, then at settings.tensor_parallel_size; print and return the figures."""
    from engine.llm import LLM

    world = settings.tensor_parallel_size
    base = settings.model_dump(exclude_unset=True) | {"model": settings.model}
    warm = reqs[: max(1, len(reqs) // 8)]
    result: dict[str, Any] = {"model": settings.model, "num_requests": len(reqs), "tensor_parallel_size": world}
    for tp in (1, world):
        llm = LLM(**(base | {"tensor_parallel_size": tp}))
        try:
            run_kiln(llm, warm)  # warm-up
            executor = llm.engine.executor
            stats: dict[str, list[float]] = defaultdict(list)
            sent0 = dict(executor.sent) if executor else {}
            send0 = executor.send_seconds if executor else 0.0
            with timed_collectives(stats):
                seconds, tokens = run_kiln(llm, reqs)
            llm.engine.check_integrity()
            result[f"tp{tp}_seconds"] = seconds
            result[f"tp{tp}_tok_per_s"] = tokens / seconds
            print(f"tensor_parallel_size {tp}: {tokens} output tokens in {seconds:.2f}s = "
                  f"{tokens / seconds:.1f} tok/s", flush=True)
            if executor is not None:
                steps = executor.sent[codec.OP_FORWARD] - sent0.get(codec.OP_FORWARD, 0)
                messages = sum(executor.sent.values()) - sum(sent0.values())
                send_ms = (executor.send_seconds - send0) * 1e3
                result.update(steps=steps, messages_per_step=messages / max(1, steps),
                              broadcast_ms_per_step=send_ms / max(1, steps))
                print(f"  {steps} forward steps; step description: {messages / max(1, steps):.2f} messages "
                      f"and {send_ms / max(1, steps):.3f} ms per step (rank 0 broadcasts)")
                for name, times in sorted(stats.items()):
                    total_ms = sum(times) * 1e3
                    per_call = total_ms / max(1, len(times))
                    result[f"{name}_calls_per_step"] = len(times) / max(1, steps)
                    result[f"{name}_ms_per_call"] = per_call
                    result[f"{name}_ms_per_step"] = total_ms / max(1, steps)
                    print(f"  {name}: {len(times) / max(1, steps):.1f} calls per step, {per_call:.3f} ms per "
                          f"call, {total_ms / max(1, steps):.2f} ms per step")
        finally:
            if llm.engine.executor is not None:
                llm.engine.executor.shutdown()
            del llm
            gc.collect()
    result["ratio"] = result[f"tp{world}_tok_per_s"] / result["tp1_tok_per_s"]
    print(f"ratio tensor_parallel_size {world} / 1: {result['ratio']:.2f}x")
    return result


def main_tp(args, settings, workload: Callable, length_range: Callable, run_kiln: Callable) -> int:
    """`kiln bench throughput` with --tensor-parallel-size > 1 (no transformers baseline: the
    baseline is TP 1)."""
    from engine.models.config import ModelConfig
    from engine.models.loader import load_tokenizer

    config = ModelConfig.from_dir(Path(settings.model))
    vocab = min(config.vocab_size, len(load_tokenizer(settings.tokenizer or settings.model)))
    reqs = workload(args.num_requests, length_range(args.prompt_len), length_range(args.output_len), vocab,
                    args.workload_seed)
    result = compare(settings, reqs, run_kiln)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    return 0
