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
import sys
import time
from dataclasses import asdict
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx

from engine.bench.serve_data import (
    BenchConfig,
    SampleRequest,
    ServerTokenizer,
    arrival_gaps,
    random_requests,
    sharegpt_requests,
)
from engine.bench.serve_metrics import METRICS, RequestResult, format_summary, parse_goodput, summarize

BACKENDS = {"openai": "/v1/completions", "openai-chat": "/v1/chat/completions"}


def base_url(url: str) -> str:
    """The server's root from any OpenAI base URL: trailing slashes and a trailing /v1 removed."""
    url = url.rstrip("/")
    return url[:-3] if url.endswith("/v1") else url


# ---------------------------------------------------------------- requests
def request_body(cfg: BenchConfig, model: str, req: SampleRequest) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": model,
        "temperature": cfg.temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    for name in ("top_p", "top_k", "min_p"):
        if getattr(cfg, name) is not None:
            body[name] = getattr(cfg, name)
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


async def one_request(
    http: httpx.AsyncClient, cfg: BenchConfig, model: str, req: SampleRequest | str | list[int], headers: dict[str, str]
) -> RequestResult:
    if not isinstance(req, SampleRequest):
        req = SampleRequest(req, len(req) if isinstance(req, list) else 0, cfg.output_len)
    res = RequestResult(prompt_len=req.prompt_len)
    start = time.perf_counter()
    last = start
    chunks = 0
    try:
        async with http.stream(
            "POST", f"{cfg.url}{cfg.endpoint}", json=request_body(cfg, model, req), headers=headers
        ) as resp:
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


async def run(
    cfg: BenchConfig,
    api_key: str | None = None,
    progress: bool = True,
    percentiles=(99.0,),
    goodput: dict[str, float] | None = None,
) -> dict[str, Any]:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0, connect=30.0), limits=limits) as http:
        model = cfg.model
        if model is None:
            resp = await http.get(f"{cfg.url}/v1/models", headers=headers)
            resp.raise_for_status()
            model = resp.json()["data"][0]["id"]
        tok = ServerTokenizer(http, cfg, headers)
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


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kiln bench serve", description=__doc__.split("\n\n")[0], allow_abbrev=False)
    p.add_argument(
        "--base-url",
        "--url",
        dest="url",
        default=None,
        help="server URL, with or without /v1 (default: http://HOST:PORT)",
    )
    p.add_argument("--host", default="127.0.0.1", help="(default: 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="(default: 8000)")
    p.add_argument(
        "--backend",
        choices=list(BACKENDS),
        default="openai",
        help="openai: /v1/completions; openai-chat: /v1/chat/completions (default: openai)",
    )
    p.add_argument("--endpoint", default=None, help="API path (default: the backend's)")
    p.add_argument("--model", default=None, help="model name (default: the server's first model)")
    p.add_argument("--api-key", default=None, help="sent as Authorization: Bearer KEY")
    p.add_argument("--dataset-name", choices=["random", "sharegpt"], default="random", help="(default: random)")
    p.add_argument("--dataset-path", default=None, help="ShareGPT-format JSON file (--dataset-name sharegpt)")
    p.add_argument(
        "--num-prompts",
        "--num-requests",
        dest="num_prompts",
        type=int,
        default=100,
        help="requests to send (default: 100)",
    )
    p.add_argument(
        "--input-len",
        "--random-input-len",
        "--prompt-len",
        dest="input_len",
        type=int,
        default=32,
        help="random dataset: prompt tokens (default: 32)",
    )
    p.add_argument(
        "--output-len",
        "--random-output-len",
        dest="output_len",
        type=int,
        default=32,
        help="random dataset: tokens to generate (default: 32)",
    )
    p.add_argument(
        "--random-range-ratio",
        type=float,
        default=0.0,
        help="random dataset: lengths drawn from [len*(1-r), len*(1+r)] (default: 0)",
    )
    p.add_argument("--sharegpt-output-len", type=int, default=None, help="sharegpt: fixed output length")
    p.add_argument(
        "--request-rate",
        type=float,
        default=float("inf"),
        help="requests per second, Poisson arrivals (default: inf, all at once)",
    )
    p.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of the arrival gaps (1 = Poisson)")
    p.add_argument("--max-concurrency", type=int, default=None, help="at most this many requests in flight")
    p.add_argument("--ignore-eos", action="store_true", help="generate exactly the output length")
    p.add_argument("--temperature", type=float, default=0.0, help="(default: 0, greedy)")
    p.add_argument("--top-p", type=float, default=None, help="sent when given (default: the server's)")
    p.add_argument("--top-k", type=int, default=None, help="sent when given (default: the server's)")
    p.add_argument("--min-p", type=float, default=None, help="sent when given (default: the server's)")
    p.add_argument(
        "--goodput",
        nargs="+",
        default=None,
        metavar="KEY:MS",
        help="SLOs for goodput, e.g. ttft:500 tpot:50 e2el:2000 (milliseconds)",
    )
    p.add_argument(
        "--percentile-metrics",
        default="ttft,tpot,itl,e2el",
        help="metrics to report percentiles of (default: ttft,tpot,itl,e2el)",
    )
    p.add_argument("--metric-percentiles", default="99", help="percentiles to report, e.g. 50,90,99 (default: 99)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--disable-tqdm", action="store_true", help="no progress bar")
    p.add_argument("--save-result", action="store_true", help="write the results as JSON")
    p.add_argument("--result-dir", default=".", help="folder for --save-result (default: .)")
    p.add_argument(
        "--result-filename",
        default=None,
        help="file name for --save-result (default: BACKEND-RATEqps-MODEL-TIMESTAMP.json)",
    )
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
    cfg = BenchConfig(
        url=url,
        model=args.model,
        num_prompts=args.num_prompts,
        request_rate=args.request_rate,
        max_concurrency=args.max_concurrency,
        input_len=args.input_len,
        output_len=args.output_len,
        seed=args.seed,
        burstiness=args.burstiness,
        backend=args.backend,
        endpoint=args.endpoint or BACKENDS[args.backend],
        dataset_name=args.dataset_name,
        dataset_path=args.dataset_path,
        range_ratio=args.random_range_ratio,
        ignore_eos=args.ignore_eos,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        min_p=args.min_p,
        sharegpt_output_len=args.sharegpt_output_len,
    )
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
        name = args.result_filename or (
            f"{args.backend}-{rate}qps-{Path(str(summary['model'])).name}-"
            f"{datetime.now().strftime('%Y%m%d-%H%M%S')}.json"
        )
        path = Path(args.result_dir) / name
    if path is not None:
        cfg_json = dict(summary["config"])
        if math.isinf(cfg_json["request_rate"]):
            cfg_json["request_rate"] = "inf"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({**summary, "config": cfg_json, "date": datetime.now().isoformat()}, indent=2))
        print(f"results written to {path}")
    return 0 if summary["failed"] == 0 else 1
