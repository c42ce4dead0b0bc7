"""The served half of tools/bench_vs_llamacpp.py (--serve): llama-server, `kiln serve` and (with
--vllm-venv) `vllm serve` on the same cores, one at a time, in interleaved rounds (round 1 of every
server, then round 2, ...), each loaded by the clients of --serve-client: `vllm bench serve` (vLLM's
own client, from --vllm-venv, with --vllm-model's tokenizer: issue 41's measure) and `kiln bench
serve`, one after the other on the same server start (vLLM's first), after one warm-up request.
Prints each run (with the prompt tokens the server counted, and the load), then per client a
table of medians with kiln's ratios, and each server's time to ready and memory (tools/peer_server.py).

Both serve --serve-concurrency sequences at once: llama-server with that many slots (-np) and a
context of slots x (the longest prompt + output + 64) tokens (-c; without a unified KV cache each
slot gets its share), kiln with max_num_seqs = slots and max_model_len = one slot's context.

Kiln against itself beside llama-server (issue 41): `--kiln-variant NAME=FLAGS` (repeatable) serves
kiln once per variant with those extra flags (the first is the baseline the table divides by);
`--no-llama-server` leaves llama-server out; `--step-timeline` has each kiln run write its step
timeline (the step_timeline setting) and prints `kiln bench timeline`'s causes of the slowest
decoded tokens (with two clients, the timeline holds both loads). `--serve-dataset mixed`:
--serve-input-len-token prompts plus a --mix-long-fraction share of long ones, their lengths uniform
in --mix-long-len (default 1024,4096), as a ShareGPT file of words (sized with the first server's
/tokenize: the same text, so the same tokens, for every server; vLLM's client reads the same texts
as its custom dataset, since its ShareGPT reader drops prompts over 1,024 tokens), --serve-output-len
tokens out each.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shlex
import statistics
import subprocess
import tempfile
import urllib.request
from pathlib import Path

from tools.peer_process import load
from tools.peer_server import client_prefix, core_count, running_server

REPO = Path(__file__).resolve().parent.parent
LLAMA = "llama.cpp"

SERVE_METRICS = (
    ("output_throughput", "output tok/s", True),
    ("median_ttft_ms", "TTFT median ms", False),
    ("p99_ttft_ms", "TTFT p99 ms", False),
    ("median_tpot_ms", "TPOT median ms", False),
    ("median_itl_ms", "ITL median ms", False),
    ("p99_itl_ms", "ITL p99 ms", False),
)


def add_serve_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--serve", action="store_true", help="also the served comparison")
    p.add_argument("--serve-format", default="F32")
    p.add_argument("--serve-prompts", type=int, default=100)
    p.add_argument("--serve-input-len", type=int, default=64)
    p.add_argument("--serve-output-len", type=int, default=64)
    p.add_argument("--serve-concurrency", type=int, default=16)
    p.add_argument("--serve-runs", type=int, default=1, help="interleaved rounds (>= 3 for medians worth reading)")
    p.add_argument("--serve-dataset", default="random", choices=["random", "mixed"])
    p.add_argument("--mix-long-fraction", type=float, default=0.25, help="mixed: share of long prompts (default 0.25)")
    p.add_argument("--mix-long-len", default="1024,4096", help="mixed: long prompts' length range (default 1024,4096)")
    p.add_argument(
        "--kiln-variant",
        action="append",
        default=[],
        metavar="NAME=FLAGS",
        help="serve kiln once per variant with these extra flags (repeatable; the first is the baseline)",
    )
    p.add_argument("--no-llama-server", action="store_true", help="leave llama-server out (kiln variants only)")
    p.add_argument("--no-vllm-server", action="store_true", help="with --vllm-venv: use its client only, serve no vLLM")
    p.add_argument("--step-timeline", action="store_true", help="kiln runs write and analyse their step timeline")
    p.add_argument("--vllm-venv", default=None, help="a virtual environment holding vLLM's CPU build")
    p.add_argument("--vllm-model", default=None, help="HF directory vLLM serves (same weights)")
    p.add_argument("--vllm-dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument(
        "--serve-client",
        default=None,
        choices=["vllm", "kiln", "both"],
        help="the load's client: vllm bench serve (needs --vllm-venv and --vllm-model), kiln bench serve, or both "
        "on each server start (default: both with --vllm-venv, else kiln)",
    )
    p.add_argument(
        "--serve-sampling",
        nargs="+",
        default=[],
        metavar="NAME=VALUE",
        help="sampling parameters both clients send, e.g. temperature=0.8 top_p=0.95 top_k=40 min_p=0.05 "
        "(default: none: kiln's client greedy, vLLM's the server's defaults)",
    )
    p.add_argument("--port", type=int, default=8021)
    p.add_argument("--start-timeout", type=float, default=900.0)


def _variant(text: str) -> tuple[str, list[str]]:
    name, _, flags = text.partition("=")
    if not name or name in (LLAMA, "vLLM"):
        raise SystemExit(f"--kiln-variant {text!r}: NAME=FLAGS, NAME not empty nor a peer's")
    return name, shlex.split(flags)


def flat_metrics(result: dict) -> dict:
    """kiln bench serve's JSON ({"itl_ms": {"median": ..., "p99": ...}}) with vLLM's flat keys added
    (median_itl_ms, p99_itl_ms, ...)."""
    flat = dict(result)
    for metric in ("ttft", "tpot", "itl", "e2el"):
        for stat, value in (result.get(f"{metric}_ms") or {}).items():
            flat[f"{stat}_{metric}_ms"] = value
    return flat


# ---- the mixed workload -----------------------------------------------------------------------
WORDS = (
    "the quick brown fox jumps over a lazy dog while clay pots bake in the kiln and the model reads "
    "each token of every page in its cache before the server streams an answer to the user"
).split()


def tokens_per_word(port: int) -> float:
    """Tokens per word of WORDS-text by the running server's /tokenize (kiln's body, else llama-server's)."""
    text = " ".join(random.Random(1).choice(WORDS) for _ in range(2000))
    for body in ({"prompt": text, "add_special_tokens": False}, {"content": text, "add_special": False}):
        req = urllib.request.Request(
            f"http://127.0.0.1:{port}/tokenize",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        try:
            with urllib.request.urlopen(req, timeout=60) as r:
                tokens = json.loads(r.read()).get("tokens")
        except OSError:
            continue
        if tokens:
            return len(tokens) / 2000
    raise SystemExit("the server has no /tokenize: cannot size the mixed prompts")


def mixed_dataset(a, port: int, path: Path) -> Path:
    """A ShareGPT file: --serve-prompts prompts of about --serve-input-len tokens, a --mix-long-fraction
    share of them --mix-long-len tokens (uniform); the same file for every server and run."""
    lo, hi = (int(x) for x in a.mix_long_len.split(","))
    per_word = tokens_per_word(port)
    rng = random.Random(0)
    convs = []
    for _ in range(a.serve_prompts):
        n = rng.randint(lo, hi) if rng.random() < a.mix_long_fraction else a.serve_input_len
        text = " ".join(rng.choice(WORDS) for _ in range(max(1, round(n / per_word))))
        convs.append({"conversations": [{"from": "human", "value": text}, {"from": "gpt", "value": "ok"}]})
    path.write_text(json.dumps(convs))
    return path


def _dataset_args(a, port: int, out_dir: Path) -> list[str]:
    if a.serve_dataset == "random":
        return ["--dataset-name", "random", "--input-len", str(a.serve_input_len)]
    path = out_dir / "mixed_prompts.json"
    if not path.is_file():
        mixed_dataset(a, port, path)
    return ["--dataset-name", "sharegpt", "--dataset-path", str(path)]


def _vllm_dataset_args(a, port: int, out_dir: Path) -> list[str]:
    """The same workload for `vllm bench serve`: its random dataset, or the mixed texts as its custom dataset."""
    if a.serve_dataset == "random":
        return ["--dataset-name", "random", "--random-input-len", str(a.serve_input_len)]
    _dataset_args(a, port, out_dir)  # (the ShareGPT file, written once)
    custom = out_dir / "mixed_prompts.jsonl"
    if not custom.is_file():
        convs = json.loads((out_dir / "mixed_prompts.json").read_text())
        custom.write_text("".join(json.dumps({"prompt": c["conversations"][0]["value"]}) + "\n" for c in convs))
    return ["--dataset-name", "custom", "--dataset-path", str(custom), "--skip-chat-template"]


def clients(a) -> list[str]:
    """The clients each server start is loaded by, in order."""
    which = a.serve_client or ("both" if a.vllm_venv else "kiln")
    if which != "kiln" and not (a.vllm_venv and a.vllm_model):
        raise SystemExit("--serve-client vllm/both needs --vllm-venv (vLLM's client) and --vllm-model (its tokenizer)")
    return {"both": ["vllm", "kiln"], "vllm": ["vllm"], "kiln": ["kiln"]}[which]


def kiln_client(a, out_dir: Path, result: Path, i: int) -> list[str]:
    client = [a.kiln_python, "-m", "engine.entrypoints.cli", "bench", "serve"]
    client += ["--base-url", f"http://127.0.0.1:{a.port}", "--backend", "openai"]
    client += _dataset_args(a, a.port, out_dir)
    client += ["--num-prompts", str(a.serve_prompts), "--output-len", str(a.serve_output_len)]
    client += ["--sharegpt-output-len", str(a.serve_output_len), "--max-concurrency", str(a.serve_concurrency)]
    client += ["--ignore-eos", "--percentile-metrics", "ttft,tpot,itl", "--metric-percentiles", "50,99"]
    client += _sampling_args(a)
    return client + ["--seed", str(i), "--disable-tqdm", "--json", str(result)]


_SAMPLING = ("temperature", "top_p", "top_k", "min_p")


def _sampling_args(a) -> list[str]:
    """--serve-sampling as either client's flags (both take --temperature, --top-p, --top-k, --min-p)."""
    out = []
    for item in a.serve_sampling:
        name, _, value = item.partition("=")
        if name not in _SAMPLING or not value:
            raise SystemExit(f"--serve-sampling: {item!r} is not NAME=VALUE with NAME one of {', '.join(_SAMPLING)}")
        out += [f"--{name.replace('_', '-')}", value]
    return out


def vllm_client(a, out_dir: Path, result: Path, i: int) -> list[str]:
    client = [str(Path(a.vllm_venv) / "bin" / "vllm"), "bench", "serve", "--backend", "openai"]
    client += ["--base-url", f"http://127.0.0.1:{a.port}", "--model", "peer", "--tokenizer", a.vllm_model]
    client += _vllm_dataset_args(a, a.port, out_dir)
    client += ["--num-prompts", str(a.serve_prompts), "--max-concurrency", str(a.serve_concurrency)]
    if a.serve_dataset == "random":
        client += ["--random-output-len", str(a.serve_output_len)]
    else:
        client += ["--custom-output-len", str(a.serve_output_len)]
    client += ["--ignore-eos", "--percentile-metrics", "ttft,tpot,itl", "--metric-percentiles", "50,99"]
    client += _sampling_args(a)
    client += ["--seed", str(i), "--disable-tqdm", "--save-result", "--result-dir", str(result.parent)]
    # A new connection per request, for every server: llama-server closes each connection after its
    # stream, and the client's reuse of a closed one failed 9-22% of its requests.
    client += ["--header", "Connection=close"]
    return client + ["--result-filename", result.name]


def _warm_up(port: int) -> None:
    """One short completion, so that neither client's run pays a server's first-request costs."""
    body = {"model": "peer", "prompt": "warm up " * 8, "max_tokens": 2, "temperature": 0}
    req = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=600) as r:
        r.read()


