"""`kiln bench cpu`: thread settings under load, what compiling pays, batch-1 speed, warm start.

    kiln bench cpu --model DIR                       # threads x neighbour, batch 1 and throughput
    kiln bench cpu --model DIR --baseline --parts --startup --json out.json

One engine (the default settings: eager forward, the C++ paged attention) is driven under
each thread setting -- the default plan (engine/worker/cpu_threads.py), 1, 2 and every available core --
first on a quiet machine and then next to a CPU-burning neighbour process that the benchmark
starts and stops (it also ends by itself after --neighbour-seconds). Per setting: batch-1 decode
(median ms per step after the prefill) and the throughput of --requests requests (generated
tokens per second, end to end). Each number is printed with its ratio to the best setting of the
same run, and the check the issue asks for: with the neighbour running, the default is within
1.3x of the best.

--baseline: transformers' `generate` (eager, sdpa) on the same weights and threads, batch 1, in
the same process (ratio = its ms per token / kiln's; >= 1.0 means kiln is at least as fast).
--parts: compiled vs eager per part: the decode attention op alone (C++ kernel vs the gather +
SDPA reference) at a few batch/context sizes, and batch-1 decode of the engine with the
reference attention (enforce_eager) vs the default.
--startup: wall time from process start to the first generated token, twice in fresh processes
(the first may build the kernel; the second is the warm-cache start).
--step-parts: where a decode step's time goes, at batch 1 (and --step-parts-batch): the median
step's wall time, unprofiled, split by torch's profiler into the linear layers (GEMM/GEMV and the
quantised kernels), attention (the C++ paged attention and KV writes), the fused norms/RoPE/SiLU,
other torch ops, and the rest: the host's Python (modules, dispatch, scheduler, sampler glue) and
the threads' wake-ups, i.e. wall time no op accounts for. Also the torch ops per step.

The machine may be shared: only ratios within one run mean anything.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

BURNER = "import sys, time\nend = time.time() + float(sys.argv[1])\nx = 0\nwhile time.time() < end:\n    x += 1\n"


class Neighbour:
    """CPU-burning processes (one busy loop each), bounded twice: stopped on exit, and each ends by
    itself after `seconds` anyway."""

    def __init__(self, procs: int, seconds: float) -> None:
        self.procs, self.seconds = procs, seconds
        self.running: list[subprocess.Popen] = []

    def __enter__(self) -> "Neighbour":
        for _ in range(self.procs):
            self.running.append(subprocess.Popen([sys.executable, "-c", BURNER, str(self.seconds)]))
        time.sleep(0.5)  # let the scheduler see them busy
        return self

    def __exit__(self, *exc) -> None:
        for p in self.running:
            p.kill()
        for p in self.running:
            p.wait(timeout=10)
        self.running.clear()


def thread_settings(requested: str, available: int, default: int) -> list[tuple[str, int]]:
    """(label, threads) for 'default,1,2,all'-style lists; repeats of a count are kept once,
    under the first label (so 'all' on a 2-core machine folds into '2')."""
    out: list[tuple[str, int]] = []
    seen: set[int] = set()
    for item in requested.split(","):
        item = item.strip()
        if not item:
            continue
        n = default if item == "default" else available if item == "all" else int(item)
        n = max(1, n)
        if n in seen:
            continue
        seen.add(n)
        label = f"default ({n})" if item == "default" else f"all ({n})" if item == "all" else str(n)
        out.append((label, n))
    return out


def _prompts(n: int, lo: int, hi: int, vocab: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(5, vocab, size=int(rng.integers(lo, hi + 1))).tolist() for _ in range(n)]


def batch1(engine, args) -> float:
    """Median ms per decode step of one request."""
    from engine.bench.latency import run_kiln

    vocab = engine.model_config.vocab_size
    run_kiln(engine, _prompts(1, args.input_len, args.input_len, vocab, 1), 3, "warm")
    res = run_kiln(engine, _prompts(1, args.input_len, args.input_len, vocab, 2), args.batch1_tokens, "b1")
    return float(np.median(res["step_s"]) * 1e3)  # each decode step's host interval


def throughput(engine, args, requests: int | None = None, output_len: int | None = None) -> float:
    """Generated tokens per second for --requests requests, all queued at once."""
    from engine.core.params import SamplingParams

    vocab = engine.model_config.vocab_size
    prompts = _prompts(requests or args.requests, max(1, args.input_len // 2), args.input_len, vocab, 3)
    params = SamplingParams(
        temperature=0.0, max_tokens=output_len or args.output_len, ignore_eos=True, detokenize=False
    )
    for i, p in enumerate(prompts):
        engine.add_request(p, params, request_id=f"tp{i}")
    t0 = time.perf_counter()
    generated = 0
    while engine.core.has_unfinished_requests():
        engine.step()
        generated += engine.core.last_step.num_generation_tokens
    seconds = time.perf_counter() - t0
    engine.core.check_integrity()
    return generated / seconds


def run_settings(engine, settings: list[tuple[str, int]], args, neighbour: bool) -> list[dict[str, Any]]:
    """Every setting once per round, --rounds rounds, medians per setting: a change in the machine's
    load during the run then hits all settings alike."""
    samples: dict[str, dict[str, list[float]]] = {label: {"b1": [], "tp": []} for label, _ in settings}
    for r in range(args.rounds):
        for label, n in settings:
            torch.set_num_threads(n)  # what apply_cpu_threads does without pinning, minus its log line
            ms = batch1(engine, args)
            samples[label]["b1"].append(ms)
            who = "with" if neighbour else "no  "
            line = f"  round {r + 1}, {who} neighbour, threads {label:>11}: batch-1 {ms:8.2f} ms/token"
            if args.requests > 0:
                throughput(engine, args, requests=engine.settings.max_num_seqs, output_len=2)  # warm the big batches
                tps = throughput(engine, args)
                samples[label]["tp"].append(tps)
                line += f", {args.requests} requests {tps:8.1f} tok/s"
            print(line, flush=True)
    rows = []
    for label, n in settings:
        row = {
            "setting": label,
            "threads": n,
            "neighbour": neighbour,
            "batch1_ms": float(np.median(samples[label]["b1"])),
        }
        if args.requests > 0:
            row["throughput_tok_s"] = float(np.median(samples[label]["tp"]))
        rows.append(row)
    best_ms = min(r["batch1_ms"] for r in rows)
    best_tp = max((r.get("throughput_tok_s", 0.0) for r in rows), default=0.0)
    for r in rows:
        r["batch1_vs_best"] = r["batch1_ms"] / best_ms
        if args.requests > 0:
            r["throughput_vs_best"] = best_tp / r["throughput_tok_s"]
    return rows


def print_table(rows: list[dict[str, Any]]) -> None:
    print("\n| neighbour | threads | batch-1 ms/token | x best | throughput tok/s | x best |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        tp = f"{r['throughput_tok_s']:.1f} | {r['throughput_vs_best']:.2f}" if "throughput_tok_s" in r else "- | -"
        print(
            f"| {'yes' if r['neighbour'] else 'no'} | {r['setting']} | {r['batch1_ms']:.2f} | "
            f"{r['batch1_vs_best']:.2f} | {tp} |"
        )


def check_default(rows: list[dict[str, Any]]) -> bool:
    """With the neighbour running, the default setting is within 1.3x of the best (both measures)."""
    ok = True
    for r in rows:
        if r["neighbour"] and r["setting"].startswith("default"):
            worst = max(r["batch1_vs_best"], r.get("throughput_vs_best", 1.0))
            ok = worst <= 1.3
            print(
                f"\ndefault with the neighbour: {worst:.2f}x of the best setting "
                f"({'within' if ok else 'NOT within'} 1.3x)"
            )
    return ok


def baseline(engine, args) -> dict[str, float]:
    """transformers generate vs kiln, batch 1, same weights and threads, in this process."""
    from engine.bench.latency import build_hf_model, run_hf, run_kiln

    hf = build_hf_model(engine)
    vocab = engine.model_config.vocab_size
    prompt = _prompts(1, args.input_len, args.input_len, vocab, 4)
    n = args.batch1_tokens
    rounds = []
    for _ in range(args.baseline_rounds):  # interleaved, so load changes hit both alike
        res = run_kiln(engine, prompt, n, "base")
        kiln_ms = res["total_s"] / n * 1e3  # prefill included, as in generate's time
        hf_s, hf_tokens = run_hf(hf, prompt, n, engine.core.device)
        hf_ms = hf_s / n * 1e3
        rounds.append((kiln_ms, hf_ms, res["tokens"][0] == hf_tokens[0]))
    kiln_ms = float(np.median([r[0] for r in rounds]))
    hf_ms = float(np.median([r[1] for r in rounds]))
    out = {
        "kiln_ms": kiln_ms,
        "hf_ms": hf_ms,
        "ratio": hf_ms / kiln_ms,
        "same_tokens": all(r[2] for r in rounds),
        "threads": torch.get_num_threads(),
    }
    print(
        f"\nbatch 1 vs transformers generate ({torch.get_num_threads()} threads, {n} tokens, median of "
        f"{len(rounds)} interleaved rounds): kiln {kiln_ms:.2f} ms/token, transformers {hf_ms:.2f} ms/token "
        f"(both end to end, prefill included, per token) -> kiln {out['ratio']:.2f}x; greedy tokens "
        f"{'identical' if out['same_tokens'] else 'DIFFER'}"
    )
    return out


def parts(engine, args) -> dict[str, Any]:
    """Compiled vs eager per part, in this run."""
    from compiler.kernels.cpu_attention import paged_attention_cpu_impl
    from compiler.kernels.reference_attention import paged_attention_reference
    from engine.config.settings import EngineSettings
    from engine.runtime.llm_engine import LLMEngine

    cfg = engine.model_config
    bs = engine.settings.block_size
    out: dict[str, Any] = {"attention": []}
    print("\ncompiled vs eager, per part:")

    def timed(fn, reps: int = 10) -> float:
        fn()
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        return (time.perf_counter() - t0) / reps * 1e3

    g = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        for batch, ctx in ((1, 128), (1, 1024), (16, 512), (64, 512)):
            blocks = batch * (ctx // bs) + 1
            kv = torch.randn(2, blocks, bs, cfg.num_kv_heads, cfg.head_dim, generator=g)
            q = torch.randn(batch, cfg.num_heads, cfg.head_dim, generator=g)
            tables = torch.arange(1, blocks, dtype=torch.int32).view(batch, -1)
            lens = torch.full((batch,), ctx, dtype=torch.int32)
            qsl = torch.arange(batch + 1, dtype=torch.int32)
            scale = cfg.head_dim**-0.5

            out_buf = torch.empty_like(q)

            def fused():
                paged_attention_cpu_impl(out_buf, q, kv[None], 0, qsl, lens, tables, scale, 1, ctx, batch)

            def reference():
                return paged_attention_reference(q, kv[0], kv[1], qsl, lens, tables, scale, 1, ctx, batch)

            row = {"batch": batch, "ctx": ctx, "compiled_ms": timed(fused), "reference_ms": timed(reference)}
            row["speedup"] = row["reference_ms"] / row["compiled_ms"]
            out["attention"].append(row)
            print(
                f"  decode attention, one layer, batch {batch:3d}, context {ctx:5d}: C++ kernel "
                f"{row['compiled_ms']:.3f} ms, reference {row['reference_ms']:.3f} ms -> {row['speedup']:.2f}x"
            )
    eager = LLMEngine.from_settings(EngineSettings(**{**engine.settings.model_dump(), "enforce_eager": True}))
    ref_ms, ours_ms = batch1(eager, args), batch1(engine, args)
    del eager
    out["batch1_reference_attention_ms"], out["batch1_default_ms"] = ref_ms, ours_ms
    print(
        f"  whole model, batch 1: eager forward + reference attention {ref_ms:.2f} ms/token, eager forward + "
        f"compiled attention (default) {ours_ms:.2f} ms/token -> {ref_ms / ours_ms:.2f}x"
    )
    return out


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
    for i, p in enumerate(_prompts(batch, input_len, input_len, engine.model_config.vocab_size, 7)):
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


STARTUP = """
import time
t0 = time.time()
from engine import LLM, SamplingParams
llm = LLM(**{settings!r})
out = llm.generate(["hello"], SamplingParams(max_tokens=1, temperature=0.0), use_tqdm=False)
print("FIRST_TOKEN", time.time() - {start!r}, llm.engine.core.compile_seconds)
"""


def startup(settings: dict[str, Any]) -> list[float]:
    """Process start to first token, twice (the second with a warm compile cache)."""
    times = []
    for i in range(2):
        start = time.time()
        code = STARTUP.format(settings=settings, start=start)
        res = subprocess.run(
            [sys.executable, "-c", code],
            capture_output=True,
            text=True,
            timeout=1800,
            cwd=str(Path(__file__).resolve().parents[2]),
        )
        line = [ln for ln in res.stdout.splitlines() if ln.startswith("FIRST_TOKEN")]
        if res.returncode != 0 or not line:
            raise RuntimeError(f"start-up run failed: {res.stderr[-2000:]}")
        total, compile_s = map(float, line[0].split()[1:])
        times.append(total)
        print(
            f"  start {i + 1} ({'maybe cold' if i == 0 else 'warm cache'}): first token after {total:.2f}s "
            f"(of which kernel load/build + warm-up {compile_s:.2f}s)",
            flush=True,
        )
    return times


def build_parser() -> argparse.ArgumentParser:
    from engine.entrypoints.cli.flags import add_settings_flags

    p = argparse.ArgumentParser(
        prog="kiln bench cpu", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--threads", default="default,1,2,all", help="settings to compare (default, all, or counts)")
    p.add_argument("--no-neighbour", action="store_true", help="skip the runs next to a CPU-burning process")
    p.add_argument("--neighbour-procs", type=int, default=1, help="busy-loop processes of the neighbour")
    p.add_argument("--neighbour-seconds", type=float, default=900.0, help="the neighbour ends by itself after this")
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds over the settings (medians)")
    p.add_argument("--input-len", type=int, default=32)
    p.add_argument("--batch1-tokens", type=int, default=32, help="tokens generated in the batch-1 run")
    p.add_argument("--requests", type=int, default=256, help="throughput run: requests queued at once (0: skip)")
    p.add_argument("--output-len", type=int, default=16, help="throughput run: tokens per request")
    p.add_argument("--baseline", action="store_true", help="batch 1 against transformers generate")
    p.add_argument("--baseline-rounds", type=int, default=3)
    p.add_argument("--parts", action="store_true", help="compiled vs eager per part")
    p.add_argument("--startup", action="store_true", help="process start to first token, twice")
    p.add_argument("--step-parts", action="store_true", help="where a decode step's time goes (profiled)")
    p.add_argument("--step-parts-batch", default="1,16", help="batch sizes for --step-parts (default 1,16)")
    p.add_argument("--step-parts-steps", type=int, default=20, help="decode steps timed per batch size")
    p.add_argument(
        "--decoder-stack",
        action="store_true",
        help="decode steps with the C++ decoder stack vs the layers op by op, interleaved",
    )
    p.add_argument("--decoder-stack-batch", default="1,16", help="batch sizes for --decoder-stack (default 1,16)")
    p.add_argument("--decoder-stack-rounds", type=int, default=5)
    p.add_argument("--decoder-stack-steps", type=int, default=20, help="decode steps timed per run")
    p.add_argument("--json", type=Path, help="write the results here")
    add_settings_flags(p)
    return p


def main(argv: list[str]) -> int:
    from engine.config.process_setup import available_cores
    from engine.entrypoints.cli.flags import settings_from_args
    from engine.runtime.llm_engine import LLMEngine
    from engine.worker.cpu_threads import plan_threads

    args = build_parser().parse_args(argv)
    settings = settings_from_args(args)
    if settings.device == "cuda":
        print("kiln bench cpu: runs on the CPU (device=cpu)", file=sys.stderr)
        return 2
    settings = settings.model_copy(update={"device": "cpu", "log_stats_interval": 0})
    cores = available_cores()
    default = plan_threads(settings.cpu_threads, settings.cpu_bind, cores).threads
    results: dict[str, Any] = {"available_cores": len(cores), "default_threads": default}
    if args.startup:
        print("start-up (fresh processes):")
        results["startup_s"] = startup(settings.model_dump(mode="json", exclude_defaults=True))
    engine = LLMEngine.from_settings(settings)
    print(
        f"model {engine.model_dir}, {len(cores)} available cores, default plan {default} threads; "
        f"the machine may be shared with other jobs: compare ratios, not absolute numbers"
    )
    if args.baseline:
        results["baseline"] = baseline(engine, args)
    if args.parts:
        results["parts"] = parts(engine, args)
    if args.step_parts:
        print(f"\nwhere a decode step's time goes ({torch.get_num_threads()} threads, context {args.input_len}+):")
        results["step_parts"] = [
            step_parts(engine, int(b), args.step_parts_steps, args.input_len)
            for b in args.step_parts_batch.split(",")
            if b.strip()
        ]
    if args.decoder_stack:
        results["decoder_stack"] = decoder_stack(
            engine,
            [int(b) for b in args.decoder_stack_batch.split(",") if b],
            args.decoder_stack_rounds,
            args.decoder_stack_steps,
            args.input_len,
        )
    chosen = thread_settings(args.threads, len(cores), default)
    rows = run_settings(engine, chosen, args, neighbour=False)
    ok = True
    if not args.no_neighbour:
        with Neighbour(args.neighbour_procs, args.neighbour_seconds):
            rows += run_settings(engine, chosen, args, neighbour=True)
        print_table(rows)
        ok = check_default(rows)
    else:
        print_table(rows)
    results["rows"] = rows
    results["default_within_1.3x"] = ok
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    return 0
