"""`kiln bench serve`: load an OpenAI-compatible server and measure what users feel (vLLM's
`vllm bench serve`, same flag names and metric definitions, so numbers compare).

Any base URL works, with or without /v1 (`--base-url http://host:8000/v1`). Requests stream from
/v1/completions (`--backend openai`) or /v1/chat/completions (`--backend openai-chat`), arriving
as a Poisson process at --request-rate (gamma gaps with --burstiness), at most --max-concurrency
in flight. Prompts come from `--dataset-name random` (random token ids of --input-len, decoded to
text for chat) or `--dataset-name sharegpt --dataset-path FILE` (a ShareGPT-format JSON file:
the first human turn is the prompt, the reply's length the output length).

Metrics:
  TTFT  arrival of the first chunk with text - request start
  TPOT  (e2e - TTFT) / (output tokens - 1), per request with more than one output token
  ITL   every gap between successive streamed chunks that carry text
  E2EL  last byte - request start
  throughput: completed requests / duration, output tokens / duration, all tokens / duration
  goodput: requests meeting every --goodput SLO (e.g. `ttft:500 tpot:50`, in ms) / duration
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import math
import random
import sys
import time
from dataclasses import asdict, dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx

_WORDS = ("the quick brown fox jumps over lazy dog kiln oven clay pottery brick model token batch block page cache "
          "memory attention value key step request stream server engine graph kernel hello world paris france "
          "number text answer question assistant user code data fast slow small large").split()
METRICS = ("ttft", "tpot", "itl", "e2el")
BACKENDS = {"openai": "/v1/completions", "openai-chat": "/v1/chat/completions"}


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
class SampleRequest:
    prompt: str | list[int]
    prompt_len: int
    output_len: int


@dataclass
class BenchConfig:
    url: str  # the server's base URL, without /v1
    model: str | None
    num_prompts: int
    request_rate: float
    max_concurrency: int | None
    input_len: int
    output_len: int
    seed: int
    burstiness: float = 1.0
    backend: str = "openai"
    endpoint: str = "/v1/completions"
    dataset_name: str = "random"
    dataset_path: str | None = None
    range_ratio: float = 0.0
    ignore_eos: bool = False
    temperature: float = 0.0
    sharegpt_output_len: int | None = None


def base_url(url: str) -> str:
    """The server's root from any OpenAI base URL: trailing slashes and a trailing /v1 removed."""
    url = url.rstrip("/")
    return url[:-3] if url.endswith("/v1") else url


def percentile(values: list[float], q: float) -> float:
    """Linear-interpolated percentile (numpy's default method), q in [0, 100]."""
    if not values:
        return 0.0
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def _label(q: float) -> str:
    return f"p{q:g}"


def _stats(values: list[float], percentiles=(99.0,), scale: float = 1000.0) -> dict[str, float]:
    out = {"mean": scale * sum(values) / len(values) if values else 0.0,
           "median": scale * percentile(values, 50),
           "std": scale * _std(values)}
    for q in percentiles:
        out[_label(q)] = scale * percentile(values, q)
    return out


def _std(values: list[float]) -> float:
    if len(values) < 2:
        return 0.0
    mean = sum(values) / len(values)
    return math.sqrt(sum((v - mean) ** 2 for v in values) / len(values))


def _tpot(r: RequestResult) -> float | None:
    return (r.latency - r.ttft) / (r.output_tokens - 1) if r.output_tokens > 1 else None


def meets_slos(r: RequestResult, slos: dict[str, float]) -> bool:
    """Goodput: every SLO (milliseconds) met; TPOT of a one-token request counts as met."""
    values = {"ttft": r.ttft, "e2el": r.latency, "tpot": _tpot(r)}
    return all(values[k] is None or 1000.0 * values[k] <= limit for k, limit in slos.items())


def summarize(results: list[RequestResult], duration: float, percentiles=(99.0,),
              goodput: dict[str, float] | None = None) -> dict[str, Any]:
    done = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in done)
    in_tokens = sum(r.prompt_len for r in done)
    tpot = [t for r in done if (t := _tpot(r)) is not None]
    itl = [g for r in done for g in r.itl]
    errors: dict[str, int] = {}
    for r in results:
        if not r.ok:
            errors[r.error] = errors.get(r.error, 0) + 1
    per_second = (lambda x: x / duration) if duration > 0 else (lambda x: 0.0)
    summary = {
        "duration_s": duration,
        "completed": len(done),
        "failed": len(results) - len(done),
        "errors": errors,
        "total_input_tokens": in_tokens,
        "total_output_tokens": out_tokens,
        "request_throughput": per_second(len(done)),
        "output_throughput": per_second(out_tokens),
        "total_token_throughput": per_second(in_tokens + out_tokens),
        "ttft_ms": _stats([r.ttft for r in done], percentiles),
        "tpot_ms": _stats(tpot, percentiles),
        "itl_ms": _stats(itl, percentiles),
        "e2el_ms": _stats([r.latency for r in done], percentiles),
    }
    if goodput:
        good = sum(meets_slos(r, goodput) for r in done)
        summary.update(goodput_slos_ms=goodput, good_requests=good, request_goodput=per_second(good))
    return summary