# ---- one run ------------------------------------------------------------------------------------
def served_one(name: str, cmd: list[str], env: dict, a, out_dir: Path, i: int) -> dict[str, dict]:
    """One start of server `name` loaded by every client: {client: metrics, "server": ready / RSS}."""
    timeline = out_dir / f"serve_{name}_{i}.steps.jsonl"
    if a.step_timeline and name not in (LLAMA, "vLLM"):
        cmd = cmd + ["--step-timeline", str(timeline)]
    log = out_dir / f"serve_{name}_{i}.log"
    out: dict[str, dict] = {}
    with running_server(cmd, env, log, a.port, a.start_timeout, REPO) as server:
        _warm_up(a.port)
        for client in clients(a):
            result = out_dir / f"serve_{name}_{i}.{client}.json"
            argv = (vllm_client if client == "vllm" else kiln_client)(a, out_dir, result, i)
            done = subprocess.run(
                client_prefix() + argv,
                capture_output=True,
                text=True,
                cwd=REPO,
                timeout=a.timeout,
                # (vLLM's client in its own environment: the checkout's packages not on its path)
                env=dict(os.environ) if client == "vllm" else {**os.environ, "PYTHONPATH": str(REPO)},
            )
            (out_dir / f"serve_{name}_{i}.{client}.client.log").write_text(done.stdout + done.stderr)
            if done.returncode != 0 or not result.is_file():
                raise SystemExit(f"{client} bench serve against {name} failed: {(done.stderr or done.stdout)[-2000:]}")
            out[client] = flat_metrics(json.loads(result.read_text()))
    out["server"] = server.figures()
    if name == LLAMA and i == 0:
        slots = re.search(r"n_slots = (\d+), n_ctx_slot = (\d+)", log.read_text(errors="replace"))
        print(f"  llama-server: {'%s slots of %s tokens' % slots.groups() if slots else 'slots not in its log'}")
    if a.step_timeline and timeline.is_file():  # (written at the server's shutdown)
        from engine.bench.timeline_report import analyse, render
        from engine.bench.timeline_report import load as load_timeline

        report = analyse(load_timeline(timeline), top=2.0)
        print(f"  {name} run {i + 1} timeline: {render(report, 2.0)}", flush=True)
        out["server"]["timeline"] = report
    return out


