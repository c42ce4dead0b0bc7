"""`kiln bench serve --url URL`: load an OpenAI-compatible server and measure what users feel.

Sends N streaming completions with Poisson arrivals at --request-rate (or all at once when
the rate is inf), optionally capped at --max-concurrency in flight. Prompts are random
token ids (fixed seed) of --input-len tokens, drawn from the server's own vocabulary via
/tokenize when it has one; outputs are exactly --output-len tokens (ignore_eos).

Metric definitions match vLLM's serving benchmark so numbers compare:
  TTFT  arrival of the first chunk with text - request start
  TPOT  (e2e - TTFT) / (output tokens - 1), per request with more than one output token
  ITL   every gap between successive streamed chunks that carry text
  E2EL  last byte - request start
  throughput: completed requests / duration, output tokens / duration, all tokens / duration
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

_WORDS = ("the quick brown fox jumps over lazy dog kiln oven clay pottery brick model token batch block page cache "
          "memory attention value key step request stream server engine graph kernel hello world paris france "
          "number text answer question assistant user code data fast slow small large").split()


@dataclass
class RequestResult:
    ok: bool = False
    prompt_len: int = 0
    output_tokens: int = 0
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)
    error: str = ""


@dataclass
class BenchConfig:
    url: str
    model: str | None
    num_prompts: int
    request_rate: float
    max_concurrency: int | None
    input_len: int
    output_len: int
    seed: int
    burstiness: float = 1.0


def percentile(values: list[float], q: float) -> float:
    """Linear-interpolated percentile (numpy's default method), q in [0, 100]."""
    if not values:
        return 0.0
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def _stats(values: list[float], scale: float = 1000.0) -> dict[str, float]:
    if not values:
        return {"mean": 0.0, "median": 0.0, "p99": 0.0}
    return {"mean": scale * sum(values) / len(values), "median": scale * percentile(values, 50),
            "p99": scale * percentile(values, 99)}


def summarize(results: list[RequestResult], duration: float) -> dict[str, Any]:
    done = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in done)
    in_tokens = sum(r.prompt_len for r in done)
    tpot = [(r.latency - r.ttft) / (r.output_tokens - 1) for r in done if r.output_tokens > 1]
    itl = [g for r in done for g in r.itl]
    errors: dict[str, int] = {}
    for r in results:
        if not r.ok:
            errors[r.error] = errors.get(r.error, 0) + 1
    return {
        "duration_s": duration,
        "completed": len(done),
        "failed": len(results) - len(done),
        "errors": errors,
        "total_input_tokens": in_tokens,
        "total_output_tokens": out_tokens,
        "request_throughput": len(done) / duration if duration > 0 else 0.0,
        "output_throughput": out_tokens / duration if duration > 0 else 0.0,
        "total_token_throughput": (in_tokens + out_tokens) / duration if duration > 0 else 0.0,
        "ttft_ms": _stats([r.ttft for r in done]),
        "tpot_ms": _stats(tpot),
        "itl_ms": _stats(itl),
        "e2el_ms": _stats([r.latency for r in done]),
    }


def arrival_gaps(n: int, rate: float, seed: int, burstiness: float = 1.0) -> list[float]:
    """Seconds to wait before each request: gamma(burstiness) gaps with mean 1/rate (Poisson at 1)."""
    if math.isinf(rate):
        return [0.0] * n
    rng = random.Random(seed)
    theta = 1.0 / (rate * burstiness)
    return [rng.gammavariate(burstiness, theta) for _ in range(n)]


async def make_prompts(http: httpx.AsyncClient, cfg: BenchConfig, headers: dict[str, str]) -> list[str | list[int]]:
    rng = random.Random(cfg.seed)
    text = " ".join(rng.choice(_WORDS) for _ in range(max(cfg.input_len * 4, 256)))
    pool: list[int] = []
    try:
        resp = await http.post(f"{cfg.url}/tokenize", json={"prompt": text, "add_special_tokens": False},
                               headers=headers)
        if resp.status_code == 200:
            pool = sorted(set(resp.json()["tokens"]))
    except httpx.HTTPError:
        pool = []
    if pool:
        return [[rng.choice(pool) for _ in range(cfg.input_len)] for _ in range(cfg.num_prompts)]
    # No /tokenize: words (about one token each for common words).
    return [" ".join(rng.choice(_WORDS) for _ in range(cfg.input_len)) for _ in range(cfg.num_prompts)]


