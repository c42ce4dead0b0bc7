"""Per-op CPU microbenchmark: compiler/kernels/cpu_fused.py's fused ops and compiler/kernels/cpu_linear.py's
bucketed oneDNN projection against the eager torch ops they replace, timed in the same run.

    PYTHONPATH=$PWD python tools/bench_cpu_ops.py [--rows 64,2602] [--threads 2] [--dtype float32]
    PYTHONPATH=$PWD python tools/bench_cpu_ops.py --engine [--rounds 5] [--threads 1]

--engine: the `kiln bench throughput` workload (64 requests, prompts 16-64, outputs 16-64 tokens,
greedy) on the default tiny model in one process, the configurations alternated round by round
(eager ops + F.linear; oneDNN only; fused ops only; both), CPU seconds per run (steadier than
wall time on a shared machine), median and ratio against the first.

Shapes are the default tiny model's (hidden 128, intermediate 256, 4 query / 2 KV heads of 32)
unless given. Prints µs per call (best of 5 repeats) and the ratio eager / new (> 1: faster).
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from compiler.kernels.cpu_fused import FUSED
from compiler.kernels.cpu_linear import linear
from engine.layers.layernorm import RMSNorm
from engine.layers.rotary import apply_rope


def best_us(fn, repeats: int = 5) -> float:
    for _ in range(3):
        fn()
    t0 = time.perf_counter()
    fn()
    calls = max(3, min(200, int(0.01 / max(time.perf_counter() - t0, 1e-7))))  # ~10 ms a repeat
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - t0) / calls)
    return best * 1e6


def cases(rows: int, hidden: int, inter: int, hq: int, hkv: int, d: int, dtype: torch.dtype):
    g = torch.Generator().manual_seed(0)
    rnd = lambda *shape: torch.randn(*shape, generator=g).to(dtype)  # noqa: E731
    norm = RMSNorm(hidden, 1e-6).to(dtype)
    x, delta = rnd(rows, hidden), rnd(rows, hidden)
    gate_up = rnd(rows, 2 * inter)
    qkv = rnd(rows, (hq + 2 * hkv) * d)
    q = qkv[:, : hq * d].view(rows, hq, d)
    k = qkv[:, hq * d : (hq + hkv) * d].view(rows, hkv, d)
    positions = torch.randint(0, 1024, (rows,), generator=g)
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
    freqs = torch.outer(torch.arange(1024, dtype=torch.float32), inv)
    emb = torch.cat([freqs, freqs], dim=-1)
    table = torch.cat([emb.cos(), emb.sin()], dim=-1)
    ops = torch.ops.kiln_cpu_fused

    def eager_norm():  # (norm.fused is off: the eager ops)
        return norm(x)

    def eager_add_norm():
        return norm(x + delta)

    def eager_rope():
        cos, sin = table[positions].to(dtype).chunk(2, dim=-1)
        return apply_rope(q, cos[:, None], sin[:, None]), apply_rope(k, cos[:, None], sin[:, None])

    def eager_silu():
        gate, up = gate_up.split(inter, dim=-1)
        return F.silu(gate) * up

    residual = x.clone()
    yield "rms_norm", eager_norm, lambda: ops.rms_norm(x, norm.weight, 1e-6, 0.0)
    yield "residual add + rms_norm", eager_add_norm, lambda: ops.add_rms_norm(residual, delta, norm.weight, 1e-6, 0.0)
    yield "rope (q and k)", eager_rope, lambda: ops.rope_(q, k, positions, table, False)
    yield "silu_and_mul", eager_silu, lambda: ops.silu_and_mul(gate_up, False)
    for k_in, n_out, name in [
        (hidden, (hq + 2 * hkv) * d, "qkv"),
        (hq * d, hidden, "o"),
        (hidden, 2 * inter, "gate_up"),
        (inter, hidden, "down"),
    ]:
        w, a = rnd(n_out, k_in), rnd(rows, k_in)
        yield f"linear {name} {k_in}->{n_out}", (lambda a=a, w=w: F.linear(a, w)), (lambda a=a, w=w: linear(a, w))


def engine_ab(rounds: int, threads: int) -> None:
    import random
    import statistics

    from compiler.kernels import cpu_linear
    from engine import SamplingParams
    from engine.config.settings import EngineSettings
    from engine.entrypoints.llm import LLM
    from engine.layers.mlp import MLP
    from engine.layers.rotary import RotaryEmbedding
    from engine.models.tiny_model import default_model_dir

    llm = LLM(str(default_model_dir(EngineSettings().cache_dir)), max_num_seqs=64, cpu_threads=threads)
    rng = random.Random(0)
    vocab = llm.engine.model_config.vocab_size
    prompts = [[rng.randrange(5, vocab) for _ in range(rng.randint(16, 64))] for _ in range(64)]
    params = [
        SamplingParams(temperature=0.0, max_tokens=rng.randint(16, 64), ignore_eos=True, detokenize=False)
        for _ in range(64)
    ]
    fusable = [m for m in llm.engine.core.runner.model.modules() if isinstance(m, (RMSNorm, RotaryEmbedding, MLP))]
    min_rows = cpu_linear.MIN_ONEDNN_ROWS
    configs = {
        "eager ops, F.linear": (False, 1 << 40),
        "oneDNN only": (False, min_rows),
        "fused ops only": (True, 1 << 40),
        "fused ops + oneDNN": (True, min_rows),
    }
    times: dict[str, list[float]] = {name: [] for name in configs}
    reference = None
    for _ in range(rounds + 1):  # the first round warms every configuration up
        for name, (fused, rows) in configs.items():
            for m in fusable:
                m.fused = fused
            cpu_linear.MIN_ONEDNN_ROWS = rows
            t0 = time.process_time()
            outs = llm.generate(prompts, params, use_tqdm=False)
            times[name].append(time.process_time() - t0)
            tokens = [o.outputs[0].token_ids for o in outs]
            reference = reference or tokens
            assert tokens == reference, f"{name}: different greedy tokens"
    cpu_linear.MIN_ONEDNN_ROWS = min_rows
    base = statistics.median(times["eager ops, F.linear"][1:])
    print(f"engine, {threads} thread(s), {rounds} alternating rounds, CPU ms per run (median, min)")
    for name, ts in times.items():
        med = statistics.median(ts[1:])
        print(f"{name:22s} {med * 1e3:8.1f} {min(ts[1:]) * 1e3:8.1f}   {base / med:5.2f}x")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", default="1,64,2602")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--shape", default="128,256,4,2,32", help="hidden,intermediate,q heads,kv heads,head_dim")
    p.add_argument("--cache-dir", type=Path, default=Path(tempfile.gettempdir()) / "kiln-bench-cpu-ops")
    p.add_argument("--engine", action="store_true", help="the engine A/B instead of the per-op table")
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args()
    if args.engine:
        return engine_ab(args.rounds, args.threads)
    torch.set_num_threads(args.threads)
    FUSED.load(args.cache_dir)
    dtype = getattr(torch, args.dtype)
    hidden, inter, hq, hkv, d = (int(v) for v in args.shape.split(","))
    print(f"{args.dtype}, {args.threads} threads, hidden {hidden}, intermediate {inter}, heads {hq}/{hkv}x{d}")
    print(f"{'op':28s} {'rows':>5s} {'eager µs':>9s} {'new µs':>8s} {'eager/new':>9s}")
    with torch.inference_mode():
        for rows in (int(r) for r in args.rows.split(",")):
            for name, eager_fn, new_fn in cases(rows, hidden, inter, hq, hkv, d, dtype):
                e, n = _paired(eager_fn, new_fn)
                print(f"{name:28s} {rows:5d} {e:9.1f} {n:8.1f} {e / n:8.2f}x")


def _paired(eager_fn, new_fn) -> tuple[float, float]:
    """Best of three alternating measurements of each (other jobs share this machine)."""
    e = n = float("inf")
    for _ in range(3):
        e = min(e, best_us(eager_fn))
        n = min(n, best_us(new_fn))
    return e, n


if __name__ == "__main__":
    main()