# ---- the servers ----------------------------------------------------------------------------------
def _servers(bin_dir: Path, model: Path, a) -> dict[str, tuple[list[str], dict]]:
    threads = str(core_count(a.cores))
    slots = a.serve_concurrency
    # (the mixed prompts' words are sized by a tokens-per-word average: a tenth more room for them)
    longest = int(int(a.mix_long_len.split(",")[1]) * 1.1) if a.serve_dataset == "mixed" else a.serve_input_len
    slot_ctx = longest + a.serve_output_len + 64
    kiln_dtype = dict(item.split("=", 1) for item in a.kiln_dtype).get(a.serve_format, "auto")
    servers: dict[str, tuple[list[str], dict]] = {}
    if not a.no_llama_server:
        servers[LLAMA] = (
            ["taskset", "-c", a.cores, str(bin_dir / "llama-server"), "-m", str(model), "-t", threads, "-tb", threads]
            + ["-np", str(slots), "-c", str(slots * slot_ctx), "-cb", "--host", "127.0.0.1", "--port", str(a.port)]
            + ["--alias", "peer", "--no-webui"],
            dict(os.environ),
        )
    kiln = ["taskset", "-c", a.cores, a.kiln_python, "-m", "engine.entrypoints.cli", "serve", "--model", str(model)]
    kiln += ["--cpu-threads", threads, "--port", str(a.port), "--served-model-name", "peer", "--dtype", kiln_dtype]
    kiln += ["--max-num-seqs", str(slots), "--max-model-len", str(slot_ctx)]
    variants = dict(_variant(v) for v in a.kiln_variant) if a.kiln_variant else {"kiln": []}
    for name, flags in variants.items():
        servers[name] = (kiln + flags, {**os.environ, "PYTHONPATH": str(REPO)})
    if a.vllm_venv and not a.no_vllm_server:
        if not a.vllm_model:
            raise SystemExit("--vllm-venv needs --vllm-model (an HF directory)")
        servers["vLLM"] = (
            [str(Path(a.vllm_venv) / "bin" / "vllm"), "serve", a.vllm_model, "--dtype", a.vllm_dtype]
            + ["--max-num-seqs", str(slots), "--port", str(a.port), "--served-model-name", "peer"],
            {**os.environ, "VLLM_CPU_OMP_THREADS_BIND": a.cores, "VLLM_CPU_KVCACHE_SPACE": "4"},
        )
    return servers


