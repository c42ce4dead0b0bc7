"""`kiln bench cpu`'s thread settings under load: each setting's batch-1 decode and throughput,
on a quiet machine and next to a CPU-burning neighbour (Neighbour), and the check that the default
plan is within 1.3x of the best setting. Also the random prompts every part of the bench uses."""

from __future__ import annotations

import subprocess
import sys
import time
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


def random_prompts(n: int, lo: int, hi: int, vocab: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(5, vocab, size=int(rng.integers(lo, hi + 1))).tolist() for _ in range(n)]


def batch1(engine, args) -> float:
    """Median ms per decode step of one request."""
    from engine.bench.latency import run_kiln

    vocab = engine.model_config.vocab_size
    run_kiln(engine, random_prompts(1, args.input_len, args.input_len, vocab, 1), 3, "warm")
    res = run_kiln(engine, random_prompts(1, args.input_len, args.input_len, vocab, 2), args.batch1_tokens, "b1")
    return float(np.median(res["step_s"]) * 1e3)  # each decode step's host interval


def throughput(engine, args, requests: int | None = None, output_len: int | None = None) -> float:
    """Generated tokens per second for --requests requests, all queued at once."""
    from engine.core.params import SamplingParams

    vocab = engine.model_config.vocab_size
    prompts = random_prompts(requests or args.requests, max(1, args.input_len // 2), args.input_len, vocab, 3)
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