def arrival_gaps(n: int, rate: float, seed: int, burstiness: float = 1.0) -> list[float]:
    """Seconds to wait before each request: gamma(burstiness) gaps with mean 1/rate (Poisson at 1)."""
    if math.isinf(rate):
        return [0.0] * n
    rng = random.Random(seed)
    theta = 1.0 / (rate * burstiness)
    return [rng.gammavariate(burstiness, theta) for _ in range(n)]


# ---------------------------------------------------------------- datasets
class _Tokenizer:
    """The server's /tokenize and /detokenize (kiln and vLLM have them); words when it has none."""

    def __init__(self, http: httpx.AsyncClient, cfg: BenchConfig, headers: dict[str, str]) -> None:
        self.http, self.cfg, self.headers = http, cfg, headers
        self.available = True

    async def encode(self, text: str) -> list[int] | None:
        if self.available:
            try:
                resp = await self.http.post(f"{self.cfg.url}/tokenize", headers=self.headers,
                                            json={"prompt": text, "add_special_tokens": False})
                if resp.status_code == 200:
                    return resp.json()["tokens"]
            except (httpx.HTTPError, KeyError, ValueError):
                pass
            self.available = False
        return None

    async def decode(self, ids: list[int]) -> str | None:
        try:
            resp = await self.http.post(f"{self.cfg.url}/detokenize", json={"tokens": ids}, headers=self.headers)
            if resp.status_code == 200:
                return resp.json()["prompt"]
        except (httpx.HTTPError, KeyError, ValueError):
            pass
        return None

    async def count(self, text: str) -> int:
        ids = await self.encode(text)
        return len(ids) if ids is not None else len(text.split())


def _lengths(rng: random.Random, n: int, mean: int, ratio: float) -> list[int]:
    lo, hi = max(1, int(mean * (1 - ratio))), max(1, int(mean * (1 + ratio)))
    return [rng.randint(lo, hi) for _ in range(n)]


async def random_requests(tok: _Tokenizer, cfg: BenchConfig) -> list[SampleRequest]:
    """Random token ids drawn from the server's own vocabulary (fixed seed); chat gets their text."""
    rng = random.Random(cfg.seed)
    text = " ".join(rng.choice(_WORDS) for _ in range(max(cfg.input_len * 4, 256)))
    pool = sorted(set(await tok.encode(text) or []))
    in_lens = _lengths(rng, cfg.num_prompts, cfg.input_len, cfg.range_ratio)
    out_lens = _lengths(rng, cfg.num_prompts, cfg.output_len, cfg.range_ratio)
    requests = []
    for in_len, out_len in zip(in_lens, out_lens):
        if not pool:  # no /tokenize: words (about one token each for common words)
            requests.append(SampleRequest(" ".join(rng.choice(_WORDS) for _ in range(in_len)), in_len, out_len))
            continue
        ids = [rng.choice(pool) for _ in range(in_len)]
        prompt: str | list[int] = ids
        if cfg.backend == "openai-chat":
            prompt = await tok.decode(ids) or " ".join(rng.choice(_WORDS) for _ in range(in_len))
        requests.append(SampleRequest(prompt, in_len, out_len))
    return requests