def serve(bin_dir: Path, model: Path, a) -> dict:
    """The served comparison on `model` (the --serve-format GGUF)."""
    servers = _servers(bin_dir, model, a)
    order = clients(a)
    out_dir = Path(tempfile.mkdtemp(prefix="kiln-vs-llamacpp-serve-"))
    runs: dict[str, dict[str, list[dict]]] = {c: {n: [] for n in servers} for c in order + ["server"]}
    for i in range(a.serve_runs):
        for name, (cmd, env) in servers.items():
            got = served_one(name, cmd, env, a, out_dir, i)
            for key, r in got.items():
                runs[key][name].append(r)
            for client in order:
                r = got[client]
                print(
                    f"  served run {i + 1} {name:9s} {client + ' client':12s}: {r['output_throughput']:.1f} output "
                    f"tok/s, TTFT median / p99 {r.get('median_ttft_ms', float('nan')):.0f} / "
                    f"{r.get('p99_ttft_ms', float('nan')):.0f} ms, ITL median / p99 "
                    f"{r.get('median_itl_ms', float('nan')):.1f} / {r.get('p99_itl_ms', float('nan')):.1f} ms, "
                    f"{r.get('total_input_tokens', '?')} prompt tokens, {r.get('completed', '?')} done / "
                    f"{r.get('failed', '?')} failed   load {load()}",
                    flush=True,
                )
            m = got["server"]
            print(
                f"  served run {i + 1} {name:9s} ready {m['ready_s']:.1f} s, peak PSS {m['peak_pss_GB']:.3f} GB, "
                f"peak RSS {m['peak_rss_GB']:.3f} GB ({', '.join(m['names'])})",
                flush=True,
            )
    shape = (
        f"{a.serve_format}, {a.serve_dataset}: {a.serve_prompts} prompts, {a.serve_input_len} in"
        + (f" (a {a.mix_long_fraction} share {a.mix_long_len})" if a.serve_dataset == "mixed" else "")
        + f" / {a.serve_output_len} out, concurrency {a.serve_concurrency}, EOS ignored"
    )
    for client in order:
        print(
            f"\nserved ({shape}; client {client} bench serve; medians of {a.serve_runs} interleaved runs; "
            f"logs in {out_dir})"
        )
        print(table(runs[client]))
    print(f"\nservers (medians of {a.serve_runs} starts; memory: every process of the server, tools/peer_server.py)")
    print(table(runs["server"], SERVER_METRICS))
    return {
        "clients": order,
        "medians": {c: medians(runs[c]) for c in order},
        "servers": medians(runs["server"], SERVER_METRICS),
        "runs": runs,
    }


