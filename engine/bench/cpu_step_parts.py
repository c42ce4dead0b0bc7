"""`kiln bench cpu --step-parts / --decoder-stack`: where a decode step's time goes (split by
torch's profiler into linear layers, attention, fused ops, other ops and the host's own time), and
decode steps with the C++ decoder stack against the layers op by op."""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import torch

from engine.bench.cpu_threads_under_load import random_prompts

# Which part of a decode step an op's own time belongs to (by its name; first match wins).
STEP_PARTS = (
    (
        "linear",
        (
            "aten::mm",
            "aten::addmm",
            "aten::bmm",
            "mkldnn::",
            "aten::_weight_int",
            "gemv",
            "linear_pointwise",
            "kiln_quant",
            "int4",
            "int8",
        ),
    ),
    ("attention", ("kiln_cpu::", "kiln::paged", "kiln::write_kv", "attention")),
    ("fused norms/rope/act", ("kiln_cpu_fused::",)),
    ("other torch ops", ("",)),
)


def step_part(name: str) -> str:
    return next(part for part, keys in STEP_PARTS if any(k in name for k in keys))


def _timed_decode_steps(engine, batch: int, steps: int, input_len: int, tag: str) -> list[float]:
    """Wall seconds of `steps` decode steps of `batch` sequences, after a warm-up request set; the
    requests are left running (room for `steps` more decode steps)."""
    _start_decoding(engine, batch, steps, input_len, f"{tag}-warm")
    _drain(engine)
    _start_decoding(engine, batch, steps, input_len, tag)
    walls = []
    for _ in range(steps):
        t0 = time.perf_counter()
        engine.step()
        walls.append(time.perf_counter() - t0)
    return walls


def _start_decoding(engine, batch: int, steps: int, input_len: int, tag: str) -> None:
    """Queue `batch` requests and step through their prefill, to the first decode-only step."""
    from engine.core.params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=2 * steps + 4, ignore_eos=True, detokenize=False)
    for i, p in enumerate(random_prompts(batch, input_len, input_len, engine.model_config.vocab_size, 7)):
        engine.add_request(p, params, request_id=f"{tag}{i}")
    while True:
        engine.step()
        if engine.core.last_step.num_prompt_tokens == 0 and engine.core.last_step.num_generation_tokens > 0:
            return


def _drain(engine) -> None:
    while engine.core.has_unfinished_requests():
        engine.step()


def decode_step_ms(engine, batch: int, steps: int, input_len: int) -> float:
    """Median wall ms of `steps` decode steps of `batch` sequences (after a warm-up request set)."""
    walls = _timed_decode_steps(engine, batch, steps, input_len, "ds")
    _drain(engine)
    engine.core.check_integrity()
    return float(np.median(walls)) * 1e3


def decoder_stack(engine, batches: list[int], rounds: int, steps: int, input_len: int) -> dict[str, Any]:
    """Decode steps with the C++ decoder stack (engine/models/cpu_stack.py) vs the same model's
    layers op by op, same engine and weights, interleaved per round; also the stack with its
    thread team off (every projection fork/join on all threads) and, where the model has one, with
    the dense LM head instead of the GGUF-blocks head (`packed_head`)."""
    model = engine.core.runner.model
    stack = getattr(model, "cpu_stack", None)
    if stack is None:
        print("\ndecoder stack: off for this model (the start-up log says why); nothing to compare")
        return {}
    team_rows, head = stack.stack.team_rows(), model.packed_head

    def use(runner=stack, team: int = team_rows, packed=head) -> None:
        model.cpu_stack, model.packed_head = runner, packed
        stack.stack.set_team_rows(team)

    variants = {"stack": lambda: use(), "op by op": lambda: use(runner=None), "stack, fork/join": lambda: use(team=0)}
    if head is not None:
        variants["stack, dense head"] = lambda: use(packed=None)
    out: dict[str, Any] = {"rows": []}
    print(
        f"\ndecoder stack vs op by op ({torch.get_num_threads()} threads, {steps} decode steps per run, "
        f"{rounds} interleaved rounds, medians; thread team up to {team_rows} rows):"
    )
    try:
        for batch in batches:
            ms: dict[str, list[float]] = {label: [] for label in variants}
            for r in range(rounds):
                for label, setup in variants.items():
                    setup()
                    ms[label].append(decode_step_ms(engine, batch, steps, input_len))
                print(
                    f"  batch {batch}, round {r + 1}: "
                    + ", ".join(f"{k} {v[-1]:.2f}" for k, v in ms.items())
                    + " ms/step",
                    flush=True,
                )
            med = {k: float(np.median(v)) for k, v in ms.items()}
            row = {
                "batch": batch,
                "stack_ms": med["stack"],
                "op_by_op_ms": med["op by op"],
                "samples": ms,
                "speedup": med["op by op"] / med["stack"],
                "team_speedup": med["stack, fork/join"] / med["stack"],
            }
            extra = f", team / fork-join {row['team_speedup']:.2f}x"
            if head is not None:
                row["packed_head_speedup"] = med["stack, dense head"] / med["stack"]
                extra += f", GGUF-blocks head / dense head {row['packed_head_speedup']:.2f}x"
            out["rows"].append(row)
            print(
                f"  batch {batch}: stack {row['stack_ms']:.2f} ms/step, op by op {row['op_by_op_ms']:.2f} "
                f"ms/step -> {row['speedup']:.2f}x{extra}"
            )
    finally:
        use()
    return out


def step_parts(engine, batch: int, steps: int, input_len: int) -> dict[str, Any]:
    """Where one decode step of `batch` sequences spends its time (see --step-parts)."""
    from torch.profiler import ProfilerActivity, profile

    walls = _timed_decode_steps(engine, batch, steps, input_len, "sp")
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            engine.step()
    _drain(engine)
    engine.core.check_integrity()
    wall_us = float(np.median(walls)) * 1e6
    parts: dict[str, float] = {part: 0.0 for part, _ in STEP_PARTS}
    ops = 0
    for ev in prof.key_averages():
        if ev.key.startswith("ProfilerStep"):
            continue
        ops += ev.count
        parts[step_part(ev.key)] += ev.self_cpu_time_total / steps
    op_us = sum(parts.values())
    row = {
        "batch": batch,
        "step_us": wall_us,
        "ops_per_step": ops / steps,
        "parts_us": {**parts, "host (no op)": max(wall_us - op_us, 0.0)},
    }
    print(
        f"  batch {batch}: step {wall_us / 1e3:.2f} ms (median of {steps}, unprofiled), {row['ops_per_step']:.0f} "
        f"torch ops per step: "
        + ", ".join(f"{k} {v / 1e3:.2f} ms ({100 * v / wall_us:.0f}%)" for k, v in row["parts_us"].items())
    )
    return row