async def one_request(http: httpx.AsyncClient, cfg: BenchConfig, model: str, prompt, headers) -> RequestResult:
    body = {"model": model, "prompt": prompt, "max_tokens": cfg.output_len, "temperature": 0.0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    res = RequestResult(prompt_len=len(prompt) if isinstance(prompt, list) else 0)
    start = time.perf_counter()
    last = start
    chunks = 0
    try:
        async with http.stream("POST", f"{cfg.url}/v1/completions", json=body, headers=headers) as resp:
            if resp.status_code != 200:
                await resp.aread()
                res.error = f"HTTP {resp.status_code}"
                return res
            async for line in resp.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    break
                event = json.loads(data)
                if "error" in event:
                    res.error = event["error"].get("code") or "stream error"
                    return res
                if event.get("usage"):
                    res.output_tokens = event["usage"]["completion_tokens"]
                    res.prompt_len = event["usage"]["prompt_tokens"]
                if any(c.get("text") for c in event.get("choices", [])):
                    now = time.perf_counter()
                    if chunks == 0:
                        res.ttft = now - start
                    else:
                        res.itl.append(now - last)
                    last = now
                    chunks += 1
        res.latency = time.perf_counter() - start
        if not res.output_tokens:
            res.output_tokens = chunks
        res.ok = chunks > 0
        if not res.ok:
            res.error = "no output"
    except (httpx.HTTPError, json.JSONDecodeError, KeyError) as exc:
        res.error = type(exc).__name__
    return res


async def run(cfg: BenchConfig, api_key: str | None = None, progress: bool = True) -> dict[str, Any]:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0, connect=30.0), limits=limits) as http:
        model = cfg.model
        if model is None:
            resp = await http.get(f"{cfg.url}/v1/models", headers=headers)
            resp.raise_for_status()
            model = resp.json()["data"][0]["id"]
        prompts = await make_prompts(http, cfg, headers)
        gaps = arrival_gaps(cfg.num_prompts, cfg.request_rate, cfg.seed + 1, cfg.burstiness)
        sem = asyncio.Semaphore(cfg.max_concurrency) if cfg.max_concurrency else None

        async def limited(prompt):
            if sem is None:
                return await one_request(http, cfg, model, prompt, headers)
            async with sem:
                return await one_request(http, cfg, model, prompt, headers)

        start = time.perf_counter()
        tasks = []
        for prompt, gap in zip(prompts, gaps):
            if gap > 0:
                await asyncio.sleep(gap)
            tasks.append(asyncio.ensure_future(limited(prompt)))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
    summary = summarize(list(results), duration)
    summary["model"] = model
    summary["config"] = asdict(cfg)
    return summary


def format_summary(s: dict[str, Any]) -> str:
    lines = ["============ Serving Benchmark Result ============",
             f"{'Successful requests:':<40}{s['completed']:>10}",
             f"{'Failed requests:':<40}{s['failed']:>10}",
             f"{'Benchmark duration (s):':<40}{s['duration_s']:>10.2f}",
             f"{'Total input tokens:':<40}{s['total_input_tokens']:>10}",
             f"{'Total generated tokens:':<40}{s['total_output_tokens']:>10}",
             f"{'Request throughput (req/s):':<40}{s['request_throughput']:>10.2f}",
             f"{'Output token throughput (tok/s):':<40}{s['output_throughput']:>10.2f}",
             f"{'Total token throughput (tok/s):':<40}{s['total_token_throughput']:>10.2f}"]
    for key, title in (("ttft_ms", "Time to First Token"), ("tpot_ms", "Time per Output Token (excl. 1st token)"),
                       ("itl_ms", "Inter-token Latency"), ("e2el_ms", "End-to-end Latency")):
        short = key.split("_")[0].upper()
        lines.append(f"{title:-^50}")
        for stat in ("mean", "median", "p99"):
            label = f"{stat.capitalize() if stat != 'p99' else 'P99'} {short} (ms):"
            lines.append(f"{label:<40}{s[key][stat]:>10.2f}")
    if s["errors"]:
        lines.append(f"errors: {s['errors']}")
    lines.append("=" * 50)
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kiln bench serve", description=__doc__.split("\n\n")[0])
    p.add_argument("--url", default="http://127.0.0.1:8000", help="server base URL (without /v1)")
    p.add_argument("--model", default=None, help="model name (default: the server's first model)")
    p.add_argument("--api-key", default=None)
    p.add_argument("--num-prompts", type=int, default=100)
    p.add_argument("--request-rate", type=float, default=float("inf"),
                   help="requests per second, Poisson arrivals (inf: all at once)")
    p.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of the arrival gaps (1 = Poisson)")
    p.add_argument("--max-concurrency", type=int, default=None, help="at most this many requests in flight")
    p.add_argument("--input-len", type=int, default=32, help="prompt length in tokens")
    p.add_argument("--output-len", type=int, default=32, help="generated tokens per request (ignore_eos)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, default=None, help="write the results here")
    return p


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    if args.num_prompts < 1 or args.input_len < 1 or args.output_len < 1:
        print("kiln bench serve: --num-prompts, --input-len and --output-len must be positive", file=sys.stderr)
        return 2
    if args.request_rate <= 0 or (args.max_concurrency is not None and args.max_concurrency < 1):
        print("kiln bench serve: --request-rate and --max-concurrency must be positive", file=sys.stderr)
        return 2
    cfg = BenchConfig(url=args.url.rstrip("/"), model=args.model, num_prompts=args.num_prompts,
                      request_rate=args.request_rate, max_concurrency=args.max_concurrency,
                      input_len=args.input_len, output_len=args.output_len, seed=args.seed,
                      burstiness=args.burstiness)
    try:
        summary = asyncio.run(run(cfg, args.api_key))
    except httpx.HTTPError as exc:
        print(f"kiln bench serve: cannot reach {cfg.url}: {exc}", file=sys.stderr)
        return 1
    print(format_summary(summary))
    if args.json is not None:
        cfg_json = dict(summary["config"])
        if math.isinf(cfg_json["request_rate"]):
            cfg_json["request_rate"] = "inf"
        args.json.write_text(json.dumps({**summary, "config": cfg_json}, indent=2))
    return 0 if summary["failed"] == 0 else 1
