"""`kiln bench cpu --baseline / --parts / --startup`: kiln against transformers' generate at batch
1, the compiled parts against their eager references, and process start to first token."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from engine.bench.cpu_threads_under_load import batch1, random_prompts


def baseline(engine, args) -> dict[str, float]:
    """transformers generate vs kiln, batch 1, same weights and threads, in this process."""
    from engine.bench.hf_baseline import build_hf_model, run_hf
    from engine.bench.latency import run_kiln

    hf = build_hf_model(engine)
    vocab = engine.model_config.vocab_size
    prompt = random_prompts(1, args.input_len, args.input_len, vocab, 4)
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