SERVER_METRICS = (
    ("ready_s", "ready s", False),
    ("peak_pss_GB", "peak PSS GB", False),  # (all the server's processes, shared pages once)
    ("peak_rss_GB", "peak RSS GB", False),  # (the sum of its processes' own peaks)
)


def medians(runs: dict[str, list[dict]], metrics=SERVE_METRICS) -> dict[str, dict[str, float]]:
    return {
        n: {k: statistics.median(r[k] for r in rs) for k, _, _ in metrics if rs and all(k in r for r in rs)}
        for n, rs in runs.items()
    }


def table(runs: dict[str, list[dict]], metrics=SERVE_METRICS) -> str:
    """Medians per server; every kiln variant's ratio to llama-server and to the first variant."""
    med = medians(runs, metrics)
    names = list(runs)
    kilns = [n for n in names if n not in (LLAMA, "vLLM")]
    pairs = [(k, p) for k in kilns for p in names if p in (LLAMA, "vLLM")]
    pairs += [(k, kilns[0]) for k in kilns[1:]]
    lines = ["| metric | " + " | ".join(names) + "".join(f" | {k} / {p}" for k, p in pairs) + " |"]
    lines.append("|---|" + "---:|" * (len(names) + len(pairs)))
    for key, label, higher in metrics:
        if not all(key in med[n] for n in names):
            continue
        values = " | ".join(f"{med[n][key]:.{3 if key.endswith('_GB') else 1}f}" for n in names)
        ratios = "".join(f" | {med[k][key] / med[p][key]:.2f}x" if med[p][key] else " | -" for k, p in pairs)
        lines.append(f"| {label}{'' if higher else ' (lower is better)'} | {values}{ratios} |")
    if metrics is SERVE_METRICS:  # (both clients count failed requests: any is a run to read with care)
        failed = " | ".join(str(sum(int(r.get("failed") or 0) for r in runs[n])) for n in names)
        lines.append(f"| failed requests, all runs | {failed}" + " | -" * len(pairs) + " |")
    return "\n".join(lines)
