"""The served half of tools/bench_vs_llamacpp.py (--serve): llama-server, `kiln serve` and (with
--vllm-venv) `vllm serve` on the same cores, one at a time, under one client (`kiln bench serve`),
in rounds; prints each run and a table of medians with kiln's ratios."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import tempfile
from pathlib import Path

from tools.peer_process import load
from tools.peer_server import client_prefix, core_count, running_server

REPO = Path(__file__).resolve().parent.parent


def served_one(name: str, cmd: list[str], env: dict, a, out_dir: Path, i: int) -> dict:
    with running_server(cmd, env, out_dir / f"serve_{name}_{i}.log", a.port, a.start_timeout, REPO):
        result = out_dir / f"serve_{name}_{i}.json"
        client = [
            a.kiln_python,
            "-m",
            "engine.entrypoints.cli",
            "bench",
            "serve",
            "--base-url",
            f"http://127.0.0.1:{a.port}",
            "--backend",
            "openai",
            "--dataset-name",
            "random",
            "--num-prompts",
            str(a.serve_prompts),
            "--input-len",
            str(a.serve_input_len),
            "--output-len",
            str(a.serve_output_len),
            "--max-concurrency",
            str(a.serve_concurrency),
            "--ignore-eos",
            "--percentile-metrics",
            "ttft,tpot,itl",
            "--metric-percentiles",
            "50,99",
            "--seed",
            str(i),
            "--disable-tqdm",
            "--json",
            str(result),
        ]
        done = subprocess.run(
            client_prefix() + client,
            capture_output=True,
            text=True,
            cwd=REPO,
            timeout=a.timeout,
            env={**os.environ, "PYTHONPATH": str(REPO)},
        )
        if done.returncode != 0 or not result.is_file():
            raise SystemExit(f"kiln bench serve against {name} failed: {done.stderr[-2000:]}")
        return flat_metrics(json.loads(result.read_text()))


SERVE_METRICS = (
    ("output_throughput", "output tok/s", True),
    ("median_itl_ms", "ITL median ms", False),
    ("median_tpot_ms", "TPOT median ms", False),
    ("median_ttft_ms", "TTFT median ms", False),
    ("p99_itl_ms", "ITL p99 ms", False),
)


def flat_metrics(result: dict) -> dict:
    """kiln bench serve's JSON ({"itl_ms": {"median": ..., "p99": ...}}) with vLLM's flat keys added
    (median_itl_ms, p99_itl_ms, ...)."""
    flat = dict(result)
    for metric in ("ttft", "tpot", "itl", "e2el"):
        for stat, value in (result.get(f"{metric}_ms") or {}).items():
            flat[f"{stat}_{metric}_ms"] = value
    return flat


def serve(bin_dir: Path, model: Path, a) -> dict:
    """The served comparison on `model` (the --serve-format GGUF)."""
    threads = str(core_count(a.cores))
    slots = a.serve_concurrency
    ctx = slots * (a.serve_input_len + a.serve_output_len + 64)
    kiln_dtype = dict(item.split("=", 1) for item in a.kiln_dtype).get(a.serve_format, "auto")
    servers = {
        "llama.cpp": (
            [
                "taskset",
                "-c",
                a.cores,
                str(bin_dir / "llama-server"),
                "-m",
                str(model),
                "-t",
                threads,
                "-tb",
                threads,
                "-np",
                str(slots),
                "-c",
                str(ctx),
                "-cb",
                "--host",
                "127.0.0.1",
                "--port",
                str(a.port),
                "--alias",
                "peer",
                "--no-webui",
            ],
            dict(os.environ),
        ),
        "kiln": (
            [
                "taskset",
                "-c",
                a.cores,
                a.kiln_python,
                "-m",
                "engine.entrypoints.cli",
                "serve",
                "--model",
                str(model),
                "--cpu-threads",
                threads,
                "--port",
                str(a.port),
                "--served-model-name",
                "peer",
                "--dtype",
                kiln_dtype,
            ],
            {**os.environ, "PYTHONPATH": str(REPO)},
        ),
    }
    if a.vllm_venv:
        if not a.vllm_model:
            raise SystemExit("--vllm-venv needs --vllm-model (an HF directory)")
        servers["vLLM"] = (
            [
                str(Path(a.vllm_venv) / "bin" / "vllm"),
                "serve",
                a.vllm_model,
                "--dtype",
                a.vllm_dtype,
                "--max-num-seqs",
                str(slots),
                "--port",
                str(a.port),
                "--served-model-name",
                "peer",
            ],
            {**os.environ, "VLLM_CPU_OMP_THREADS_BIND": a.cores, "VLLM_CPU_KVCACHE_SPACE": "4"},
        )
    out_dir = Path(tempfile.mkdtemp(prefix="kiln-vs-llamacpp-serve-"))
    runs: dict[str, list[dict]] = {n: [] for n in servers}
    for i in range(a.serve_runs):
        for name, (cmd, env) in servers.items():
            r = served_one(name, cmd, env, a, out_dir, i)
            runs[name].append(r)
            print(
                f"  served run {i + 1} {name:9s}: {r['output_throughput']:.1f} output tok/s, ITL median "
                f"{r.get('median_itl_ms', float('nan')):.1f} ms   load {load()}",
                flush=True,
            )
    table = {
        n: {k: statistics.median(r[k] for r in rs) for k, _, _ in SERVE_METRICS if all(k in r for r in rs)}
        for n, rs in runs.items()
    }
    print(
        f"\nserved ({a.serve_format}, {a.serve_prompts} prompts, {a.serve_input_len} in / {a.serve_output_len} out, "
        f"concurrency {a.serve_concurrency}, client kiln bench serve; medians of {a.serve_runs}; logs in {out_dir})"
    )
    names = list(servers)
    print("| metric | " + " | ".join(names) + " | " + " | ".join(f"kiln / {n}" for n in names if n != "kiln") + " |")
    print("|---|" + "---:|" * (2 * len(names) - 1))
    for key, label, higher in SERVE_METRICS:
        if not all(key in table[n] for n in names):
            continue
        ratios = [table["kiln"][key] / table[n][key] for n in names if n != "kiln"]
        values = " | ".join(f"{table[n][key]:.1f}" for n in names)
        print(
            f"| {label}{'' if higher else ' (lower is better)'} | {values} | "
            + " | ".join(f"{x:.2f}x" for x in ratios)
            + " |"
        )
    return {"medians": table, "runs": runs}