def read_sharegpt(path: str | Path) -> list[tuple[str, str]]:
    """(first human turn, the reply) of each ShareGPT conversation with at least two turns."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"--dataset-path {path}: {exc}") from None
    if not isinstance(data, list):
        raise ValueError(f"--dataset-path {path}: expected a JSON list of conversations (ShareGPT format)")
    pairs = []
    for item in data:
        turns = (item.get("conversations") or item.get("conversation") or []) if isinstance(item, dict) else []
        if len(turns) >= 2 and all(isinstance(t, dict) and "value" in t for t in turns[:2]):
            pairs.append((turns[0]["value"], turns[1]["value"]))
    if not pairs:
        raise ValueError(f"--dataset-path {path}: no conversation with two turns "
                         '({"conversations": [{"from": "human", "value": ...}, {"from": "gpt", ...}]})')
    return pairs


async def sharegpt_requests(tok: _Tokenizer, cfg: BenchConfig) -> list[SampleRequest]:
    """vLLM's sampling: shuffled with the seed; pairs with a prompt or reply under 4 tokens, a
    prompt over 1024 or a total over 2048 are skipped (unless the output length is fixed)."""
    pairs = read_sharegpt(cfg.dataset_path)
    random.Random(cfg.seed).shuffle(pairs)
    requests: list[SampleRequest] = []
    for prompt, reply in pairs:
        if len(requests) == cfg.num_prompts:
            break
        prompt_len = await tok.count(prompt)
        output_len = cfg.sharegpt_output_len or await tok.count(reply)
        if cfg.sharegpt_output_len is None and (prompt_len < 4 or output_len < 4 or prompt_len > 1024
                                                or prompt_len + output_len > 2048):
            continue
        requests.append(SampleRequest(prompt, prompt_len, output_len))
    if len(requests) < cfg.num_prompts:
        logging.getLogger("engine.bench").warning("the dataset gave %d usable prompts of the %d asked for",
                                                  len(requests), cfg.num_prompts)
    return requests


# ---------------------------------------------------------------- requests
def request_body(cfg: BenchConfig, model: str, req: SampleRequest) -> dict[str, Any]:
    body: dict[str, Any] = {"model": model, "temperature": cfg.temperature, "stream": True,
                            "stream_options": {"include_usage": True}}
    if cfg.ignore_eos:
        body["ignore_eos"] = True
    if cfg.backend == "openai-chat":
        prompt = req.prompt if isinstance(req.prompt, str) else " ".join(map(str, req.prompt))
        body.update(messages=[{"role": "user", "content": prompt}], max_completion_tokens=req.output_len)
    else:
        body.update(prompt=req.prompt, max_tokens=req.output_len)
    return body


def _chunk_text(event: dict[str, Any]) -> bool:
    for choice in event.get("choices", []):
        delta = choice.get("delta") or {}
        if choice.get("text") or delta.get("content") or delta.get("reasoning_content"):
            return True
    return False


async def one_request(http: httpx.AsyncClient, cfg: BenchConfig, model: str, req: SampleRequest | str | list[int],
                      headers: dict[str, str]) -> RequestResult:
    if not isinstance(req, SampleRequest):
        req = SampleRequest(req, len(req) if isinstance(req, list) else 0, cfg.output_len)
    res = RequestResult(prompt_len=req.prompt_len)
    start = time.perf_counter()
    last = start
    chunks = 0
    try:
        async with http.stream("POST", f"{cfg.url}{cfg.endpoint}", json=request_body(cfg, model, req),
                               headers=headers) as resp:
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
                if _chunk_text(event):
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


async def run(cfg: BenchConfig, api_key: str | None = None, progress: bool = True,
              percentiles=(99.0,), goodput: dict[str, float] | None = None) -> dict[str, Any]:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0, connect=30.0), limits=limits) as http:
        model = cfg.model
        if model is None:
            resp = await http.get(f"{cfg.url}/v1/models", headers=headers)
            resp.raise_for_status()
            model = resp.json()["data"][0]["id"]
        tok = _Tokenizer(http, cfg, headers)
        requests = await (sharegpt_requests(tok, cfg) if cfg.dataset_name == "sharegpt" else random_requests(tok, cfg))
        gaps = arrival_gaps(len(requests), cfg.request_rate, cfg.seed + 1, cfg.burstiness)
        sem = asyncio.Semaphore(cfg.max_concurrency) if cfg.max_concurrency else None
        bar = _progress(len(requests), progress)

        async def limited(req: SampleRequest) -> RequestResult:
            if sem is None:
                result = await one_request(http, cfg, model, req, headers)
            else:
                async with sem:
                    result = await one_request(http, cfg, model, req, headers)
            if bar is not None:
                bar.update(1)
            return result

        start = time.perf_counter()
        tasks = []
        for req, gap in zip(requests, gaps):
            if gap > 0:
                await asyncio.sleep(gap)
            tasks.append(asyncio.ensure_future(limited(req)))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
        if bar is not None:
            bar.close()
    summary = summarize(list(results), duration, percentiles, goodput)
    summary["model"] = model
    summary["config"] = asdict(cfg)
    summary["input_lens"] = [r.prompt_len for r in results]
    summary["output_lens"] = [r.output_tokens for r in results]
    summary["ttfts"] = [r.ttft for r in results]
    summary["itls"] = [r.itl for r in results]
    summary["request_errors"] = [r.error for r in results]
    return summary


def _progress(total: int, enabled: bool):
    if not enabled:
        return None
    from tqdm import tqdm

    return tqdm(total=total, desc="requests", unit="req", file=sys.stderr)


def format_summary(s: dict[str, Any], metrics=("ttft", "tpot", "itl", "e2el"), percentiles=(99.0,)) -> str:
    lines = ["============ Serving Benchmark Result ============",
             f"{'Successful requests:':<40}{s['completed']:>10}",
             f"{'Failed requests:':<40}{s['failed']:>10}",
             f"{'Benchmark duration (s):':<40}{s['duration_s']:>10.2f}",
             f"{'Total input tokens:':<40}{s['total_input_tokens']:>10}",
             f"{'Total generated tokens:':<40}{s['total_output_tokens']:>10}",
             f"{'Request throughput (req/s):':<40}{s['request_throughput']:>10.2f}"]
    if "request_goodput" in s:
        lines.append(f"{'Request goodput (req/s):':<40}{s['request_goodput']:>10.2f}")
    lines += [f"{'Output token throughput (tok/s):':<40}{s['output_throughput']:>10.2f}",
              f"{'Total token throughput (tok/s):':<40}{s['total_token_throughput']:>10.2f}"]
    titles = {"ttft": "Time to First Token", "tpot": "Time per Output Token (excl. 1st token)",
              "itl": "Inter-token Latency", "e2el": "End-to-end Latency"}
    for key in metrics:
        short = key.upper()
        stats = s[f"{key}_ms"]
        lines.append(f"{titles[key]:-^50}")
        lines.append(f"{f'Mean {short} (ms):':<40}{stats['mean']:>10.2f}")
        lines.append(f"{f'Median {short} (ms):':<40}{stats['median']:>10.2f}")
        for q in percentiles:
            lines.append(f"{f'P{q:g} {short} (ms):':<40}{stats[_label(q)]:>10.2f}")
    if s["errors"]:
        lines.append(f"errors: {s['errors']}")
    lines.append("=" * 50)
    return "\n".join(lines)


def parse_goodput(items: list[str] | None) -> dict[str, float] | None:
    if not items:
        return None
    slos = {}
    for item in items:
        name, _, value = item.partition(":")
        if name not in ("ttft", "tpot", "e2el") or not value:
            raise ValueError(f"--goodput {item!r}: expected ttft:MS, tpot:MS or e2el:MS")
        try:
            slos[name] = float(value)
        except ValueError:
            raise ValueError(f"--goodput {item!r}: {value!r} is not a number of milliseconds") from None
        if slos[name] < 0:
            raise ValueError(f"--goodput {item!r}: must not be negative")
    return slos


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kiln bench serve", description=__doc__.split("\n\n")[0],
                                allow_abbrev=False)
    p.add_argument("--base-url", "--url", dest="url", default=None,
                   help="server URL, with or without /v1 (default: http://HOST:PORT)")
    p.add_argument("--host", default="127.0.0.1", help="(default: 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="(default: 8000)")
    p.add_argument("--backend", choices=list(BACKENDS), default="openai",
                   help="openai: /v1/completions; openai-chat: /v1/chat/completions (default: openai)")
    p.add_argument("--endpoint", default=None, help="API path (default: the backend's)")
    p.add_argument("--model", default=None, help="model name (default: the server's first model)")
    p.add_argument("--api-key", default=None, help="sent as Authorization: Bearer KEY")
    p.add_argument("--dataset-name", choices=["random", "sharegpt"], default="random", help="(default: random)")
    p.add_argument("--dataset-path", default=None, help="ShareGPT-format JSON file (--dataset-name sharegpt)")
    p.add_argument("--num-prompts", "--num-requests", dest="num_prompts", type=int, default=100,
                   help="requests to send (default: 100)")
    p.add_argument("--input-len", "--random-input-len", "--prompt-len", dest="input_len", type=int, default=32,
                   help="random dataset: prompt tokens (default: 32)")
    p.add_argument("--output-len", "--random-output-len", dest="output_len", type=int, default=32,
                   help="random dataset: tokens to generate (default: 32)")
    p.add_argument("--random-range-ratio", type=float, default=0.0,
                   help="random dataset: lengths drawn from [len*(1-r), len*(1+r)] (default: 0)")
    p.add_argument("--sharegpt-output-len", type=int, default=None, help="sharegpt: fixed output length")
    p.add_argument("--request-rate", type=float, default=float("inf"),
                   help="requests per second, Poisson arrivals (default: inf, all at once)")
    p.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of the arrival gaps (1 = Poisson)")
    p.add_argument("--max-concurrency", type=int, default=None, help="at most this many requests in flight")
    p.add_argument("--ignore-eos", action="store_true", help="generate exactly the output length")
    p.add_argument("--temperature", type=float, default=0.0, help="(default: 0, greedy)")
    p.add_argument("--goodput", nargs="+", default=None, metavar="KEY:MS",
                   help="SLOs for goodput, e.g. ttft:500 tpot:50 e2el:2000 (milliseconds)")
    p.add_argument("--percentile-metrics", default="ttft,tpot,itl,e2el",
                   help="metrics to report percentiles of (default: ttft,tpot,itl,e2el)")
    p.add_argument("--metric-percentiles", default="99", help="percentiles to report, e.g. 50,90,99 (default: 99)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--disable-tqdm", action="store_true", help="no progress bar")
    p.add_argument("--save-result", action="store_true", help="write the results as JSON")
    p.add_argument("--result-dir", default=".", help="folder for --save-result (default: .)")
    p.add_argument("--result-filename", default=None,
                   help="file name for --save-result (default: BACKEND-RATEqps-MODEL-TIMESTAMP.json)")
    p.add_argument("--json", type=Path, default=None, help="write the results to this file")
    return p


def _check(args: argparse.Namespace) -> str | None:
    if args.num_prompts < 1 or args.input_len < 1 or args.output_len < 1:
        return "--num-prompts, --input-len and --output-len must be positive"
    if args.request_rate <= 0 or (args.max_concurrency is not None and args.max_concurrency < 1):
        return "--request-rate and --max-concurrency must be positive"
    if not 0 <= args.random_range_ratio < 1:
        return "--random-range-ratio must be in [0, 1)"
    if args.dataset_name == "sharegpt" and not args.dataset_path:
        return "--dataset-name sharegpt needs --dataset-path FILE"
    unknown = set(args.percentile_metrics.split(",")) - set(METRICS)
    if unknown:
        return f"--percentile-metrics: unknown {sorted(unknown)} (choose from {', '.join(METRICS)})"
    return None


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    problem = _check(args)
    try:
        goodput = parse_goodput(args.goodput)
        percentiles = tuple(float(q) for q in args.metric_percentiles.split(","))
    except ValueError as exc:
        problem = problem or str(exc)
    if problem:
        print(f"kiln bench serve: {problem}", file=sys.stderr)
        return 2
    logging.getLogger("httpx").setLevel(logging.WARNING)  # no log line per request
    url = base_url(args.url or f"http://{args.host}:{args.port}")
    cfg = BenchConfig(url=url, model=args.model, num_prompts=args.num_prompts,
                      request_rate=args.request_rate, max_concurrency=args.max_concurrency,
                      input_len=args.input_len, output_len=args.output_len, seed=args.seed,
                      burstiness=args.burstiness, backend=args.backend,
                      endpoint=args.endpoint or BACKENDS[args.backend], dataset_name=args.dataset_name,
                      dataset_path=args.dataset_path, range_ratio=args.random_range_ratio,
                      ignore_eos=args.ignore_eos, temperature=args.temperature,
                      sharegpt_output_len=args.sharegpt_output_len)
    try:
        summary = asyncio.run(run(cfg, args.api_key, not args.disable_tqdm, percentiles, goodput))
    except httpx.HTTPError as exc:
        print(f"kiln bench serve: cannot reach {cfg.url}: {exc}", file=sys.stderr)
        return 1
    except ValueError as exc:
        print(f"kiln bench serve: {exc}", file=sys.stderr)
        return 2
    print(format_summary(summary, args.percentile_metrics.split(","), percentiles))
    path = args.json
    if args.save_result:
        rate = "inf" if math.isinf(args.request_rate) else f"{args.request_rate:g}"
        name = args.result_filename or (f"{args.backend}-{rate}qps-{Path(str(summary['model'])).name}-"
                                        f"{datetime.now().strftime('%Y%m%d-%H%M%S')}.json")
        path = Path(args.result_dir) / name
    if path is not None:
        cfg_json = dict(summary["config"])
        if math.isinf(cfg_json["request_rate"]):
            cfg_json["request_rate"] = "inf"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({**summary, "config": cfg_json, "date": datetime.now().isoformat()}, indent=2))
        print(f"results written to {path}")
    return 0 if summary["failed"] == 0 else 1
